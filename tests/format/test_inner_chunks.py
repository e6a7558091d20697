"""Choosing inner chunks (ucl/format/shardfile.py: choose_chunks, choose_inner_chunk; spec/core.md §6):
1-8 MiB (a quarter to twice the target) for any shape and any number of writers, a grid chunk rounded
up only along dimensions one writer holds whole, and the old choice kept wherever it was already good."""

from __future__ import annotations

import itertools
import math

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, assume, given, settings

from ucl.format.shardfile import (
    INNER_CHUNK_BYTES,
    INNER_HI,
    INNER_LO,
    PAGE,
    _leading_divisors,
    choose_chunks,
    choose_inner_chunk,
)

MiB = 1 << 20


def _check_grid(shape: tuple[int, ...], block: tuple[int, ...], chunk: tuple[int, ...],
                inner: tuple[int, ...]) -> None:
    """The rules every choice keeps: the inner chunk divides the grid chunk; the grid chunk is the block
    but along a dimension the writer holds whole, where it may pass the array's end by less than one inner
    chunk (so no inner chunk lies wholly outside the array)."""
    for d, (s, b, c, i) in enumerate(zip(shape, block, chunk, inner, strict=True)):
        assert c % i == 0, (shape, block, chunk, inner)
        if b >= s:
            assert c >= max(1, s) and c - max(1, s) < i, (d, shape, block, chunk, inner)
        else:
            assert c == b, (d, shape, block, chunk, inner)


def _reachable(shape: tuple[int, ...], block: tuple[int, ...], itemsize: int, target: int) -> bool:
    """Brute force: does any inner chunk within the range exist (any size along a dimension held whole,
    a divisor of the block along one split among writers)?"""
    lo, hi = target * INNER_LO, target * INNER_HI
    opts = [range(1, max(1, s) + 1) if b >= s else [x for x in range(1, b + 1) if b % x == 0]
            for s, b in zip(shape, block, strict=True)]
    return any(lo <= math.prod(i) * itemsize <= hi for i in itertools.product(*opts))


