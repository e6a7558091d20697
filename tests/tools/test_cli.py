"""The ``ucl`` command: every subcommand's output, JSON and exit codes; gc, compact and diff behind them."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import ucl
from ucl.format.repository import Repository
from ucl.plan.save import all_shards, array_for, shard_block
from ucl.tools.cli import main
from ucl.tools.compact import compact
from ucl.tools.gc import gc
from ucl.tools.progress import Progress
from ucl.write.step import StepWriter


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"model": {f"layers.{i}.{k}": torch.randn(16, 8, generator=g) for i in range(3) for k in ("attn", "mlp")},
            "emb": torch.randn(10, 8, generator=g), "step": seed}


@pytest.fixture
def repo(tmp_path):
    p = tmp_path / "ckpt"
    ucl.save(state(1), p, step=1)
    s = state(1)
    s["model"]["layers.1.mlp"] += 1e-3
    s["emb"][0, 0] = 5.0
    ucl.save(s, p, step=2)
    return p


# -- usage -----------------------------------------------------------------------------------------
def test_help_lists_commands_and_examples(capsys) -> None:
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for cmd in ("ls", "info", "validate", "diff", "gc", "compact", "import", "export"):
        assert f"\n  {cmd} " in out
        rc, sub, _ = run(capsys, cmd, "--help")
        assert rc == 0 and "examples:\n  ucl " + cmd in sub and "--json" in sub and "exit status: 0 success" in sub


@pytest.mark.parametrize(("argv", "message"), [
    ([], "ucl: error: the following arguments are required: COMMAND"),
    (["frobnicate"], "ucl: error: argument COMMAND: invalid choice: 'frobnicate' (choose from 'ls', 'info', "
                     "'validate', 'diff', 'gc', 'compact', 'import', 'export')"),
    (["diff", "x"], "ucl diff: error: the following arguments are required: B"),
    (["diff", "@3", "@4"], "ucl diff: error: A must name a repository, got '@3'"),
    (["compact", "p"], "ucl compact: error: the following arguments are required: --step"),
    (["info", "p", "--step", "-1"], "ucl info: error: argument --step: invalid step '-1' (an integer >= 0)"),
    (["info", "p", "--step", "x"], "ucl info: error: argument --step: invalid step 'x' (an integer >= 0)"),
    (["export", "p", "d", "--max-shard-size", "5XB"],
     "ucl export: error: argument --max-shard-size: invalid size '5XB' (use e.g. 500MB, 5GB, 2GiB)"),
    (["gc", "p", "--grace", "soon"], "ucl gc: error: argument --grace: invalid duration 'soon' (seconds >= 0)"),
    (["import", "a"], "ucl import: error: the following arguments are required: DST"),
    (["compact", "p", "--step", "1", "--compression", "lz4"],
     "ucl compact: error: argument --compression: invalid choice: 'lz4' (choose from 'zstd')"),
])
def test_usage_errors_exit_2_with_exact_messages(capsys, argv, message) -> None:
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.splitlines()[-1] == message


# -- ls, info, validate ----------------------------------------------------------------------------
def test_ls_info_validate(capsys, repo) -> None:
    rc, out, _ = run(capsys, "ls", str(repo))
    assert rc == 0 and out.splitlines()[0].split() == ["step", "kind", "size", "time"]
    assert [line.split()[:2] for line in out.splitlines()[1:]] == [["1", "full"], ["2", "full"]]
    rc, out, _ = run(capsys, "ls", str(repo), "--json")
    rows = json.loads(out)
    assert rc == 0 and [(r["step"], r["kind"], r["parent"]) for r in rows] == [(1, "full", None), (2, "full", None)]
    rc, out, _ = run(capsys, "info", str(repo), "--step", "1")
    assert rc == 0 and out.startswith("step 1 (full), 7 tensors, ")
    assert "layout: none (saved by one process)" in out and "model/layers.0.attn" in out
    rc, out, _ = run(capsys, "info", str(repo), "--json")
    info = json.loads(out)
    assert info["step"] == 2 and info["chain"] == [2] and info["layout"] is None and info["source"] is None
    assert info["tensors"][0] == {"name": "model/layers.0.attn", "dtype": "float32", "shape": [16, 8],
                                  "chunk_shape": [16, 8], "shards": 1, "bytes": 512, "delta": False, "logical": None}
    rc, out, _ = run(capsys, "validate", str(repo))
    assert rc == 0 and out.strip().endswith(": 2 step(s), 14 shard(s), 0.0 MB checked: valid")
    rc, out, _ = run(capsys, "validate", str(repo), "--json", "--step", "1")
    assert rc == 0 and json.loads(out)["valid"] is True and json.loads(out)["steps"] == [1]


def test_invalid_and_missing_exit_1(capsys, repo, tmp_path) -> None:
    shard = repo / "steps" / "2" / "emb" / "c" / "0" / "0"
    data = bytearray(shard.read_bytes())
    data[3] ^= 1
    shard.write_bytes(bytes(data))
    rc, out, _ = run(capsys, "validate", str(repo))
    assert rc == 1 and "INVALID [checksum_mismatch]" in out and out.strip().endswith("invalid: 1 problem(s)")
    rc, out, _ = run(capsys, "validate", str(repo), "--json")
    assert rc == 1 and json.loads(out)["problems"][0]["code"] == "checksum_mismatch"
    rc, out, err = run(capsys, "info", str(tmp_path / "nope"))
    assert rc == 1 and out == ""
    assert err == f"ucl info: error [not_found]: no ucl repository at {tmp_path / 'nope'} (zarr.json is missing)\n"
    rc, out, err = run(capsys, "info", str(tmp_path / "nope"), "--json")
    assert rc == 1 and json.loads(out)["error"]["code"] == "not_found" and err == ""
    rc, out, err = run(capsys, "info", str(repo), "--step", "7")
    assert rc == 1 and "step 7 does not exist" in err


# -- diff ------------------------------------------------------------------------------------------
def test_diff_statistics(tmp_path) -> None:
    from ucl.tools.diff import diff_steps

    a = {"w": torch.tensor([1.0, 2.0, 3.0, 4.0]), "z": torch.tensor([0.0, 1.0]), "n": torch.tensor([1.0, 2.0]),
         "i": torch.arange(6, dtype=torch.int32).reshape(2, 3), "s": torch.tensor(2.5), "gone": torch.ones(1),
         "shape": torch.ones(2)}
    b = {"w": torch.tensor([1.0, 2.0, 3.0, 5.0]), "z": torch.tensor([-0.0, 1.0]),
         "n": torch.tensor([float("nan"), 2.0]),
         "i": torch.arange(6, dtype=torch.int32).reshape(2, 3), "s": torch.tensor(2.5), "new": torch.ones(1),
         "shape": torch.ones(3)}
    ucl.save(a, tmp_path / "a", step=0)
    ucl.save(b, tmp_path / "b", step=4)
    r = diff_steps(tmp_path / "a", tmp_path / "b", block_bytes=8)  # several blocks per tensor
    by = {t.name: t for t in r.tensors}
    w = by["w"]
    assert (w.max_abs_diff, w.changed_fraction, w.bitwise_equal) == (1.0, 0.25, False)
    assert w.rel_l2 == pytest.approx(1 / 30**0.5)
    assert (by["z"].max_abs_diff, by["z"].changed_fraction, by["z"].bitwise_equal) == (0.0, 0.5, False)
    assert by["n"].max_abs_diff == float("inf") and by["n"].to_dict()["rel_l2"] == "inf"
    assert by["i"].bitwise_equal and by["s"].bitwise_equal and by["i"].rel_l2 == 0.0
    assert (by["gone"].status, by["new"].status, by["shape"].status) == ("only_a", "only_b", "incompatible")
    assert [t.name for t in r.tensors][-1] == "new" and not r.equal
    assert r.summary() == {"tensors": 8, "equal": 2, "changed": 3, "only_a": 1, "only_b": 1, "incompatible": 1}


def test_diff_command_text_json_and_plot(capsys, repo, tmp_path) -> None:
    rc, out, _ = run(capsys, "diff", f"{repo}@1", "@2")
    lines = out.splitlines()
    assert rc == 0 and lines[0] == f"a: {repo} step 1" and lines[1] == f"b: {repo} step 2"
    row = next(line for line in lines if line.startswith("model/layers.1.mlp"))
    assert row.split()[1:] == ["1.000e-03", row.split()[2], "100.00%", "no"]
    assert lines[-1] == "7 tensor(s): 5 bitwise equal, 2 changed"
    rc, out, _ = run(capsys, "diff", f"{repo}@1", f"{repo}@2", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["summary"]["changed"] == 2 and doc["equal"] is False and doc["plot"] is None
    png = tmp_path / "change.png"
    rc, out, _ = run(capsys, "diff", f"{repo}@1", "@2", "--plot", str(png))
    assert rc == 0 and out.strip().endswith(f"plot written to {png}")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rc, out, _ = run(capsys, "diff", str(repo), str(repo))  # newest step of each: equal
    assert rc == 0 and out.splitlines()[-1] == "7 tensor(s): 7 bitwise equal, 0 changed"


def test_diff_plot_without_matplotlib_fails_clearly(capsys, repo, tmp_path, monkeypatch) -> None:
    for m in ("matplotlib", "matplotlib.colors", "matplotlib.figure"):
        monkeypatch.setitem(sys.modules, m, None)
    rc, out, err = run(capsys, "diff", f"{repo}@1", "@2", "--plot", str(tmp_path / "x.png"))
    assert rc == 1 and out == ""
    assert err == "ucl diff: error: --plot needs matplotlib, which is not installed (pip install matplotlib)\n"
    assert not (tmp_path / "x.png").exists()
    rc, out, _ = run(capsys, "diff", f"{repo}@1", "@2", "--plot", str(tmp_path / "x.png"), "--json")
    assert rc == 1 and json.loads(out)["error"]["code"] == "missing_dependency"


# -- gc --------------------------------------------------------------------------------------------
def litter(path) -> None:
    """An uncommitted step, a stray file in a committed step, a temp record, junk under steps/."""
    r = Repository.open(path)
    w = StepWriter(r, 3)
    w.begin()
    t = torch.ones(4)
    meta = array_for("x", t)
    for c in all_shards(meta):
        w.write_shard(meta, c, shard_block(meta, c, t))
    (path / "steps" / "1" / "stray.bin").write_bytes(b"x" * 10)
    (path / "commits" / "4.json.tmp-123").write_bytes(b"{}")
    (path / "steps" / "junk").mkdir()
    (path / "steps" / "junk" / "f").write_bytes(b"yy")


def test_gc_deletes_only_what_no_commit_record_references(capsys, repo) -> None:
    litter(repo)
    before = ucl.load(repo, 1, flat=True)
    rc, out, _ = run(capsys, "gc", str(repo), "--dry-run", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["dry_run"] and doc["deleted"] == ["steps/1/stray.bin"]  # the rest is too young
    assert {k["key"] for k in doc["kept"]} == {"commits/4.json.tmp-123", "steps/3", "steps/junk"}
    assert (repo / "steps" / "1" / "stray.bin").exists()
    rc, out, _ = run(capsys, "gc", str(repo), "--grace", "0", "--dry-run")
    assert rc == 0 and out.splitlines()[-1] == f"{repo}: would delete 4 file(s), 0.0 MB"
    assert "would delete steps/3/x/c/0" in out
    rc, out, _ = run(capsys, "gc", str(repo), "--grace", "0")
    assert rc == 0 and out.splitlines()[-1] == f"{repo}: deleted 4 file(s), 0.0 MB"
    assert sorted(os.listdir(repo / "steps")) == ["1", "2", "zarr.json"]
    assert sorted(os.listdir(repo / "commits")) == ["1.json", "2.json"]
    assert ucl.validate(repo).ok and Repository.open(repo).steps() == [1, 2]
    after = ucl.load(repo, 1, flat=True)
    assert all(torch.equal(before[k], after[k]) for k in before)
    rc, out, _ = run(capsys, "gc", str(repo))
    assert out.strip() == f"{repo}: deleted 0 file(s), 0.0 MB"


def test_gc_grace_and_corrupt_records_and_writer_lock(capsys, repo) -> None:
    from ucl.format.lock import WriterLock

    litter(repo)
    report = gc(repo, now=time.time() + 7200)  # two hours later, the default grace has passed
    assert len(report.deleted) == 4
    (repo / "commits" / "2.json").write_bytes(b"garbage")
    (repo / "steps" / "2" / "stray").write_bytes(b"z")
    report = gc(repo, grace=0)
    assert report.deleted == [] and report.kept == [
        {"key": "steps/2", "reason": "commit record unreadable (corrupt_commit_record): left alone"}]
    lock = WriterLock.acquire(Repository.open(repo))
    try:
        rc, _, err = run(capsys, "gc", str(repo))
        assert rc == 1 and err.startswith("ucl gc: error [writer_locked]: another writer holds ")
        rc, out, _ = run(capsys, "gc", str(repo), "--dry-run")  # a dry run takes no lock
        assert rc == 0
    finally:
        lock.release()


# -- compact ---------------------------------------------------------------------------------------
def test_compact_of_a_full_step_is_a_no_op(capsys, repo) -> None:
    before = (repo / "commits" / "2.json").read_bytes()
    rc, out, _ = run(capsys, "compact", str(repo), "--step", "2")
    assert rc == 0 and out == "step 2 is already a full step: nothing to do\n"
    rc, out, _ = run(capsys, "compact", str(repo), "--step", "2", "--json")
    assert rc == 0 and json.loads(out) == {"step": 2, "changed": False,
                                           "message": "step 2 is already a full step: nothing to do", "bytes": 0}
    assert (repo / "commits" / "2.json").read_bytes() == before
    rc, _, err = run(capsys, "compact", str(repo), "--step", "9")
    assert rc == 1 and "step 9 does not exist" in err


def test_compact_rewrite_protocol_keeps_values_bit_exact(capsys, repo) -> None:
    want = ucl.load(repo, 2, flat=True)
    rc, out, _ = run(capsys, "compact", str(repo), "--step", "2", "--force", "--compression", "zstd")
    assert rc == 0 and out == "step 2 rewritten as a full step\n"
    with ucl.open(repo, 2) as ckpt:
        assert ckpt.meta.arrays["emb"].compression["name"] == "zstd"
        assert ckpt.meta.tree == ucl.open(repo, 1).meta.tree
    got = ucl.load(repo, 2, flat=True)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert ucl.validate(repo).ok and os.listdir(repo / "compact") == []


class Crash(Exception):
    pass


@pytest.mark.parametrize("phase", ["staged", "journal", "uncommitted", "removed", "moved", "committed"])
def test_compact_interrupted_at_any_phase_rolls_back_or_forward(repo, phase) -> None:
    want = ucl.load(repo, 2, flat=True)

    def hook(p: str) -> None:
        if p == phase:
            raise Crash(p)

    with pytest.raises(Crash):
        compact(repo, 2, compression="zstd", force=True, _hook=hook)
    steps = Repository.open(repo).steps()
    if phase == "staged":  # before the journal: the old step is intact, staging is garbage
        assert steps == [1, 2] and ucl.validate(repo).ok
        assert ucl.open(repo, 2).meta.arrays["emb"].compression is None
        assert gc(repo, grace=0).deleted and not os.listdir(repo / "compact")
        return
    assert (2 in steps) == (phase in ("journal", "committed"))  # invisible in the window, never half-visible
    kept = gc(repo, grace=0)  # gc leaves an unfinished compaction alone
    assert (repo / "compact" / "2.json").exists()
    assert {"key": "compact/2.json", "reason": f"compaction of step 2 is unfinished: run 'ucl compact {repo} "
            "--step 2'"} in kept.kept
    assert not any(k.startswith(("steps/2/", "compact/2/")) for k in kept.deleted)
    r = compact(repo, 2)
    assert r.changed and r.message == "finished the interrupted compaction of step 2"
    assert Repository.open(repo).steps() == [1, 2] and ucl.validate(repo).ok
    assert ucl.open(repo, 2).meta.arrays["emb"].compression is not None
    got = ucl.load(repo, 2, flat=True)
    assert all(torch.equal(want[k], got[k]) for k in want)
    assert os.listdir(repo / "compact") == []


# -- import / export -------------------------------------------------------------------------------
def test_import_export_commands(capsys, tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    ts = {"a.weight": torch.randn(4, 3), "b.bias": torch.arange(5, dtype=torch.int64)}
    save_file(ts, tmp_path / "m.safetensors")
    rc, out, err = run(capsys, "import", str(tmp_path / "m.safetensors"), str(tmp_path / "r"))
    assert rc == 0 and err == ""  # no progress bar when stderr is not a terminal
    assert out == (f"imported {tmp_path / 'm.safetensors'} (safetensors, 2 tensors, 0.0 MB) as step 0 of "
                   f"{tmp_path / 'r'}\n")
    rc, out, _ = run(capsys, "import", str(tmp_path / "m.safetensors"), str(tmp_path / "r"), "--step", "5", "--json")
    assert rc == 0 and json.loads(out) == {"step": 5, "source": "safetensors", "tensors": 2, "bytes": 88,
                                           "src": str(tmp_path / "m.safetensors"), "dst": str(tmp_path / "r")}
    rc, out, _ = run(capsys, "export", str(tmp_path / "r"), str(tmp_path / "o" / "x.safetensors"), "--step", "0")
    assert rc == 0 and out == f"exported 2 tensors (0.0 MB) to 1 file(s): {tmp_path / 'o' / 'x.safetensors'}\n"
    back = load_file(tmp_path / "o" / "x.safetensors")
    assert all(torch.equal(back[k], v) for k, v in ts.items())
    rc, out, _ = run(capsys, "export", str(tmp_path / "r"), str(tmp_path / "o2"), "--max-shard-size", "50B", "--json")
    doc = json.loads(out)
    assert rc == 0 and len(doc["files"]) == 2 and doc["index"] == str(tmp_path / "o2" / "model.safetensors.index.json")
    rc, _, err = run(capsys, "import", str(tmp_path / "missing"), str(tmp_path / "r"))
    assert rc == 1 and err == f"ucl import: error [not_found]: {tmp_path / 'missing'} does not exist\n"


def test_python_dash_m_ucl(repo) -> None:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    r = subprocess.run([sys.executable, "-m", "ucl", "ls", str(repo), "--json"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and [row["step"] for row in json.loads(r.stdout)] == [1, 2] and r.stderr == ""


# -- progress --------------------------------------------------------------------------------------
class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_only_on_a_terminal() -> None:
    quiet = io.StringIO()
    with Progress(100, "import", stream=quiet) as bar:
        bar.update(50)
    assert quiet.getvalue() == ""
    tty = TTY()
    with Progress(2_000_000, "export", stream=tty) as bar:
        bar.update(1_000_000)
        bar.update(1_000_000)
    text = tty.getvalue()
    assert text.startswith("\rexport [") and text.endswith("\n")
    assert "100%  2.0 MB / 2.0 MB" in text and "#" * 28 in text


def _engine_writes_deltas() -> bool:
    import inspect

    from ucl.write.manager import CheckpointManager

    return "delta" in inspect.signature(CheckpointManager).parameters


@pytest.mark.skipif(not _engine_writes_deltas(), reason="the engine does not write delta steps yet")
def test_compact_a_real_delta_step_keeps_its_children_valid(capsys, tmp_path) -> None:
    from ucl.write.manager import CheckpointManager

    g = torch.Generator().manual_seed(0)
    s = {"w": torch.randn(256, 64, generator=g), "frozen": torch.randn(10, generator=g), "n": 0}
    from ucl.write.policy import DeltaPolicy

    with CheckpointManager(tmp_path / "d", delta=DeltaPolicy(base="previous")) as mgr:  # a chain 3 -> 2 -> 1 -> 0
        for step in range(4):
            s["w"][step] += 1
            s["n"] = step
            mgr.save(step, s).result()
    repo = Repository.open(tmp_path / "d")
    if repo.commit_record(2).kind != "delta":
        pytest.skip("the engine's policy wrote step 2 full")
    want = {st: ucl.load(tmp_path / "d", st, flat=True) for st in (2, 3)}
    rc, out, _ = run(capsys, "info", str(tmp_path / "d"), "--step", "3", "--json")
    assert rc == 0 and json.loads(out)["chain"] == [3, 2, 1, 0]
    rc, out, _ = run(capsys, "compact", str(tmp_path / "d"), "--step", "2")
    assert rc == 0 and out == "step 2 rewritten as a full step\n"
    assert repo.commit_record(2).kind == "full" and repo.commit_record(2).parent is None
    rc, out, _ = run(capsys, "info", str(tmp_path / "d"), "--step", "3", "--json")
    assert json.loads(out)["chain"] == [3, 2]
    for st in (2, 3):  # the compacted step and the delta on top of it read back bit-exactly
        got = ucl.load(tmp_path / "d", st, flat=True)
        assert all(torch.equal(want[st][k], got[k]) for k in want[st])
    assert ucl.validate(tmp_path / "d").ok
