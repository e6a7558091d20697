"""Delta chains (spec/delta.md §6-§7): resolution rules and bit-exact reconstruction at every step."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ucl.delta import (
    ArrayInfo,
    StepInfo,
    bit_view,
    encode_chunk,
    reconstruct_inner,
    resolve_array_chain,
    resolve_chain,
)
from ucl.errors import ChecksumError, DeltaChainError, LimitExceededError, StepNotCommittedError
from ucl.format.records import DeltaRecord, choose_encoding
from ucl.write.policy import DeltaPolicy

from .strategies import DTYPES, HOW, arrays, perturb


# -- resolve_chain ------------------------------------------------------------------------------------
def metas(**steps: tuple[str, int | None]) -> dict[int, StepInfo]:
    return {int(k[1:]): StepInfo(int(k[1:]), kind, parent) for k, (kind, parent) in steps.items()}


def test_resolve_chain_walks_to_the_full_base() -> None:
    m = metas(s1=("full", None), s2=("delta", 1), s3=("delta", 2), s5=("delta", 3))
    assert resolve_chain(5, m.get) == [1, 2, 3, 5]
    assert resolve_chain(1, m.get) == [1]
    assert resolve_chain(5, m.get, max_chain=3) == [1, 2, 3, 5]


def test_resolve_chain_errors_name_the_step() -> None:
    m = metas(
        s1=("full", None),
        s2=("delta", 1),
        s3=("delta", 2),
        s4=("delta", 0),
        s5=("delta", 4),
        s6=("delta", None),
    )
    with pytest.raises(DeltaChainError, match=r"^step 0 \(parent of step 4\) does not exist"):
        resolve_chain(4, m.get)
    with pytest.raises(
        DeltaChainError, match=r"^step 0 \(parent of step 4, in the chain of step 5\) does not exist"
    ):
        resolve_chain(5, m.get)
    with pytest.raises(DeltaChainError, match=r"step 6 is a delta step without a parent"):
        resolve_chain(6, m.get)
    with pytest.raises(DeltaChainError, match=r"step 3: the chain has more than max_chain=1 delta steps"):
        resolve_chain(3, m.get, max_chain=1)
    with pytest.raises(DeltaChainError, match="max_chain=0"):
        resolve_chain(2, m.get, max_chain=0)
    with pytest.raises(DeltaChainError, match=r"step 7 does not exist"):
        resolve_chain(7, m.get)
    with pytest.raises(LimitExceededError):
        resolve_chain(3, m.get, max_chain=-1)


def test_resolve_chain_cycles_and_order() -> None:
    cyc = metas(s2=("delta", 3), s3=("delta", 2))
    with pytest.raises(DeltaChainError, match="not older|cycle"):
        resolve_chain(3, cyc.get)
    self_loop = metas(s4=("delta", 4))
    with pytest.raises(DeltaChainError, match="cycle"):
        resolve_chain(4, self_loop.get)

    # a lying get_meta (steps renumbered under us) still cannot loop forever
    class Liar:
        def __call__(self, s: int) -> StepInfo:
            return StepInfo(s, "delta", s - 1 if s > 5 else 9)

    with pytest.raises(DeltaChainError, match="not older|cycle"):
        resolve_chain(7, Liar())


def test_resolve_chain_uncommitted_and_unreadable() -> None:
    m = {1: StepInfo(1, "full", None, committed=False), 2: StepInfo(2, "delta", 1)}
    with pytest.raises(DeltaChainError, match=r"step 1 \(parent of step 2\) is not committed"):
        resolve_chain(2, m.get)

    def unreadable(s: int) -> StepInfo:
        if s == 1:
            raise StepNotCommittedError("commits/1.json: no commit record")
        return StepInfo(s, "delta", s - 1)

    with pytest.raises(DeltaChainError, match=r"step 1 .* is not readable: \[not_committed\]"):
        resolve_chain(3, unreadable)


# -- resolve_array_chain ------------------------------------------------------------------------------
def ainfo(
    step: int, delta: DeltaRecord | None, shape: tuple[int, ...] = (8, 4), dtype: str = "float32"
) -> ArrayInfo:
    return ArrayInfo(step, "w", shape, dtype, shape, (4, 4), delta)


def test_resolve_array_chain_checks_agreement() -> None:
    arrays_ = {
        (1, "w"): ainfo(1, None),
        (2, "w"): ainfo(2, DeltaRecord("chunked", 1, "xor")),
        (3, "w"): ainfo(3, DeltaRecord("unchanged", 2)),
        (4, "w"): ainfo(4, DeltaRecord("chunked", 3, "sub")),
    }
    links = resolve_array_chain(4, "w", lambda s, n: arrays_.get((s, n)), steps=[1, 2, 3, 4])
    assert [link.step for link in links] == [1, 2, 3, 4]
    assert [link.kind for link in links] == ["full", "chunked", "unchanged", "chunked"]
    # a base_step that skips intermediate steps is fine when it is in the parent chain
    arrays_[(4, "w")] = ainfo(4, DeltaRecord("chunked", 1, "xor"))
    assert [
        link.step
        for link in resolve_array_chain(4, "w", lambda s, n: arrays_.get((s, n)), steps=[1, 2, 3, 4])
    ] == [1, 4]
    with pytest.raises(DeltaChainError, match=r"base_step 1 is not in the step's parent chain \[3, 4\]"):
        resolve_array_chain(4, "w", lambda s, n: arrays_.get((s, n)), steps=[3, 4])
    arrays_[(2, "w")] = ainfo(2, DeltaRecord("chunked", 1, "xor"), shape=(8, 8))
    with pytest.raises(
        DeltaChainError, match=r"tensor 'w': step 3 is a delta of step 2, but their shapes differ"
    ):
        resolve_array_chain(3, "w", lambda s, n: arrays_.get((s, n)))
    arrays_[(2, "w")] = ainfo(2, DeltaRecord("chunked", 1, "xor"), dtype="bfloat16")
    with pytest.raises(DeltaChainError, match="dtypes differ"):
        resolve_array_chain(3, "w", lambda s, n: arrays_.get((s, n)))
    with pytest.raises(DeltaChainError, match=r"tensor 'v' in step 3 does not exist"):
        resolve_array_chain(3, "v", lambda s, n: arrays_.get((s, n)))
    arrays_[(5, "w")] = ainfo(5, DeltaRecord("chunked", 5, "xor"))
    with pytest.raises(DeltaChainError, match="base_step 5 is not older"):
        resolve_array_chain(5, "w", lambda s, n: arrays_.get((s, n)))


# -- a tiny in-memory repository: the writer and reader protocols of spec/delta.md §6-§7 ----------------
@dataclass
class MemRepo:
    inner: int  # words per inner chunk (1-D tensors)
    metas: dict[int, StepInfo] = field(default_factory=dict)
    arrays: dict[tuple[int, str], ArrayInfo] = field(default_factory=dict)
    chunks: dict[tuple[int, str, int], bytes] = field(default_factory=dict)  # stored full values or payloads
    corrupt: set[tuple[int, str, int]] = field(default_factory=set)

    def save(
        self,
        step: int,
        state: dict[str, np.ndarray],
        kind: str,
        parent: int | None,
        prev: dict[str, np.ndarray] | None,
    ) -> int:
        """Write a step; returns the data bytes stored."""
        self.metas[step] = StepInfo(step, kind, parent)
        stored = 0
        for name, values in state.items():
            w = bit_view(values)
            shape = (w.size,)
            if kind == "full" or prev is None:
                rec = None
            elif w.tobytes() == bit_view(prev[name]).tobytes():
                rec = DeltaRecord("unchanged", parent)  # type: ignore[arg-type]
            else:
                rec = DeltaRecord("chunked", parent, choose_encoding(name, str(values.dtype)))  # type: ignore[arg-type]
            self.arrays[(step, name)] = ArrayInfo(
                step, name, shape, str(values.dtype), shape, (self.inner,), rec
            )
            if rec is not None and rec.mode == "unchanged":
                continue
            base_w = None if rec is None else bit_view(prev[name])  # type: ignore[index]
            for c, lo in enumerate(range(0, w.size, self.inner)):
                chunk = w[lo : lo + self.inner]
                if rec is None:
                    data: bytes | None = chunk.tobytes()
                else:
                    data = encode_chunk(chunk, base_w[lo : lo + self.inner], rec.encoding)  # type: ignore[index,arg-type]
                if data is not None:
                    self.chunks[(step, name, c)] = data
                    stored += len(data)
        return stored

    def read_inner(self, step: int, name: str, coords: tuple[int, ...]) -> bytes | None:
        key = (step, name, coords[0])
        if key in self.corrupt:
            raise ChecksumError(
                f"steps/{step}/{name}/c/0: inner chunk {coords[0]} fails its crc32c",
                tensor=name,
                file=f"steps/{step}/{name}/c/0",
            )
        return self.chunks.get(key)

    def load(self, step: int, name: str, dtype: np.dtype, max_chain: int = 64) -> tuple[np.ndarray, int]:
        steps = resolve_chain(step, self.metas.get, max_chain)
        links = resolve_array_chain(step, name, lambda s, n: self.arrays.get((s, n)), steps, max_chain)
        n = links[-1].shape[0]  # words
        w = np.empty(n, bit_view(np.empty(0, dtype)).dtype)
        out = w.view(dtype)
        decoded = 0
        for c, lo in enumerate(range(0, n, self.inner)):
            piece = w[lo : lo + self.inner]
            buf = np.empty_like(piece)
            decoded += reconstruct_inner(links, (c,), self.read_inner, buf)
            piece[:] = buf
        return out, decoded


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(
    data=st.data(),
    dtype=st.sampled_from(sorted(DTYPES)),
    n=st.integers(0, 200),
    inner=st.integers(1, 64),
    steps=st.integers(1, 10),
    full_every=st.one_of(st.none(), st.integers(1, 5)),
    max_chain=st.integers(0, 6),
    base=st.sampled_from(["previous", "full"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_sequence_any_policy_reconstructs_every_step(
    data,
    dtype,
    n,
    inner,
    steps,
    full_every,
    max_chain,
    base,  # type: ignore[no-untyped-def]
    seed,
) -> None:
    rng = np.random.default_rng(seed)
    policy = DeltaPolicy(full_every=full_every, max_chain=max_chain, base=base)
    repo = MemRepo(inner=inner)
    names = ["model/w", "optim/state/0/exp_avg_sq"]
    state = {k: data.draw(arrays(DTYPES[dtype], n)) for k in names}
    history: dict[int, dict[str, np.ndarray]] = {}
    since_full: int | None = None
    last_full = prev_step = -1
    for step in range(1, steps + 1):
        if step > 1:
            state = {k: perturb(rng, v, data.draw(st.sampled_from(HOW))) for k, v in state.items()}
        kind = policy.decide(since_full)
        parent = None if kind == "full" else policy.parent(prev_step, last_full)
        repo.save(step, state, kind, parent, None if parent is None else history[parent])
        history[step] = {k: v.copy() for k, v in state.items()}
        since_full = 0 if kind == "full" else since_full + 1  # type: ignore[operator]
        last_full = step if kind == "full" else last_full
        prev_step = step
    for step, saved in history.items():
        for k, v in saved.items():
            got, _ = repo.load(step, k, v.dtype, max_chain=max(max_chain, 1))
            assert bit_view(got).tobytes() == bit_view(v).tobytes(), (step, k)


def test_unchanged_tensors_and_chunks_cost_no_bytes() -> None:
    repo = MemRepo(inner=256)
    rng = np.random.default_rng(0)
    frozen = rng.standard_normal(4096).astype(np.float32)
    emb = rng.standard_normal(4096).astype(np.float32)
    repo.save(1, {"frozen": frozen, "emb": emb}, "full", None, None)
    emb2 = emb.copy()
    emb2[300:310] += 1  # touches one inner chunk of 16
    stored = repo.save(2, {"frozen": frozen, "emb": emb2}, "delta", 1, {"frozen": frozen, "emb": emb})
    assert repo.arrays[(2, "frozen")].kind == "unchanged"
    assert [k for k in repo.chunks if k[0] == 2] == [(2, "emb", 1)]
    assert stored < 200
    got, decoded = repo.load(2, "emb", np.dtype(np.float32))
    assert np.array_equal(got, emb2) and decoded == 1


def test_reconstruction_stops_at_the_newest_full_payload() -> None:
    repo = MemRepo(inner=1024)
    rng = np.random.default_rng(1)
    a = rng.standard_normal(1024).astype(np.float32)
    repo.save(1, {"w": a}, "full", None, None)
    b = a + np.float32(1e-3)
    repo.save(2, {"w": b}, "delta", 1, {"w": a})
    c = rng.standard_normal(1024).astype(np.float32)  # unrelated values: stored full inside step 3
    repo.save(3, {"w": c}, "delta", 2, {"w": b})
    assert repo.chunks[(3, "w", 0)][0] == 0
    repo.corrupt.add((1, "w", 0))  # never read: step 3's chunk does not need it
    got, decoded = repo.load(3, "w", np.dtype(np.float32))
    assert np.array_equal(got, c) and decoded == 1


def test_a_corrupt_base_chunk_breaks_every_dependent_step_naming_the_base() -> None:
    repo = MemRepo(inner=512)
    rng = np.random.default_rng(2)
    v = rng.standard_normal(2048).astype(np.float32)
    prev = None
    for step in range(1, 6):
        new = v if prev is None else prev + np.float32(1e-4) * rng.standard_normal(v.size).astype(np.float32)
        repo.save(
            step,
            {"w": new},
            "full" if step == 1 else "delta",
            None if step == 1 else step - 1,
            None if prev is None else {"w": prev},
        )
        prev = new
    repo.corrupt.add((2, "w", 3))
    with pytest.raises(ChecksumError):  # the base itself: its own integrity error
        repo.load(2, "w", np.dtype(np.float32))
    for step in (3, 4, 5):
        with pytest.raises(
            DeltaChainError,
            match=rf"tensor 'w', inner chunk \[3\] of step 2 \(a base of step {step}\) is corrupt: "
            r"\[checksum_mismatch\]",
        ):
            repo.load(step, "w", np.dtype(np.float32))
    # a malformed payload in a base is reported the same way
    repo.corrupt.clear()
    repo.chunks[(3, "w", 1)] = b"\x01\x28\xb5\x2f\xfd"
    with pytest.raises(
        DeltaChainError, match=r"inner chunk \[1\] of step 3 \(a base of step 5\): \[integrity_error\]"
    ):
        repo.load(5, "w", np.dtype(np.float32))


def test_reconstruct_inner_needs_a_full_first_link() -> None:
    with pytest.raises(DeltaChainError, match="must start with the step that stores the tensor full"):
        reconstruct_inner(
            [ainfo(2, DeltaRecord("chunked", 1, "xor"))], (0,), lambda *a: None, np.empty(4, np.uint32)
        )
    with pytest.raises(DeltaChainError, match="the stored chunk must be 16 bytes, found absent"):
        reconstruct_inner([ainfo(1, None)], (0,), lambda *a: None, np.empty(4, np.uint32))