@st.composite
def small_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], int, int]:
    nd = draw(st.integers(1, 4))
    shape = tuple(draw(st.integers(0 if nd > 1 else 1, 14 if nd > 2 else 60)) for _ in range(nd))
    writers = [draw(st.integers(1, max(1, s))) if draw(st.booleans()) else 1 for s in shape]
    block = tuple(max(1, -(-s // k)) for s, k in zip(shape, writers, strict=True))  # torch.chunk blocks
    return shape, block, draw(st.sampled_from([1, 2, 4, 8])), draw(st.sampled_from([16, 64, 256, 1024]))


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_cases())
def test_in_range_whenever_any_chunk_is(case: tuple) -> None:
    """Small shapes and targets, every writer split: the choice is in range exactly when some inner chunk
    allowed by the grid is (brute force), and always follows the grid rules."""
    shape, block, itemsize, target = case
    chunk, inner = choose_chunks(shape, block, itemsize, target)
    _check_grid(shape, block, chunk, inner)
    nbytes = math.prod(inner) * itemsize
    if math.prod(block) * itemsize < target * INNER_LO:
        assert inner == block and chunk == block  # a small block is one inner chunk
    elif _reachable(shape, block, itemsize, target):
        assert target * INNER_LO <= nbytes <= target * INNER_HI, (shape, block, itemsize, target, inner)


@st.composite
def real_cases(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], int]:
    """Real-sized tensors (vocabularies, primes, round sizes) split among up to 64 writers along their
    first dimension (the trailing ones held whole: those of a transformer's weights)."""
    nd = draw(st.integers(1, 3))
    dim = st.one_of(st.integers(1, 1 << 17), st.sampled_from([32001, 50257, 128256, 151936, 7919, 65521,
                                                              4096, 768, 11008, 1000003]))
    shape = tuple(draw(dim) for _ in range(nd))
    if nd == 3:
        shape = (draw(st.integers(1, 64)), *shape[1:])
    k = draw(st.sampled_from([1, 1, 2, 3, 4, 7, 8, 16, 64]))
    block = (max(1, -(-shape[0] // k)), *shape[1:])
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    # real tensors: a writer's block under 1 TiB. Past ~100 TiB with prime trailing dims (17 x 1000003 x
    # 1000003 of 8 bytes) the 2^24 inner chunks a shard may hold leave no 1-8 MiB size at all
    assume(math.prod(block) * itemsize <= 1 << 40)
    return shape, block, itemsize


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(real_cases())
def test_real_sizes_get_1_to_8_mib(case: tuple) -> None:
    """At the default 4 MiB target: 1-8 MiB inner chunks whenever the block holds 1 MiB, unless the
    block is one dimension split among writers with no divisor in range (nothing can be: a prime block)."""
    shape, block, itemsize = case
    chunk, inner = choose_chunks(shape, block, itemsize)
    _check_grid(shape, block, chunk, inner)
    if math.prod(block) * itemsize < MiB:
        assert inner == block
        return
    nbytes = math.prod(inner) * itemsize
    if len(shape) == 1 and block[0] < shape[0]:
        divs = [x for x in range(1, math.isqrt(block[0]) + 1) if block[0] % x == 0]
        divs += [block[0] // x for x in divs]
        if not any(MiB <= x * itemsize <= 8 * MiB for x in divs):
            return
    assert MiB <= nbytes <= 8 * MiB, (shape, block, itemsize, inner, nbytes)


@pytest.mark.parametrize(
    ("shape", "block", "itemsize", "chunk", "inner"),
    [
        ((32001, 4096), None, 4, (32004, 4096), (254, 4096)),  # LLaMA vocab + 1 = 3 x 10667: was 3 rows
        ((32001, 4096), None, 2, (32004, 4096), (508, 4096)),
        # GPT-2: 30 x 1676 rows, 4.9 MiB in whole pages, 23 rows of padding (29 x 1733 rows, unpadded, is not
        # whole pages: a slice of it could not be mapped)
        ((50257, 768), None, 4, (50280, 768), (1676, 768)),
        ((50257, 1024), None, 4, (50257, 1024), (1733, 1024)),  # whole pages already: 29 x 1733, no padding
        ((50257,), None, 4, (50257,), (50257,)),  # 196 KiB: one inner chunk
        ((2**31 - 1,), None, 4, (2**31,), (1 << 20,)),  # a prime: 2048 chunks, one padded element
        ((4096, 4096), None, 4, (4096, 4096), (256, 4096)),  # round shapes: unchanged
        ((50257, 768), (6283, 768), 4, (6283, 768), (6283, 192)),  # 8 writers: 6283 = 61 x 103 rows
        ((32001, 4096), (4001, 4096), 4, (4001, 4096), (4001, 256)),  # 8 writers, 4001 rows (a prime)
    ],
)
def test_worked_examples(shape: tuple, block: tuple | None, itemsize: int, chunk: tuple,
                         inner: tuple) -> None:
    assert choose_chunks(shape, block or shape, itemsize) == (chunk, inner)


@settings(max_examples=300, deadline=None)
@given(real_cases())
def test_good_old_choices_are_kept(case: tuple) -> None:
    """Where the leading-dimension divisors already gave 1-8 MiB (or the whole block), the choice and the
    grid are what ucl 1.1 wrote, unless its inner chunks are not whole pages along a dimension the writer
    holds whole: then the same split in whole pages (shardfile._in_pages), in range, padded by at most a
    1/256 of the dimension. Nothing changes for round shapes."""
    shape, block, itemsize = case
    old = _leading_divisors(block, itemsize, INNER_CHUNK_BYTES)
    if old == block or MiB <= math.prod(old) * itemsize <= 8 * MiB:
        chunk, inner = choose_chunks(shape, block, itemsize)
        if (chunk, inner) == (block, old):
            return
        p = next(d for d in range(len(old)) if old[d] != block[d])
        assert math.prod(old) * itemsize % PAGE and block[p] >= shape[p], (case, inner)
        assert math.prod(inner) * itemsize % PAGE == 0 and MiB <= math.prod(inner) * itemsize <= 8 * MiB
        assert inner[:p] == old[:p] and inner[p + 1 :] == old[p + 1 :] and chunk[p] % inner[p] == 0
        assert shape[p] <= chunk[p] < shape[p] + inner[p] and (chunk[p] - shape[p]) * 256 <= shape[p]


def test_a_fixed_block_is_never_rounded() -> None:
    """free=(): the grid chunk is given (a DCP item's chunk): the inner chunk divides it, splitting a
    second dimension when the first has no divisor in range."""
    assert choose_chunks((50257, 768), (50257, 768), 4, free=()) == ((50257, 768), (1733, 768))
    assert choose_chunks((32001, 4096), (32001, 4096), 4, free=()) == ((32001, 4096), (10667, 128))
    for block in [(32001, 4096), (7919, 7919), (10667, 4096, 3), (65521,)]:
        chunk, inner = choose_chunks(block, block, 4, free=())
        assert chunk == block and all(b % i == 0 for b, i in zip(block, inner, strict=True))
    assert choose_chunks((), (), 4) == ((), ())
    assert choose_chunks((0, 5), (1, 5), 4) == ((1, 5), (1, 5))


def test_choose_inner_chunk_is_the_contiguous_rule() -> None:
    """choose_inner_chunk keeps ucl 1.1's rule (leading dimensions, divisors: one contiguous run of the
    block), which the zarr_store adapter's views rely on."""
    assert choose_inner_chunk((32001, 4096), 4) == (3, 4096)
    assert choose_inner_chunk((50257, 768), 4) == (29, 768)
    assert choose_inner_chunk((4096, 4096), 4) == (256, 4096)
    assert choose_inner_chunk((), 4) == ()


def test_limits_hold_for_huge_prime_blocks() -> None:
    """A block nothing divides well: the inner chunk stays within the format's limits (spec/core.md §6
    item 4: at most 2^24 inner chunks per shard, 2^31 bytes each)."""
    p = 2**31 - 1
    chunk, inner = choose_chunks((8 * p,), (p,), 1)  # one split dimension, a prime: no divisor but 1, p
    assert chunk == (p,)
    assert math.prod(inner) <= 1 << 31 and p // math.prod(inner) <= 1 << 24


def test_a_block_split_for_resharding_keeps_its_pieces() -> None:
    # A layout array split along its dimensions for readers of other configurations (spec/layout.md §9.2)
    # keeps the pieces' inner chunks: merged into 1-8 MiB chunks, a rows tp=4 reader of a columns tp=2
    # step read 13.8x its shard's bytes (bench/reshard.py --size small, before this rule).
    from ucl.plan.items import ArraySpec
    from ucl.plan.save import chunks_for

    spec = ArraySpec(name="wte", shape=(50257, 512), dtype="float32", chunk_shape=(50257, 256))
    chunk, inner = chunks_for(spec, split=(1,))
    assert chunk == (50257, 256)  # a split block's grid chunk is the block
    assert inner[1] < 256  # columns split too, as the other configurations read them
    assert inner[0] <= -(-50257 // 8) and all(b % i == 0 for b, i in zip(chunk, inner, strict=True))
    assert math.prod(inner) * 4 <= 4 << 20
    # an unsplit block of the same shape gets 1-8 MiB inner chunks, its grid rounded past the array's end
    whole = ArraySpec(name="wte", shape=(32001, 4096), dtype="float32", chunk_shape=(32001, 4096))
    chunk, inner = chunks_for(whole)
    assert 1 << 20 <= math.prod(inner) * 4 <= 8 << 20 and chunk[0] % inner[0] == 0 and chunk[0] >= 32001


def test_chunks_too_small_to_align_are_not_padded_into_pages() -> None:
    """At a 256 KiB target the GPT-2 embedding's chunks would stay under ALIGNED_MIN_BYTES, laid out back
    to back whatever their size: no rows of padding are added to make them whole pages."""
    assert choose_chunks((50257, 768), (50257, 768), 4, 256 << 10) == ((50257, 768), (29, 768))
    assert choose_chunks((50257, 768), (50257, 768), 4) == ((50280, 768), (1676, 768))
