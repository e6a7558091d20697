"""A tiny progress bar for long CLI operations: on stderr, and only when stderr is a terminal.

>>> with Progress(total_bytes, "import") as bar:
...     bar.update(n)          # after each tensor
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

_WIDTH = 28


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable


class Progress:
    """A one-line bar ``desc [#####.....]  42%  1.2 GB / 2.9 GB  310.0 MB/s``, redrawn at most 10 times a second.

    Parameters
    ----------
    total
        Units of work (bytes) expected; 0 or less draws a counter without a bar.
    desc
        What is being done, shown first.
    stream
        Where to draw (default ``sys.stderr``).
    enabled
        None (default): only when ``stream`` is a TTY. False draws nothing, True always draws.
    """

    def __init__(self, total: int, desc: str, *, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self.total, self.desc, self.done = int(total), desc, 0
        self._start = time.monotonic()
        self._last = 0.0

    def update(self, n: int) -> None:
        """Count ``n`` more units of work and redraw if due."""
        self.done += int(n)
        if self.enabled and (time.monotonic() - self._last >= 0.1 or self.done >= self.total > 0):
            self._draw()

    def _draw(self) -> None:
        self._last = time.monotonic()
        elapsed = max(self._last - self._start, 1e-9)
        rate = f"{_human(self.done / elapsed)}/s"
        if self.total > 0:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * _WIDTH) + "." * (_WIDTH - int(frac * _WIDTH))
            line = f"{self.desc} [{bar}] {frac * 100:3.0f}%  {_human(self.done)} / {_human(self.total)}  {rate}"
        else:
            line = f"{self.desc}  {_human(self.done)}  {rate}"
        self.stream.write("\r" + line + "\x1b[K")
        self.stream.flush()

    def close(self) -> None:
        """Draw the final state and end the line (nothing when disabled)."""
        if self.enabled:
            self._draw()
            self.stream.write("\n")
            self.stream.flush()
            self.enabled = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
