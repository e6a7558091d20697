"""Progress bars of long operations: one line on stderr, drawn only when stderr is a terminal.

Bytes only (this layer knows nothing of the format): a count of bytes done out of a total, redrawn at
most 10 times a second with the rate. Every long command and call draws one: ``ucl validate``, import,
export, compact, diff (``ucl.tools``), and loads of large steps (``ucl.read``, through :func:`watch`,
which polls a byte counter the readers keep anyway, so the reads themselves pay nothing).

When a bar is drawn (``enabled=None``, the default, see :func:`enabled`):

- ``UCL_PROGRESS=0`` (or ``off``, ``false``, ``no``) never; ``UCL_PROGRESS=1`` (``on``, ``true``, ``yes``)
  always, even into a pipe or a file;
- otherwise only when the stream is a terminal, and not under CI (``CI`` set, as CI services do);
- library calls (``ucl.load``, ``Checkpoint.load``, ``ucl.validate``) only above ``min_total`` bytes:
  256 MiB, or ``UCL_PROGRESS_MIN_BYTES``; the ``ucl`` command draws a bar for any size.

An explicit ``enabled=True`` / ``False`` overrides all of that. One bar at a time: while a bar is being
drawn, a bar opened inside it (an export's reads, a load inside a command) stays silent.

>>> with bar(total_bytes, "export") as b:
...     b.update(n)          # after each tensor
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

__all__ = ["LOAD_MIN_BYTES", "Progress", "bar", "enabled", "min_bytes", "watch"]

LOAD_MIN_BYTES = 256 << 20  # library calls below this draw nothing (UCL_PROGRESS_MIN_BYTES overrides)
INTERVAL = 0.1  # seconds between redraws
_WIDTH = 28
_ON = {"1", "on", "true", "yes", "always"}
_OFF = {"0", "off", "false", "no", "never"}

_active_lock = threading.Lock()
_active = 0  # bars being drawn now (process-wide: two bars on one terminal line would garble each other)


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError  # unreachable


def enabled(stream: TextIO | None = None) -> bool:
    """Whether a bar on ``stream`` (default ``sys.stderr``) is drawn by default: ``UCL_PROGRESS`` if set,
    else whether the stream is a terminal (and, for the process's stderr, not under CI)."""
    env = os.environ.get("UCL_PROGRESS", "").strip().lower()
    if env in _OFF:
        return False
    if env in _ON:
        return True
    if stream is None:
        stream = sys.stderr
    if stream is sys.stderr and os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    isatty = getattr(stream, "isatty", None)
    try:
        return bool(isatty and isatty())
    except (ValueError, OSError):  # a closed stream
        return False


def min_bytes() -> int:
    """The size below which library calls draw no bar: ``UCL_PROGRESS_MIN_BYTES``, else 256 MiB."""
    try:
        return max(0, int(os.environ.get("UCL_PROGRESS_MIN_BYTES", LOAD_MIN_BYTES)))
    except ValueError:
        return LOAD_MIN_BYTES


class Progress:
    """A one-line bar ``desc [#####.....]  42%  1.2 GB / 2.9 GB  310.0 MB/s``, redrawn at most 10 times a
    second.

    Parameters
    ----------
    total
        Units of work (bytes) expected; 0 or less draws a counter without a bar.
    desc
        What is being done, shown first.
    stream
        Where to draw (default ``sys.stderr``).
    enabled
        None (default): see :func:`enabled` (a terminal, ``UCL_PROGRESS``). False draws nothing, True always
        draws (unless another bar is being drawn).
    min_total
        With ``enabled=None``: draw nothing when ``total`` is below this (library calls on small data).

    ``update`` may be called from several threads.
    """

    def __init__(self, total: int, desc: str, *, stream: TextIO | None = None, enabled: bool | None = None,
                 min_total: int = 0) -> None:
        global _active
        self.stream = stream if stream is not None else sys.stderr
        if enabled is None:
            enabled = int(total) >= min_total and _default(self.stream)
        self.total, self.desc, self.done = int(total), desc, 0
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._last = 0.0
        self._counted = False
        if enabled:
            with _active_lock:
                if _active:
                    enabled = False  # a bar inside a bar: the outer one speaks
                else:
                    _active += 1
                    self._counted = True
        self.enabled = bool(enabled)

    def update(self, n: int) -> None:
        """Count ``n`` more units of work and redraw if due."""
        with self._lock:
            self.done += int(n)
            if self.enabled and (time.monotonic() - self._last >= INTERVAL or self.done >= self.total > 0):
                self._draw()

    def set(self, done: int) -> None:
        """Set the units done so far (a polled counter) and redraw if due."""
        with self._lock:
            self.done = int(done)
            if self.enabled and time.monotonic() - self._last >= INTERVAL:
                self._draw()

    def _draw(self) -> None:
        self._last = time.monotonic()
        elapsed = max(self._last - self._start, 1e-9)
        rate = f"{_human(self.done / elapsed)}/s"
        if self.total > 0:
            frac = min(1.0, self.done / self.total)
            bar = "#" * int(frac * _WIDTH) + "." * (_WIDTH - int(frac * _WIDTH))
            line = (f"{self.desc} [{bar}] {frac * 100:3.0f}%  {_human(self.done)} / {_human(self.total)}"
                    f"  {rate}")
        else:
            line = f"{self.desc}  {_human(self.done)}  {rate}"
        try:
            self.stream.write("\r" + line + "\x1b[K")
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: stop drawing, never fail the work
            self.enabled = False

    def close(self) -> None:
        """Draw the final state and end the line (nothing when disabled)."""
        global _active
        with self._lock:
            if self.enabled:
                self._draw()
                try:
                    self.stream.write("\n")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass
                self.enabled = False
            if self._counted:
                self._counted = False
                with _active_lock:
                    _active -= 1

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _default(stream: TextIO) -> bool:
    return enabled(stream)


def bar(total: int, desc: str, *, enabled: bool | None = None, stream: TextIO | None = None,
        min_total: int = 0) -> Progress:
    """A :class:`Progress` bar; use as ``with bar(total_bytes, "export") as b: b.update(n)``."""
    return Progress(total, desc, stream=stream, enabled=enabled, min_total=min_total)


@contextlib.contextmanager
def watch(total: int, desc: str, counter: Callable[[], int], *, enabled: bool | None = None,
          stream: TextIO | None = None, min_total: int | None = None) -> Iterator[Progress | None]:
    """Draw a bar of ``counter() - counter()_at_start`` bytes out of ``total`` while the body runs.

    A daemon thread polls ``counter`` (e.g. the bytes a reader has read) 10 times a second, so the work
    itself calls nothing. With ``enabled=None`` only at or above ``min_total`` bytes (default:
    :func:`min_bytes`) and when :func:`enabled`; otherwise no thread is started and the body runs as is.
    On success the bar ends full; on an error it ends where it was.
    """
    total = int(total)
    if enabled is None and total < (min_bytes() if min_total is None else min_total):
        yield None
        return
    if enabled is False:
        yield None
        return
    p = Progress(total, desc, stream=stream, enabled=enabled)
    if not p.enabled:
        p.close()
        yield None
        return
    base = counter()
    stop = threading.Event()

    def tick() -> None:
        while not stop.wait(INTERVAL):
            try:
                p.set(min(max(counter() - base, 0), total) if total > 0 else counter() - base)
            except Exception:  # noqa: BLE001 - a counter read mid-update: the next tick reads it again
                continue

    t = threading.Thread(target=tick, name="ucl-progress", daemon=True)
    t.start()
    ok = False
    try:
        yield p
        ok = True
    finally:
        stop.set()
        t.join()
        if ok:
            with p._lock:
                p.done = max(p.done, total)
        p.close()
