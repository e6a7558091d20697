"""The demo (examples/demo.py, which ./dev demo runs) runs end to end on the tiny model and says what it checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from examples import demo as demo_module

DEMO = Path(demo_module.__file__)


def test_demo_runs_and_every_check_passes(tmp_path) -> None:  # type: ignore[no-untyped-def]
    out_dir = tmp_path / "demo"
    cmd = [sys.executable, str(DEMO), "--preset", "tiny", "--steps", "3", "--crash-after", "1",
           "--resume-steps", "1", "--dir", str(out_dir)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONWARNINGS": "error"})
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for line in (
        "[ok] every step committed: steps 1..3",
        "[ok] child killed by SIGKILL",
        "[ok] ucl.open(repo) gives the latest committed step: step 4",
        "[ok] partial step 5 is invisible",
        "[ok] step 5 loss after resume == uninterrupted",
        "(bit-exact)",
        "[ok] state at step 6 after resume == uninterrupted",
        "[ok] slice reads only the inner chunks it needs",
        "[ok] zarr-python reads model/embedding.word_embeddings.weight",
        "[ok] tensorstore (zarr3 driver) reads model/embedding.word_embeddings.weight",
        "summary",
        "failed",
        "DEMO OK",
    ):
        assert line in out, f"missing {line!r} in:\n{out}"
    assert "0 failed" in out
    assert ("[ok] ucl.validate(repo): valid" in out) or ("skipped: ucl.validate" in out)
    assert os.path.exists(out_dir / "ckpt" / "commits" / "6.json")


def test_demo_refuses_a_directory_it_did_not_write(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    (tmp_path / "precious.txt").write_text("keep me")
    assert demo_module.main(["--dir", str(tmp_path), "--preset", "tiny"]) == 2
    assert (tmp_path / "precious.txt").read_text() == "keep me"
    assert "not a previous demo output" in capsys.readouterr().err


def test_acts_are_hooks() -> None:
    names = [n for n, _ in demo_module.ACTS]
    assert names[:6] == ["train", "crash", "resume", "lazy_read", "validate", "native"]
    assert all(callable(f) for _, f in demo_module.ACTS)
