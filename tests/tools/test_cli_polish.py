"""The ``ucl`` command's rough edges, each filed once: help, step parsing, --version without torch, the diff
plot of a real model, load_into's shape messages, and the manager's increasing steps."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucl
from ucl.errors import InvalidArgumentError, LayoutShapeError
from ucl.format.repository import Repository
from ucl.testing import gpt
from ucl.tools.cli import main
from ucl.tools.diff import diff_steps, plot, plot_groups

COMMANDS = ("ls", "info", "validate", "diff", "gc", "compact", "import", "export")


def run(capsys, *argv: str) -> tuple[int, str, str]:  # type: ignore[no-untyped-def]
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- --help ----------------------------------------------------------------------------------------
def test_help_lists_each_command_once(capsys) -> None:  # type: ignore[no-untyped-def]
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    lines = out.splitlines()
    for cmd in COMMANDS:
        listed = [line for line in lines if line.split()[:1] == [cmd]]
        assert len(listed) == 1, (cmd, listed)
    assert out.count("commands:") == 1 and "examples:\n  ucl ls ckpt" in out


# -- diff PATH@STEP --------------------------------------------------------------------------------
@pytest.mark.parametrize(("argv", "message"), [
    (["diff", "ckpt@abc", "@200"],
     "ucl diff: error: argument A: invalid step 'abc' in 'ckpt@abc': write PATH@STEP or @STEP with STEP an "
     "integer >= 0"),
    (["diff", "ckpt@100", "@-1"],
     "ucl diff: error: argument B: invalid step '-1' in '@-1': write PATH@STEP or @STEP with STEP an integer >= 0"),
    (["diff", "ckpt@100", "@99999999999999999999"],
     "ucl diff: error: argument B: invalid step '99999999999999999999' in '@99999999999999999999': write "
     "PATH@STEP or @STEP with STEP an integer >= 0"),
    (["diff", "@3", "@4"], "ucl diff: error: A must name a repository, got '@3'"),
])
def test_diff_reports_an_invalid_step(capsys, argv, message) -> None:  # type: ignore[no-untyped-def]
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert err.splitlines()[-1] == message


def test_diff_paths_with_an_at_sign(capsys, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    p = tmp_path / "run@lr"  # an existing directory whose name holds an @
    ucl.save({"w": torch.ones(3)}, p, step=1)
    ucl.save({"w": torch.zeros(3)}, p, step=2)
    rc, out, _ = run(capsys, "diff", str(p), f"{p}@1")
    assert rc == 0 and out.splitlines()[:2] == [f"a: {p} step 2", f"b: {p} step 1"]
    rc, out, _ = run(capsys, "diff", f"{p}@1", "@2")
    assert rc == 0 and out.splitlines()[-1] == "1 tensor(s): 0 bitwise equal, 1 changed"


# -- --version -------------------------------------------------------------------------------------
def test_version_is_instant_and_imports_no_engine() -> None:
    code = ("import sys; from ucl.tools.cli import main; rc = main(['--version']); "
            "heavy = sorted(m for m in ('torch', 'numpy', 'zarr', 'ucl.read', 'ucl.write', 'ucl.io.native') "
            "if m in sys.modules); print(heavy); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.splitlines() == [f"ucl {ucl.__version__}", "[]"]
    assert ucl.__version__ == importlib.metadata.version("ucl")
    r = subprocess.run([sys.executable, "-X", "importtime", "-m", "ucl", "--version"], capture_output=True,
                       text=True, timeout=60, check=True)
    assert r.stdout == f"ucl {ucl.__version__}\n"
    assert "torch" not in {line.split("|")[-1].strip().split(".")[0] for line in r.stderr.splitlines()}


def test_import_ucl_is_lazy() -> None:
    code = "import sys, ucl; print('torch' in sys.modules); ucl.save; print('torch' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert r.stdout.split() == ["False", "True"]
    for name in ucl.__all__:
        assert getattr(ucl, name) is not None
    assert "save" in dir(ucl)
    with pytest.raises(AttributeError, match="no attribute 'nothing_here'"):
        ucl.nothing_here  # noqa: B018


# -- diff --plot on a real model -------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpt_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gpt") / "ckpt"
    cfg = dataclasses.replace(gpt.get_config("tiny"), n_layers=6)
    model = gpt.GPT(cfg, seed=0)
    opt = gpt.make_optimizer(model, cfg)
    data = gpt.SyntheticData(cfg)
    for step in (1, 2):
        gpt.train_step(model, opt, data.batch(step))
        ucl.save(gpt.full_state(model, opt), path, step=step)
    return path


def test_diff_plot_groups_by_parameter_and_layer(gpt_repo: Path, tmp_path: Path) -> None:
    report = diff_steps(gpt_repo, gpt_repo, 1, 2)
    assert any(t.name == "optim/state/38/exp_avg" for t in report.tensors)  # 39 parameters, 6 layers
    layered, flat = plot_groups(report)
    assert {k for per in layered.values() for k in per} == set(range(6))  # the x axis: the 6 layers
    assert all(set(per) == set(range(6)) for per in layered.values())
    labels = [*layered, *flat]
    assert not [x for x in labels if "state/" in x or x.endswith("step") or "model/" in x]
    assert list(layered)[:3] == ["layers.*.input_norm.weight", "layers.*.input_norm.weight · exp_avg",
                                 "layers.*.input_norm.weight · exp_avg_sq"]
    assert "layers.*.mlp.down.weight · exp_avg_sq" in layered
    assert list(flat) == [f"{p}{s}" for p in ("embedding.word_embeddings.weight", "final_norm.weight",
                                              "lm_head.weight") for s in ("", " · exp_avg", " · exp_avg_sq")]
    png = tmp_path / "change.png"
    plot(report, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_diff_plot_without_parameter_names_never_takes_indices_for_layers(tmp_path: Path) -> None:
    # an optimizer over tensors the step does not hold: its indices label themselves
    opt_state = {"state": {i: {"step": torch.tensor(float(i)), "exp_avg": torch.randn(7, 5)} for i in range(20)},
                 "param_groups": [{"lr": 0.1, "params": list(range(20))}]}
    ucl.save({"optim": opt_state, "steps": torch.tensor(3)}, tmp_path / "c", step=1)
    opt_state["state"][4]["exp_avg"] += 1
    ucl.save({"optim": opt_state, "steps": torch.tensor(4)}, tmp_path / "c", step=2)
    layered, flat = plot_groups(diff_steps(tmp_path / "c", tmp_path / "c", 1, 2))
    assert layered == {}
    assert list(flat) == [f"optim/param {i} · exp_avg" for i in range(20)]  # no counters ("step", "steps")


# -- load_into shape messages ----------------------------------------------------------------------
def test_load_into_lists_every_shape_mismatch_in_plain_words(tmp_path: Path) -> None:
    ucl.save({"w": torch.ones(4, 3), "b": torch.ones(3), "c": torch.ones(2)}, tmp_path, step=5)
    dest = {"w": torch.zeros(3, 4), "b": torch.zeros(4), "c": torch.zeros(2)}
    with pytest.raises(LayoutShapeError) as e:
        ucl.load_into(tmp_path, dest)
    assert str(e.value) == ("load_into: 2 destination tensors have the wrong shape for step 5:\n"
                            "  'w': expected [4, 3] (its shape in step 5), found [3, 4]\n"
                            "  'b': expected [3] (its shape in step 5), found [4]")
    assert "layout" not in str(e.value) and e.value.tensor == "w"
    assert not dest["c"].any()  # nothing was filled

    layout = 'ucl-layout 1\nmesh tp=2\n"w": shard(0, tp)\n'
    with pytest.raises(LayoutShapeError) as e:
        ucl.load_into(tmp_path, {"w": torch.zeros(4, 3)}, layout=layout, mesh="tp=2", rank=1)
    assert str(e.value) == ("load_into: 1 destination tensor has the wrong shape for rank 1 under the target "
                            "layout:\n  'w': expected [2, 3] (rank 1's part under the layout), found [4, 3]")


# -- CheckpointManager: steps only increase -----------------------------------------------------------
def test_manager_refuses_a_step_before_the_previous_one(tmp_path: Path) -> None:
    with ucl.CheckpointManager(tmp_path) as mgr:
        mgr.save(5, {"w": torch.ones(3)})
        with pytest.raises(InvalidArgumentError, match=r"step 3 is not after step 5, which this manager saved "
                                                        "last: steps only increase") as e:
            mgr.save(3, {"w": torch.ones(3)})
        assert e.value.code == "invalid_argument"
        mgr.save(6, {"w": torch.ones(3)})
        mgr.wait()
    assert Repository.open(tmp_path).steps() == [5, 6]
