"""bench/read.py runs end to end at a tiny size and prints every row of its tables."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench" / "read.py"


def _bench_module():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("bench_read", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(out: str) -> dict[str, list[str]]:
    rows = {}
    for line in out.splitlines():
        if line.startswith("| ") and not line.startswith("| reader"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    return rows


def test_read_bench_prints_every_row(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("tensorstore")
    bench = _bench_module()
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--size", "tiny", "--repeat", "1", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert out.startswith("`python bench/read.py --size tiny --repeat 1 --dir ")
    rows = _rows(out)
    for case in [*bench.FULL_CASES, *bench.SLICE_CASES]:
        assert case in rows, f"no row for {case!r} in:\n{out}"
    for case in bench.FULL_CASES:
        gbps, seconds, vs_peer, vs_dev = (float(x) for x in rows[case][:4])
        assert gbps > 0 and seconds > 0 and vs_peer > 0 and vs_dev > 0
    # ucl's slice reads the chunks it needs: at the tiny size one chunk holds the whole tensor
    assert rows[bench.SLICE_CASES[0]][2] != "-"
    assert "**Targets**" in out
    assert (tmp_path / "ucl").is_dir() and (tmp_path / "state.safetensors").is_file()


PEERS = ROOT / "bench" / "peers.py"


@pytest.mark.slow  # ~80 s: ./dev test-long
def test_peers_bench_prints_the_table_with_probes_and_phases(tmp_path: Path) -> None:
    # bench/peers.py (issue 14's whole table): ucl and safetensors at the tiny size, every section, one round
    pytest.importorskip("safetensors")
    proc = subprocess.run(
        [sys.executable, str(PEERS), "--size", "tiny", "--reps", "1", "--steady", "1",
         "--only", "ucl,safetensors,probe", "--dir", str(tmp_path / "peers")],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    rows = {}
    for line in out.splitlines():
        if line.startswith("| "):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if cells[0] not in ("metric", "save"):  # the headers of the table and of the phases
                rows.setdefault(cells[0], cells[1:])
    for metric in ("save durable, first of a process", "save durable, steady", "save blocked, first of a process",
                   "full load, cold: ucl.open(p).load(flat=True)", "full load, cold: load_into (preallocated)",
                   "open + 1/8 of the embedding's rows, cold", "open + 1/8 of the embedding's rows, warm"):
        assert metric in rows, f"no row {metric!r} in:\n{out}"
        ucl_cell, vs_peer = rows[metric][6], rows[metric][7]
        assert ucl_cell != "-" and float(ucl_cell.split()[0]) > 0, (metric, rows[metric])
        assert vs_peer.endswith("x") and float(vs_peer[:-1]) > 0, (metric, rows[metric])
    # the same-run write probe, and ucl's phases
    assert rows["save durable, steady"][5] != "-"
    # the write probe over the sizes of ucl's own files, and what ucl's steady save reaches of it
    assert re.search(r"The write probe over the sizes of ucl's files of a step \([\d,]+ files.*"
                     r"ucl's steady save reaches \d+% of its speed", out), out
    assert "where the time goes" in out and "| steady" in out
    # what the device and the CPUs did, from the kernel's counters of the disk holding the repository
    # (a filesystem without a block device, such as tmpfs, has none: the table is then left out)
    st = os.stat(tmp_path)
    if os.path.exists(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat"):
        files = next((k for k in rows if re.fullmatch(r"save: write probe \(ucl's [\d,]+ files\)", k)), None)
        assert files is not None, f"no device row of the write probe over ucl's files in:\n{out}"
        for case in ("save, steady: ucl", "save: write probe (one file)", files, "load: ucl load_into",
                     "load: read probe"):
            assert case in rows, f"no device row {case!r} in:\n{out}"
            assert int(rows[case][3]) > 0, (case, rows[case])  # requests the block layer completed


def test_composite_bench_prints_both_tables(tmp_path: Path) -> None:
    """bench/composite.py at the tiny preset: a row per policy in the saves table, a row per composite
    threshold in the resume table, and the seeds' repositories removed when it made them itself."""
    bench = ROOT / "bench" / "composite.py"
    args = ["--preset", "tiny", "--warmup", "2", "--saves", "3", "--resume", "2", "--seeds", "2",
            "--thresholds", "0", "0.5"]
    proc = subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore", "TMPDIR": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    saves, resume_table = proc.stdout.split("**Resume**")
    rows = _rows(saves)
    names = ["full", "lossless delta", "composite t=0", "composite t=0.5"]
    for name in names:
        assert name in rows, f"no row for {name!r} in:\n{proc.stdout}"
    # threshold 0 stores every changed group: the bytes per step equal lossless deltas' (spec/delta.md §9)
    assert rows["composite t=0"][0] == rows["lossless delta"][0]
    assert float(rows["full"][1].rstrip("x")) == 1.0
    assert set(_rows(resume_table)) == {"policy", "composite t=0", "composite t=0.5"}
    assert _rows(resume_table)["composite t=0"][1:4] == ["+0.00000"] * 3  # nothing stale: an exact resume
    assert not list(tmp_path.glob("ucl-composite-*"))  # its own temporary directory is gone


