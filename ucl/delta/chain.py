"""Delta chains (spec/delta.md §6-§7): resolve them and rebuild inner chunks through them.

Pure functions over callbacks; the caller (reader, validator) does the I/O:

1. :func:`resolve_chain` walks step documents (``get_meta(step) -> StepInfo | None``) from a step to its
   full base and checks the step-level rules: every step exists and is committed, parents are older,
   no cycle, length within ``max_chain``.
2. :func:`resolve_array_chain` walks one tensor's array documents (``get_array(step, name) -> ArrayInfo
   | None``) along its ``base_step`` links and checks shape, dtype and chunking agree.
3. :func:`reconstruct_inner` rebuilds one inner chunk from the newest link back: it asks
   ``read_inner(step, name, coords)`` only for the links it needs (stopping at the first full payload),
   then applies the deltas oldest first, in place, into ``out``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from ucl.delta.codec import ENCODINGS, MODE_FULL, Backend, PayloadError, decode_chunk
from ucl.errors import DeltaChainError, FormatError, IntegrityError, LimitExceededError, UCLError
from ucl.format.records import REFERENCE_MODES, DeltaRecord

__all__ = [
    "DEFAULT_MAX_CHAIN",
    "ArrayInfo",
    "StepInfo",
    "reconstruct_inner",
    "resolve_array_chain",
    "resolve_chain",
]

DEFAULT_MAX_CHAIN = 64
HARD_MAX_CHAIN = 4096  # readers refuse longer chains whatever a writer says (spec/delta.md §6)


@dataclass(frozen=True)
class StepInfo:
    """What chain resolution needs of a step: from its step document and commit record."""

    step: int
    kind: str  # "full" | "delta"
    parent: int | None
    committed: bool = True


@dataclass(frozen=True)
class ArrayInfo:
    """What chain resolution needs of one tensor in one step: from its array document."""

    step: int
    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    delta: DeltaRecord | None  # None: stored full in this step

    @property
    def kind(self) -> str:
        """``"full"``, ``"unchanged"``, ``"chunked"`` or ``"stale"`` (a composite step's reference)."""
        return "full" if self.delta is None else self.delta.mode


def _check_limit(max_chain: int) -> None:
    if not isinstance(max_chain, int) or not 0 <= max_chain <= HARD_MAX_CHAIN:
        raise LimitExceededError(
            f"max_chain must be an integer in [0, {HARD_MAX_CHAIN}], found {max_chain!r}"
        )


def resolve_chain(
    step: int, get_meta: Callable[[int], StepInfo | None], max_chain: int = DEFAULT_MAX_CHAIN
) -> list[int]:
    """The steps from the full base to ``step``, oldest first (``[step]`` for a full step).

    Parameters
    ----------
    step : int
        The step to resolve.
    get_meta : callable
        ``get_meta(s)`` returns the :class:`StepInfo` of step ``s``, or None when it does not exist. A
        :class:`~ucl.errors.UCLError` it raises is reported as a broken chain naming ``s``.
    max_chain : int, optional
        The most delta steps allowed between ``step`` and its full base (spec/delta.md §6).

    Returns
    -------
    list of int
        ``[full_base, ..., parent, step]``.

    Raises
    ------
    DeltaChainError
        A missing or uncommitted step, a delta step without a parent, a parent not older than its
        child (which also rules out cycles), a cycle, or a chain of more than ``max_chain`` deltas;
        the message names the step at fault and the step being resolved.
    """
    _check_limit(max_chain)
    chain: list[int] = []
    seen: set[int] = set()
    cur: int | None = step
    child: int | None = None
    while cur is not None:
        who = (
            f"step {cur}"
            if child is None
            else f"step {cur} (parent of step {child})"
            if child == step
            else f"step {cur} (parent of step {child}, in the chain of step {step})"
        )
        if cur in seen:
            raise DeltaChainError(f"{who}: the chain has a cycle through step {cur}")
        seen.add(cur)
        try:
            info = get_meta(cur)
        except DeltaChainError:
            raise
        except UCLError as e:
            raise DeltaChainError(f"{who} is not readable: [{e.code}] {e.message}", file=e.file) from e
        if info is None:
            raise DeltaChainError(f"{who} does not exist")
        if not info.committed:
            raise DeltaChainError(f"{who} is not committed")
        chain.append(cur)
        if info.kind == "full":
            break
        if info.kind != "delta":
            raise DeltaChainError(f"{who}: kind must be full or delta, found {info.kind!r}")
        if info.parent is None:
            raise DeltaChainError(f"{who} is a delta step without a parent")
        if info.parent in seen:
            raise DeltaChainError(f"{who}: the chain has a cycle through step {info.parent}")
        if info.parent >= cur:
            raise DeltaChainError(f"{who}: parent {info.parent} is not older than the step")
        if len(chain) > max_chain:
            raise DeltaChainError(
                f"step {step}: the chain has more than max_chain={max_chain} delta steps "
                f"(reached step {info.parent} without a full step)"
            )
        child, cur = cur, info.parent
    chain.reverse()
    return chain


def resolve_array_chain(
    step: int,
    name: str,
    get_array: Callable[[int, str], ArrayInfo | None],
    steps: Sequence[int] | None = None,
    max_chain: int = DEFAULT_MAX_CHAIN,
) -> list[ArrayInfo]:
    """One tensor's links from the step that stores it full to ``step``, oldest first.

    Links whose mode is ``unchanged`` are kept (they cost nothing to walk). Each link's ``base_step``
    must be older, be one of ``steps`` (the step chain from :func:`resolve_chain`) when given, hold the
    tensor, and agree on shape, dtype, chunk shape and inner chunk shape.

    Raises
    ------
    DeltaChainError
        Naming the tensor, the link and its base step.
    """
    _check_limit(max_chain)
    allowed = set(steps) if steps is not None else None
    links: list[ArrayInfo] = []
    cur, child = step, None
    while True:
        who = f"tensor {name!r} in step {cur}" + ("" if child is None else f" (base of step {child})")
        try:
            info = get_array(cur, name)
        except DeltaChainError:
            raise
        except UCLError as e:
            raise DeltaChainError(
                f"{who} is not readable: [{e.code}] {e.message}", tensor=name, file=e.file
            ) from e
        if info is None:
            raise DeltaChainError(f"{who} does not exist", tensor=name)
        if links:
            last = links[-1]
            for attr in ("shape", "dtype", "chunk_shape", "inner_chunk_shape"):
                if getattr(info, attr) != getattr(last, attr):
                    raise DeltaChainError(
                        f"tensor {name!r}: step {last.step} is a delta of step {cur}, but their "
                        f"{attr.replace('_', ' ')}s differ: {getattr(last, attr)} in step {last.step}, "
                        f"{getattr(info, attr)} in step {cur}",
                        tensor=name,
                    )
        links.append(info)
        if info.delta is None:
            break
        base = info.delta.base_step
        if base >= cur:
            raise DeltaChainError(f"{who}: base_step {base} is not older than the step", tensor=name)
        if allowed is not None and base not in allowed:
            raise DeltaChainError(
                f"{who}: base_step {base} is not in the step's parent chain {sorted(allowed)}", tensor=name
            )
        if len(links) > max_chain:
            raise DeltaChainError(
                f"tensor {name!r} in step {step}: more than max_chain={max_chain} delta links", tensor=name
            )
        child, cur = cur, base
    links.reverse()
    return links


ReadInner = Callable[[int, str, tuple[int, ...]], "bytes | memoryview | None"]
Run = Callable[[list[Callable[[], Any]]], list[Any]]  # calls each function (maybe at once), results in order

#: A chunk rebuilt with ``run`` is split into word ranges of at least this many words, one task each.
APPLY_MIN_WORDS = 1 << 16


def reconstruct_inner(
    links: Sequence[ArrayInfo],
    coords: tuple[int, ...],
    read_inner: ReadInner,
    out: np.ndarray,
    *,
    backend: Backend = "native",
    run: Run | None = None,
    scratch: Callable[[int], np.ndarray] | None = None,
    parts: int = 1,
) -> int:
    """Rebuild one inner chunk of the newest link into ``out``, bit for bit.

    Parameters
    ----------
    links : sequence of ArrayInfo
        From :func:`resolve_array_chain`, oldest (stored full) first.
    coords : tuple of int
        The inner chunk's coordinates (the caller's convention; passed through to ``read_inner``).
    read_inner : callable
        ``read_inner(step, name, coords)``: for a link stored full, the chunk's decoded values (bytes,
        little-endian, ``out.nbytes`` long); for a chunked link, the ``ucl.delta`` payload with its crc32c
        verified and removed, or None when the chunk is absent (unchanged). Never called for unchanged
        links, nor for links older than the newest full payload.
    out : numpy.ndarray
        C-contiguous unsigned-integer words (``bit_view``) receiving the values.
    run, scratch, parts : optional
        With ``run`` (native backend only), the payloads are decoded as independent tasks given to
        ``run`` (each into a buffer of ``out.nbytes`` from ``scratch(nbytes)``, a uint8 array the caller
        reclaims after the call), then applied to ``out`` in one pass, oldest first, split into up to
        ``parts`` word ranges (tasks too). Same result, same errors.

    Returns
    -------
    int
        The number of payloads decoded (0 when the chunk came straight from a full link).

    Raises
    ------
    PayloadError
        (``integrity_error``) A payload of the newest link (the step being rebuilt) whose mode is
        neither 0 nor its array's encoding's, or that does not decode to exactly the chunk.
    DeltaChainError
        The same in an older link, or a stored chunk there that is corrupt or of the wrong size: the
        message names the link's step and the tensor, and the step being rebuilt.
    """
    base, pending = _walk(links, coords, read_inner, out)
    if not pending:
        if base is not None:
            out.view(np.uint8)[...] = np.frombuffer(base, np.uint8)
        return 0
    if run is None or backend != "native":
        if base is not None:
            out.view(np.uint8)[...] = np.frombuffer(base, np.uint8)
        for link, payload in reversed(pending):
            try:
                decode_chunk(payload, out, out, backend=backend)
            except (FormatError, DeltaChainError) as e:
                raise _decode_error(link, coords, links[-1], e) from e
        return len(pending)
    _apply_parallel(links, coords, base, pending[::-1], out, run, scratch, parts)
    return len(pending)


def _walk(
    links: Sequence[ArrayInfo], coords: tuple[int, ...], read_inner: ReadInner, out: np.ndarray
) -> tuple[bytes | memoryview | None, list[tuple[ArrayInfo, bytes | memoryview]]]:
    """From the newest link back: the payloads to decode (newest first) and, when the walk reaches the
    link stored full, its values (checked for size). Reads nothing more than that."""
    if not links or links[0].delta is not None:
        raise DeltaChainError(
            "reconstruct_inner: the links must start with the step that stores the tensor full"
        )
    top = links[-1]
    name = top.name
    pending: list[tuple[ArrayInfo, bytes | memoryview]] = []
    for link in reversed(links):
        if link.kind in REFERENCE_MODES:  # no data: the base link holds the values
            continue
        data = _read(read_inner, link, coords, top)
        if link.kind == "full":
            if data is None or len(data) != out.nbytes:
                found = "absent" if data is None else f"{len(data)} bytes"
                raise DeltaChainError(
                    f"{_where(link, coords, top)}: the stored chunk must be {out.nbytes} bytes, "
                    f"found {found}",
                    tensor=name,
                )
            return data, pending
        if data is None:
            continue
        mode = data[0] if len(data) else -1
        encoding = link.delta.encoding if link.delta is not None else None
        if mode not in (MODE_FULL, ENCODINGS.get(encoding or "", -1)):
            raise _decode_error(link, coords, top, PayloadError(
                f"payload mode {mode} is neither 0 (full) nor that of the array's encoding {encoding!r}"))
        pending.append((link, data))
        if mode == MODE_FULL:  # full values: older links are not needed
            break
    return None, pending


def _decode_error(link: ArrayInfo, coords: tuple[int, ...], top: ArrayInfo, e: UCLError) -> UCLError:
    """A payload that does not decode (spec/delta.md §5.4, §7.1): in the step being rebuilt, its own
    ``integrity_error``; in a base, ``broken_chain`` naming the base (its code in the message)."""
    if link.step == top.step and isinstance(e, PayloadError):
        return PayloadError(f"{_where(link, coords, top)}: {e.message}", tensor=top.name, file=e.file)
    return DeltaChainError(f"{_where(link, coords, top)}: [{e.code}] {e.message}", tensor=top.name)


def _apply_parallel(
    links: Sequence[ArrayInfo],
    coords: tuple[int, ...],
    base: bytes | memoryview | None,
    pending: list[tuple[ArrayInfo, bytes | memoryview]],
    out: np.ndarray,
    run: Run,
    scratch: Callable[[int], np.ndarray] | None,
    parts: int,
) -> None:
    """Decode the payloads (oldest first) each on its own, then apply them in one pass over ``out``, a
    batch of ``max(2, parts)`` payloads at a time (that many scratch buffers): what decoding them one after
    the other into ``out`` gives, and the error it raises first."""
    from ucl.delta.codec import _native, _raise_c

    nat = _native()
    word = out.dtype.itemsize
    nbytes = out.nbytes
    size = max(2, parts)
    planes = [np.empty(nbytes, np.uint8) if scratch is None else scratch(nbytes)
              for _ in range(min(size, len(pending)))]
    src: Any = out if base is None else base  # unused when the oldest payload holds full values
    n = out.size
    k = max(1, min(parts, n // APPLY_MIN_WORDS))
    cuts = [n * i // k for i in range(k + 1)]
    for j0 in range(0, len(pending), size):
        batch = pending[j0 : j0 + size]
        split = max(1, -(-parts // len(batch)))  # fewer payloads than parts: each one's frames shared out
        got = run([partial(nat.unpack, p, b, word, i, split)
                   for (_, p), b in zip(batch, planes, strict=False) for i in range(split)])
        modes = []
        for j, (link, _) in enumerate(batch):
            mine = got[j * split : (j + 1) * split]
            rc, mode = (-7 if any(r[2] for r in mine) else mine[0][0]), mine[0][1]
            if rc != 0:  # the first payload (oldest first) that fails, as a sequential decode meets it
                try:
                    _raise_c(rc, f"delta payload (mode byte {mode})" if rc == -4 else "delta payload")
                except (FormatError, DeltaChainError) as e:
                    raise _decode_error(link, coords, links[-1], e) from e
            modes.append(mode)
        rcs = run([partial(nat.apply, planes[: len(batch)], modes, src, out, word, a, b - a)
                   for a, b in zip(cuts, cuts[1:], strict=False)])
        for rc in rcs:
            if rc != 0:
                _raise_c(rc, "delta payload")
        src = out  # the next batch applies on top of this one


def _where(link: ArrayInfo, coords: tuple[int, ...], top: ArrayInfo) -> str:
    s = f"tensor {link.name!r}, inner chunk {list(coords)} of step {link.step}"
    return s if link.step == top.step else s + f" (a base of step {top.step})"


def _read(
    read_inner: ReadInner, link: ArrayInfo, coords: tuple[int, ...], top: ArrayInfo
) -> bytes | memoryview | None:
    try:
        return read_inner(link.step, link.name, coords)
    except IntegrityError as e:
        if link.step == top.step:
            raise
        raise DeltaChainError(
            f"{_where(link, coords, top)} is corrupt: [{e.code}] {e.message}", tensor=link.name, file=e.file
        ) from e
