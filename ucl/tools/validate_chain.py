"""Validation of a delta step's chain (spec/delta.md §7, checks 1-5 and 7), for ``ucl.tools.validate``.

``validate_chain(repo, step, meta)`` yields one error per problem and never raises for a problem in
the data. It reads through the repository's own checked accessors (``commit_record``, ``step_meta``,
``read_verified``), so every byte it looks at is verified against a commit record.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from typing import Any

from ucl.delta.chain import DEFAULT_MAX_CHAIN, ArrayInfo, StepInfo, resolve_array_chain, resolve_chain
from ucl.delta.codec import check_payload
from ucl.errors import DeltaChainError, IntegrityError, UCLError
from ucl.format.records import REFERENCE_MODES, DeltaRecord, parse_codec
from ucl.format.repository import step_prefix

__all__ = ["validate_chain"]


def validate_chain(
    repo: Any, step: int, meta: Any, max_chain: int = DEFAULT_MAX_CHAIN, check_bases: bool = True
) -> Iterator[UCLError]:
    """Check the chain of delta step ``step`` whose (already validated) step document is ``meta``.

    Parameters
    ----------
    repo : ucl.format.repository.Repository
        Used for ``commit_record(s)``, ``step_meta(s, record)`` and ``read_verified(s, rel, record)``.
    step : int
    meta : ucl.format.metadata.StepMeta
        The step's document (``kind``, ``parent``, ``arrays`` by name with ``key``, ``shape``, ``dtype``,
        ``chunk_shape``, ``inner_chunk_shape``, ``delta`` and ``inner_codecs()``).
    max_chain : int, optional
        The chain length limit (spec/delta.md §6.2).
    check_bases : bool, optional
        Also verify (size and digest against their commit records) every shard of the base
        steps that this step's tensors depend on, so a corrupt base makes this step invalid.

    Yields
    ------
    UCLError
        ``broken_chain`` for chain problems and corrupt bases (naming the base step, tensor and file),
        ``schema_violation``/``format_error`` for delta records and codecs that are not valid.
    """
    metas: dict[int, Any] = {step: meta}
    records: dict[int, Any] = {}

    def get_meta(s: int) -> StepInfo:
        if s == step:
            return StepInfo(s, meta.kind, meta.parent)
        rec = repo.commit_record(s)
        m = repo.step_meta(s, rec)
        metas[s], records[s] = m, rec
        return StepInfo(s, m.kind, m.parent)

    try:
        steps = resolve_chain(step, get_meta, max_chain)
    except DeltaChainError as e:
        yield e
        return

    bad_records: set[tuple[int, str]] = set()

    def get_array(s: int, name: str) -> ArrayInfo | None:
        arr = metas[s].arrays.get(name) if s in metas else None
        if arr is None:
            return None
        record = None
        if arr.delta is not None:
            record = DeltaRecord.from_dict(arr.delta, f"step {s}, tensor {name!r}: attributes.ucl.delta")
            if record.mode == "chunked":
                parse_codec(arr.inner_codecs()[0], record, f"step {s}, tensor {name!r}: ucl.delta codec")
        return ArrayInfo(
            s, name, tuple(arr.shape), arr.dtype, tuple(arr.chunk_shape), tuple(arr.inner_chunk_shape), record
        )

    checked: set[tuple[int, str]] = set()
    for name in sorted(meta.arrays):
        try:
            links = resolve_array_chain(step, name, get_array, steps, max_chain)
        except DeltaChainError as e:
            cause = e.__cause__
            if (
                isinstance(cause, UCLError)
                and not isinstance(cause, DeltaChainError)
                and cause.code in ("schema_violation", "inconsistent_metadata")
                and (step, name) not in bad_records
            ):
                bad_records.add((step, name))
                yield cause  # the record or codec itself is invalid: report that, not a chain error
            else:
                yield e
            continue
        except UCLError as e:  # a record of `step` itself
            yield e
            continue
        if links[-1].kind == "stale" and len(links) > 1 and links[-2].kind == "stale":
            # a composite step's reference names the step that carries the values (spec/delta.md §9.4)
            yield DeltaChainError(
                f"tensor {name!r} in step {step} is stale with base_step {links[-2].step}, whose array is "
                "itself stale: a stale array must refer to a step that carries its values", tensor=name)
        if not check_bases:
            continue
        for link in links[:-1]:
            if link.kind in REFERENCE_MODES:
                continue
            rec = records.get(link.step)
            arr = metas[link.step].arrays[name]
            prefix = f"{arr.key}/c"
            for rel in sorted(
                r for r in (rec.files if rec is not None else {}) if r == prefix or r.startswith(prefix + "/")
            ):
                if (link.step, rel) in checked:
                    continue
                checked.add((link.step, rel))
                try:
                    data = repo.read_verified(link.step, rel, rec, n_inner=arr.n_inner)
                    if link.delta is not None and link.delta.encoding is not None:  # check 7: as check 6
                        check_delta_shard(data, arr, f"{step_prefix(link.step)}/{rel}")
                except IntegrityError as e:
                    yield DeltaChainError(
                        f"step {step} depends on step {link.step}, whose tensor {name!r} is corrupt: "
                        f"[{e.code}] {e.message}",
                        tensor=name,
                        file=e.file,
                    )


def check_delta_shard(data: bytes, arr: Any, key: str) -> None:
    """Every present payload of a chunked array's shard (its digest verified) decodes (spec/delta.md §7)."""
    n = arr.n_inner
    if len(data) < 16 * n + 4:  # read_verified checked size and digest; nothing here to decode
        return
    index = data[len(data) - 16 * n - 4 : len(data) - 4]
    encoding = arr.delta["encoding"]
    for ordinal in range(n):
        off, nb = struct.unpack_from("<QQ", index, 16 * ordinal)
        if off == (1 << 64) - 1:
            continue
        try:
            check_payload(memoryview(data)[off : off + nb - 4], arr.itemsize, arr.inner_nbytes, encoding)
        except IntegrityError as e:
            raise type(e)(f"{key}: inner chunk {ordinal}: {e.message}", tensor=arr.name, file=key) from None