@pytest.mark.slow  # 5 cases, each a fresh training process: ~25 s (./dev test-long)
def test_goodput_bench_prints_every_case() -> None:
    """bench/goodput.py at the tiny preset, failures too rare to hit: every case trains to the end (its
    child exits 0 after the last step) and has a row; the ideal run's ETTR is 1."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "goodput.py"), "--preset", "tiny", "--steps", "6",
                           "--mtbf", "100000", "--seeds", "1", "--dcp-every", "3"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    for case in ["no checkpoint, no failure", "ucl tiered", "ucl tiered, Young/Daly", "ucl disk", "DCP async every 3"]:
        assert case in rows, f"no row for {case!r} in:\n{proc.stdout}"
    assert rows["no checkpoint, no failure"][1] == "1.000"


@pytest.mark.slow  # ~40 s: ./dev test-long
def test_reshard_flat_bench_prints_every_case(tmp_path: Path) -> None:
    """bench/reshard_flat.py at its tiny size (~40 s: 15 fresh processes): a row per (case, rank), each
    read within 3x its local state (at this size the shard indexes weigh)."""
    bench = ROOT / "bench" / "reshard_flat.py"
    proc = subprocess.run([sys.executable, str(bench), "--tiny", "--reps", "1", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("| (") and "->" in ln]
    assert len(rows) == 10, proc.stdout
    for ln in rows:
        ratio = float(ln.split("|")[6].strip().rstrip("x"))
        assert 1.0 <= ratio < 3.0, ln


def test_delta_read_bench_prints_every_read(tmp_path: Path) -> None:
    """bench/delta_read.py at a tiny model: a row per read, cold and warm, each step read back checked
    against the state written (its first round's --check), medians of two rounds, and the full step's own ratio
    exactly 1."""
    bench = ROOT / "bench" / "delta_read.py"
    args = ["--d-model", "32", "--layers", "1", "--vocab", "64", "--warmup", "1", "--chain", "2", "--repeat", "2",
            "--dir", str(tmp_path)]
    proc = subprocess.run([sys.executable, str(bench), *args], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    for temp in ("cold", "warm"):
        for label in ("full step (delta=None)", "base='previous', chain depth 2",
                      "base='full', 1 delta 2 steps from its base"):
            assert f"{temp}: {label}" in rows, f"no row {temp}: {label} in:\n{proc.stdout}"
        assert rows[f"{temp}: full step (delta=None)"][1] == "1.00x"


@pytest.mark.s3
def test_remote_bench_prints_every_case(tmp_path: Path) -> None:
    """bench/remote.py: a loopback S3 server of its own, every case read back and checked by the bench
    (it raises when a reader returns other tensors than were saved), the server's request counts."""
    pytest.importorskip("moto")
    pytest.importorskip("s3fs")
    script = ROOT / "bench" / "remote.py"
    spec = importlib.util.spec_from_file_location("bench_remote", script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    proc = subprocess.run([sys.executable, str(script), "--size", "tiny", "--reps", "1"], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _rows(proc.stdout)
    for case in mod.CASES:
        assert case in rows, f"no row for {case!r} in:\n{proc.stdout}"
        seconds, _, get = rows[case][:3]
        assert float(seconds.removesuffix(" s")) > 0 and int(get) > 0
