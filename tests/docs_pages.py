"""Running the ```python snippets of a docs/ page in order, in one namespace, as a reader would paste them."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def snippets(page: str) -> list[str]:
    return _BLOCK.findall((DOCS / page).read_text())


def run_page(page: str, min_blocks: int = 1) -> None:
    blocks = snippets(page)
    assert len(blocks) >= min_blocks, f"docs/{page} lost its snippets"
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for i, code in enumerate(blocks, 1):
        exec(compile(code, f"docs/{page} (python block {i})", "exec"), namespace)  # noqa: S102
