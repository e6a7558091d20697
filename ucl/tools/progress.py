"""Progress bars for long CLI operations: on stderr, and only when stderr is a terminal.

The bar lives in :mod:`ucl.io.progress` (so that reads below the tools can draw one too); this module is
the tools' name for it. ``UCL_PROGRESS=0`` / ``1`` forces bars off / on.

>>> from ucl.tools import progress
>>> with progress.bar(total_bytes, "import") as bar:
...     bar.update(n)          # after each tensor
"""

from __future__ import annotations

from ucl.io.progress import LOAD_MIN_BYTES, Progress, bar, enabled, min_bytes, watch

__all__ = ["LOAD_MIN_BYTES", "Progress", "bar", "enabled", "min_bytes", "watch"]
