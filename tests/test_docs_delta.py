"""The runnable snippets of docs/delta.md, executed in order, as a reader would paste them."""

from __future__ import annotations

import re
from pathlib import Path

import torch

DOCS = Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_delta_page(tmp_path, monkeypatch, capsys) -> None:
    blocks = _BLOCK.findall((DOCS / "delta.md").read_text())
    assert len(blocks) >= 5, "docs/delta.md lost its snippets"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "__version__", torch.__version__)  # the page patches and restores it
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for i, code in enumerate(blocks, 1):
        exec(compile(code, f"docs/delta.md (python block {i})", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in out[:5]] == [["1", "full", "None"]] + [[str(s), "delta", "1"]
                                                                               for s in range(2, 6)]
    assert out[5:7] == ["True", "True"]  # the slice, validation
    assert out[7] == "True 4 torch.optim.adamw.AdamW"  # step 5 is gradient records of step 4
    assert out[8].startswith("['grad/")
    assert out[9] == "True True"  # replayed bit-exactly, exact
    assert out[10:12] == ["unknown_extension", "False ReplayWarning"]
    assert out[12:] == ["step 3 rewritten as a full step", "full True", "True"]
