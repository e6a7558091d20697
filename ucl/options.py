"""Tuning, as explicit frozen options passed down from the API (never module globals).

Every field has a measured default; change one for a workload or a test, e.g.
``ucl.open(path, options=ReadOptions(direct=False))``. Options never change what is read or written,
only how: the same bytes, the same checks, the same errors.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ChainOptions:
    """How delta-chain reads run (:class:`ucl.read.chain.ChainReader`; spec/delta.md §6.3).

    Attributes
    ----------
    io_threads
        Reads in flight (page-cache copies and device requests), process-wide.
    decode_threads
        Chunk rebuilds (the C decoder releases the GIL), process-wide.
    group_bytes
        Inner-chunk bytes x links read of one group: the unit of fetching and of the in-flight budget.
    inflight_bytes
        Fetched bytes waiting for their decode (one group at least, whatever its size).
    whole_max_bytes
        A shard needed whole and at most this big is read in one request, index included.
    segment_max_bytes
        The most one read of adjacent chunks covers.
    small_bytes, small_batch_bytes
        A group reading at most ``small_bytes`` is read and rebuilt by one task, batched with its
        neighbours up to ``small_batch_bytes``: their reads are latency, and a task each would cost more.
    parallel_min_bytes
        A smaller inner chunk is decoded payload after payload on one thread; larger ones in parallel.
    """

    io_threads: int = 4
    decode_threads: int = field(default_factory=lambda: min(8, os.cpu_count() or 1))
    group_bytes: int = 32 << 20
    inflight_bytes: int = 64 << 20
    whole_max_bytes: int = 16 << 20
    segment_max_bytes: int = 16 << 20
    small_bytes: int = 256 << 10
    small_batch_bytes: int = 1 << 20
    parallel_min_bytes: int = 256 << 10


@dataclass(frozen=True)
class ReadOptions:
    """How a reader reads (:func:`ucl.open`, :func:`ucl.load`, the validator).

    Attributes
    ----------
    threads
        Data reads of one plain read in flight (a step's pool, made for reads of more than 8 MiB).
    check_threads
        Threads of a bulk read that check (crc32c) and copy what the read threads read with O_DIRECT,
        so that each read thread goes on to its next request at once (0: the read threads do it).
    index_threads
        Shard index reads in flight: small and latency-bound, so more than the data reads.
    segment_bytes
        Adjacent inner chunks of a file are read together up to this much (one task, one request).
    direct
        O_DIRECT for cold ranges of local files read in bulk (``load``, ``load_into``, a layout or DCP
        load), which would otherwise pass every byte through the page cache; lazy reads of a tensor or a
        slice (``ckpt[name][rows]``) always read through the cache, so that reading those bytes again is
        served from memory (False: always buffered; see :mod:`ucl.io.ranges`).
    direct_min_bytes
        Smaller ranges are read buffered (alignment overhead; readahead helps them).
    small_shard_bytes
        A small shard that a read needs whole is read in one request together with its index.
    fill_buffer_bytes
        Temporaries and decode scratch of one batch of box copies (the memory bound of a load beside
        its destinations); larger copies are split.
    keep_buffer_bytes
        Pooled read buffers kept between reads (warm pages for the next read).
    prefault
        Map fresh destination pages on a side thread while the device works (:mod:`ucl.io.prefault`).
    native
        A bulk read's cold segments whose chunks go whole to contiguous destinations are read, checked and
        copied by the C engine on ``threads`` threads (:mod:`ucl.read.bulk`); False: by the Python
        pipeline, as every other segment. The same bytes, checks and errors either way.
    map_slices
        A lazy read of whole rows (``ckpt[name][a:b]``, 1 MiB or more, inside one shard) whose pages are
        cached returns the file's pages mapped copy-on-write instead of a copy, every chunk's crc32c
        checked first (:mod:`ucl.read.mapped`); False: always a copy.
    chain
        Delta-chain reads.
    """

    threads: int = 4
    check_threads: int = field(default_factory=lambda: min(2, os.cpu_count() or 1))
    index_threads: int = 8
    segment_bytes: int = 8 << 20
    direct: bool = True
    direct_min_bytes: int = 256 << 10
    small_shard_bytes: int = 128 << 10
    fill_buffer_bytes: int = 64 << 20
    keep_buffer_bytes: int = 64 << 20
    prefault: bool = True
    native: bool = True
    map_slices: bool = True
    chain: ChainOptions = field(default_factory=ChainOptions)


DEFAULT_READ = ReadOptions()


@dataclass(frozen=True)
class WriteOptions:
    """How a writer lays out and commits a step (:func:`ucl.save`, :class:`ucl.CheckpointManager`, import,
    compaction, the DCP writer). Changes the stored chunking, never the values.

    Attributes
    ----------
    inner_chunk_bytes
        Target size of an inner chunk (the unit of a checksum and of a partial read): inner chunks are
        a quarter to twice this size for any shape (:func:`ucl.format.shardfile.choose_chunks`).
        spec/core.md §6 recommends 1-8 MiB.
    commit_threads
        Documents and directory syncs in flight at commit (local filesystems without syncfs, object
        stores).
    staging_threads
        Threads of a manager that touch its staging memory's fresh pages in the background, while
        training runs (:mod:`ucl.write.staging`; two fault pages in ~1.7x faster than one here).
    stream_bytes
        When positive, a manager hands a full step's staged state to its writer threads in batches of
        about this many bytes as the copy goes, so that the writes overlap the copy; 0 (default): once
        the whole state is staged. Off by default: on a 2-core CPU host the writer's checksums then
        compete with the copy (``bench/peers.py --size gpt2``: blocked 0.25 -> 0.43 s for durable
        1.33 -> 1.28 s); where the copy is a device-to-host DMA the cores are free for the writer.
        Delta steps, gradient records and composite steps are always staged whole first.
    format_version
        The newest format version of the steps :func:`ucl.save` and :func:`ucl.save_sharded` write, and
        a :class:`ucl.CheckpointManager` given these options: 3 (default) packs the step document of a
        step with a layout (spec/core.md §9 item 6) and writes every other step as version 2; 2 for
        readers of version 2 (no packed documents); 1 for readers of version 1 only (spec/core.md §9
        item 5: each logical record in its array's document, a document for every delta array, the
        commit record's files by whole path).
    """

    inner_chunk_bytes: int = 4 << 20
    commit_threads: int = 16
    staging_threads: int = 2
    stream_bytes: int = 0
    format_version: int = 3

    def __post_init__(self) -> None:
        if self.stream_bytes < 0:
            raise ValueError(f"stream_bytes must be >= 0, got {self.stream_bytes!r}")
        if self.format_version not in (1, 2, 3):
            raise ValueError(f"format_version must be 1, 2 or 3, got {self.format_version!r}")


DEFAULT_WRITE = WriteOptions()
