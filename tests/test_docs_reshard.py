"""The runnable snippets of docs/reshard.md, executed in order, as a reader would paste them."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def test_reshard_page(tmp_path, monkeypatch, capsys) -> None:
    blocks = _BLOCK.findall((DOCS / "reshard.md").read_text())
    assert len(blocks) >= 8, "docs/reshard.md lost its snippets"
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for i, code in enumerate(blocks, 1):
        exec(compile(code, f"docs/reshard.md (python block {i})", "exec"), namespace)  # noqa: S102
    out = capsys.readouterr().out
    for shown in [
        "45 torch.Size([128, 64])",
        "torch.Size([64, 64])",
        "torch.Size([288, 64])",
        "False",
        "2 torch.Size([512, 64])",
        "torch.Size([192, 64])",
        "tensor(0.)",
        "torch.Size([43168])",
        "rules_overlap",
        "pattern_unmatched",
    ]:
        assert shown in out, shown
