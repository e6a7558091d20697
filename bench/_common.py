"""Helpers shared by the benchmarks under bench/: states to save, a cold page cache, memory and I/O
counters, isolated measurement processes, the C device probes (bench/probe.c), and markdown tables.

Everything here is measurement plumbing; the benchmarks themselves say what they compare.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from typing import Any

# -- states ----------------------------------------------------------------------------------------
#: GPT-2-like shapes: (vocab, context, width, layers). "small" is ~200 MB of fp32, "gpt2" is GPT-2 small
#: (124 M parameters, ~0.5 GB; 1.49 GB with AdamW: issue 14's state), "medium" is GPT-2 medium (~1.4 GB);
#: "tiny" is for smoke tests. The vocabulary keeps GPT-2's awkward 50257 rows (= 29 x 1733), so the
#: embedding's inner chunks are small and many, as they are in real checkpoints.
SIZES: dict[str, tuple[int, int, int, int]] = {
    "tiny": (1000, 64, 64, 2),
    "small": (50257, 1024, 512, 8),
    "gpt2": (50257, 1024, 768, 12),
    "medium": (50257, 1024, 1024, 24),
}


class _Tiled:
    """Cheap non-constant values: slices of one random block of 4 Mi floats, each tensor from its own
    offset (a save or load costs the same as with fresh random values, and 1 GB takes 0.2 s, not 4 s)."""

    def __init__(self, seed: int) -> None:
        import torch

        self.block = torch.randn(4 << 20, generator=torch.Generator().manual_seed(seed))
        self.at = 0

    def __call__(self, shape: tuple[int, ...], dtype: Any) -> Any:
        import torch

        out = torch.empty(shape, dtype=dtype)
        flat = out.view(-1)
        n, done, b = flat.numel(), 0, self.block.numel()
        while done < n:
            k = min(n - done, b - self.at)
            flat[done : done + k].copy_(self.block[self.at : self.at + k])
            done += k
            self.at = (self.at + k) % b
        self.at = (self.at + 7919) % b
        return out


def gpt_state(size: str, seed: int = 0, fill: str = "randn") -> dict[str, Any]:
    """A flat GPT-2-style fp32 state dict of random values (many tensors, varied shapes).

    ``fill="tiled"``: values from slices of one random block (:class:`_Tiled`), much faster to make."""
    import torch

    vocab, ctx, d, layers = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    tiled = _Tiled(seed) if fill == "tiled" else None

    def rnd(*shape: int) -> torch.Tensor:
        if tiled is not None:
            return tiled(shape, torch.float32)
        return torch.randn(*shape, generator=g, dtype=torch.float32)

    state: dict[str, Any] = {"transformer.wte.weight": rnd(vocab, d), "transformer.wpe.weight": rnd(ctx, d)}
    for i in range(layers):
        p = f"transformer.h.{i}."
        state.update(
            {
                p + "ln_1.weight": rnd(d),
                p + "ln_1.bias": rnd(d),
                p + "attn.c_attn.weight": rnd(d, 3 * d),
                p + "attn.c_attn.bias": rnd(3 * d),
                p + "attn.c_proj.weight": rnd(d, d),
                p + "attn.c_proj.bias": rnd(d),
                p + "ln_2.weight": rnd(d),
                p + "ln_2.bias": rnd(d),
                p + "mlp.c_fc.weight": rnd(d, 4 * d),
                p + "mlp.c_fc.bias": rnd(4 * d),
                p + "mlp.c_proj.weight": rnd(4 * d, d),
                p + "mlp.c_proj.bias": rnd(d),
            }
        )
    state["transformer.ln_f.weight"] = rnd(d)
    state["transformer.ln_f.bias"] = rnd(d)
    return state


def training_state(size: str, fill: str = "randn") -> dict[str, Any]:
    """:func:`gpt_state` under ``model/`` plus its AdamW state (``optim/<name>/exp_avg``, ``exp_avg_sq``):
    what a training checkpoint holds, 3x the parameters' bytes."""
    import torch

    params = gpt_state(size, seed=0, fill=fill)
    state = {f"model/{k}": v for k, v in params.items()}
    if fill == "tiled":
        tiled = _Tiled(1)
        for k, v in params.items():
            state[f"optim/{k}/exp_avg"] = tiled(tuple(v.shape), torch.float32).mul_(1e-3)
            state[f"optim/{k}/exp_avg_sq"] = tiled(tuple(v.shape), torch.float32).square_().mul_(1e-6)
        return state
    g = torch.Generator().manual_seed(1)
    for k, v in params.items():
        state[f"optim/{k}/exp_avg"] = torch.randn(v.shape, generator=g) * 1e-3
        state[f"optim/{k}/exp_avg_sq"] = torch.rand(v.shape, generator=g) * 1e-6
    return state


#: A Llama-7B-shaped model trimmed to 2 layers, bf16 weights only (~1.33 GB): vocabulary 32001 (Llama's
#: 32000 plus a pad token; = 3 x 10667, as awkward to chunk as GPT-2's 50257), width 4096, MLP 11008.
LLAMA = {"vocab": 32001, "d": 4096, "ffn": 11008, "layers": 2}


def llama_state(seed: int = 0) -> dict[str, Any]:
    """The trimmed Llama model of :data:`LLAMA` (bf16, tiled values)."""
    import torch

    v, d, f = LLAMA["vocab"], LLAMA["d"], LLAMA["ffn"]
    t = _Tiled(seed)
    bf = torch.bfloat16
    state: dict[str, Any] = {"model.embed_tokens.weight": t((v, d), bf)}
    for i in range(LLAMA["layers"]):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[p + f"self_attn.{n}.weight"] = t((d, d), bf)
        state[p + "mlp.gate_proj.weight"] = t((f, d), bf)
        state[p + "mlp.up_proj.weight"] = t((f, d), bf)
        state[p + "mlp.down_proj.weight"] = t((d, f), bf)
        state[p + "input_layernorm.weight"] = t((d,), bf)
        state[p + "post_attention_layernorm.weight"] = t((d,), bf)
    state["model.norm.weight"] = t((d,), bf)
    state["lm_head.weight"] = t((v, d), bf)
    return state


def state_nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


# -- files and the page cache ----------------------------------------------------------------------
def files_under(paths: Iterable[str]) -> list[str]:
    """Every regular file under ``paths`` (files or directories), sorted."""
    out: list[str] = []
    for p in paths:
        if os.path.isfile(p):
            out.append(p)
        else:
            for root, _dirs, names in os.walk(p):
                out.extend(os.path.join(root, n) for n in names)
    return sorted(out)


def tree_bytes(paths: Iterable[str]) -> int:
    return sum(os.path.getsize(f) for f in files_under(paths))


def drop_cache(paths: Iterable[str], method: str = "auto") -> str:
    """Evict the pages of every file under ``paths`` from the page cache; returns the method used.

    ``fadvise``: fsync + ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file, which evicts that file's
    clean pages and nobody else's. ``drop_caches``: ``echo 3 > /proc/sys/vm/drop_caches`` (root only;
    evicts the whole machine's cache, which disturbs other work). ``auto``: fadvise, checked with
    mincore, escalating to drop_caches only if pages remain.
    """
    files = files_under(paths)
    for f in files:  # dirty pages cannot be dropped: make them clean first
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if method != "drop_caches":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if method == "fadvise":
        return "fadvise"
    if method == "auto" and cached_fraction(files) < 0.001:
        return "fadvise"
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as fh:
        fh.write("3\n")
    return "drop_caches"


def block_sysfs(path: str) -> str:
    """/sys/dev/block/M:m of the block device holding ``path`` (a path not made yet: its nearest existing
    ancestor's). It may not exist (tmpfs and other filesystems without a block device)."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    st = os.stat(path)
    return f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}"


def settle(path: str = ".", quiet_s: float = 0.2, timeout: float = 10.0) -> float:
    """``sync``, then wait until the block device holding ``path`` has had no request in flight for
    ``quiet_s`` (/sys/dev/block/M:m/inflight), at most ``timeout``: deleted files' discards, writeback
    and other processes' bursts end before the next measurement. Returns the seconds waited."""
    t0 = time.perf_counter()
    os.sync()
    inflight = block_sysfs(path) + "/inflight"
    if not os.path.exists(inflight):
        return time.perf_counter() - t0
    quiet_since = None
    while time.perf_counter() - t0 < timeout:
        with open(inflight) as fh:
            busy = any(int(x) for x in fh.read().split())
        now = time.perf_counter()
        if busy:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        elif now - quiet_since >= quiet_s:
            break
        time.sleep(0.01)
    return time.perf_counter() - t0


def cached_fraction(paths: Iterable[str]) -> float:
    """Fraction of the files' pages in the page cache (mincore on a read-only mapping)."""
    import ctypes
    import mmap

    import numpy as np

    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = cached = 0
    for f in files_under(paths):
        size = os.path.getsize(f)
        if size == 0:
            continue
        with open(f, "rb") as fh:
            m = mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ)
        try:
            n = -(-size // page)
            vec = (ctypes.c_ubyte * n)()
            ptr = _map_address(m)
            if libc.mincore(ctypes.c_void_p(ptr), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            cached += int(np.count_nonzero(np.frombuffer(vec, dtype=np.uint8) & 1))
            total += n
        finally:
            m.close()
    return cached / total if total else 0.0


def _map_address(m: Any) -> int:
    """The address of an mmap object's mapping (mmap exposes no API for it; read it via the buffer)."""
    import ctypes

    class _Py_buffer(ctypes.Structure):
        _fields_ = [
            ("buf", ctypes.c_void_p),
            ("obj", ctypes.py_object),
            ("len", ctypes.c_ssize_t),
            ("itemsize", ctypes.c_ssize_t),
            ("readonly", ctypes.c_int),
            ("ndim", ctypes.c_int),
            ("format", ctypes.c_char_p),
            ("shape", ctypes.c_void_p),
            ("strides", ctypes.c_void_p),
            ("suboffsets", ctypes.c_void_p),
            ("internal", ctypes.c_void_p),
        ]

    view = _Py_buffer()
    get = ctypes.pythonapi.PyObject_GetBuffer
    get.argtypes = [ctypes.py_object, ctypes.POINTER(_Py_buffer), ctypes.c_int]
    if get(m, ctypes.byref(view), 0) != 0:
        raise OSError("PyObject_GetBuffer failed")
    try:
        return int(view.buf)
    finally:
        ctypes.pythonapi.PyBuffer_Release(ctypes.byref(view))


def warm_buffer(nbytes: int) -> memoryview:
    """A writable buffer of private anonymous memory, 2 MiB-aligned, huge pages where allowed, every
    page touched: the best case for reading into (shared or scattered 4 KiB pages make the block layer
    split O_DIRECT reads into small requests)."""
    import mmap

    import numpy as np

    huge = 2 << 20
    m = mmap.mmap(-1, nbytes + huge, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        m.madvise(mmap.MADV_HUGEPAGE)
    a = np.frombuffer(m, dtype=np.uint8)
    skip = -a.ctypes.data % huge
    a[skip : skip + nbytes : 4096] = 1
    return memoryview(m)[skip : skip + nbytes]


# -- process counters ------------------------------------------------------------------------------
def _status(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def rss() -> int:
    """Resident set size of this process, bytes."""
    return _status("VmRSS")


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """Peak resident set size (VmHWM) since the process started or the last :func:`reset_peak_rss`."""
    return _status("VmHWM")


def disk_read_bytes() -> int:
    """Bytes this process caused to be fetched from storage (/proc/self/io read_bytes; page-cache hits
    do not count, so with a cold cache this is what the disk delivered, readahead included)."""
    with open("/proc/self/io") as fh:
        for line in fh:
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    return 0


class Device:
    """What an interval asked of the block device holding ``path`` and of the CPUs, from counters the
    kernel keeps anyway (nothing sampled, so nothing taken from the code measured):
    /sys/dev/block/M:m/stat (Documentation/block/stat.rst) and this process's CPU times (``os.times``,
    its children's included).

    ``Device(path).delta(before)`` of a :meth:`snapshot` taken at the start gives: ``busy``, the fraction
    of the wall time with a request in flight (io_ticks); ``inflight``, the mean number in flight while
    busy (time_in_queue / io_ticks); ``requests`` and ``kib`` (mean KiB per request), reads and writes
    together; ``user`` / ``sys``, CPU seconds. Empty where the counters are missing (not Linux, a
    filesystem without a block device)."""

    def __init__(self, path: str) -> None:
        self.stat = block_sysfs(path) + "/stat"

    def snapshot(self) -> tuple[float, list[int], os.times_result]:
        try:
            with open(self.stat) as fh:
                fields = [int(x) for x in fh.read().split()]
        except OSError:
            fields = []
        return time.perf_counter(), fields, os.times()

    def delta(self, before: tuple[float, list[int], os.times_result], seconds: float | None = None
              ) -> dict[str, float]:
        """The counters since ``before``. ``seconds``: the timed part of the interval, where it is
        shorter than the wall time between the snapshots (a probe times its I/O, not its start and the
        touching of its memory): the busy share is of it, and the CPU times, which would include the
        rest, are left out."""
        t1, f1, c1 = self.snapshot()
        t0, f0, c0 = before
        if len(f0) < 11 or len(f1) < 11:
            return {}
        d = [b - a for a, b in zip(f0, f1, strict=False)]
        ticks, requests = d[9], d[0] + d[4]  # io_ticks (ms); reads + writes completed
        out = {
            "busy": min(1.0, ticks / 1e3 / max(t1 - t0 if seconds is None else seconds, 1e-9)),
            "inflight": d[10] / ticks if ticks else 0.0,
            "requests": requests,
            "kib": (d[2] + d[6]) * 512 / 1024 / requests if requests else 0.0,
        }
        if seconds is None:
            out["user"] = (c1.user - c0.user) + (c1.children_user - c0.children_user)
            out["sys"] = (c1.system - c0.system) + (c1.children_system - c0.children_system)
        return out


class Meter:
    """Wall time, peak-RSS delta, disk bytes and (``path``: the directory read or written) what the device
    and the CPUs did (:class:`Device`) of the code inside ``with Meter() as m:``."""

    def __init__(self, path: str | None = None) -> None:
        self.device = Device(path) if path else None
        self.dev: dict[str, float] = {}

    def __enter__(self) -> Meter:
        import gc

        gc.collect()
        reset_peak_rss()
        self.rss0 = rss()
        self.io0 = disk_read_bytes()
        self.dev0 = self.device.snapshot() if self.device else None
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        if self.device is not None and self.dev0 is not None:
            self.dev = self.device.delta(self.dev0)
        self.disk = disk_read_bytes() - self.io0
        self.peak_delta = max(0, peak_rss() - self.rss0)

    def result(self, **extra: Any) -> dict[str, Any]:
        out = {"seconds": self.seconds, "disk": self.disk, "peak_rss_delta": self.peak_delta, **extra}
        if self.device is not None:  # only where measured: the benches take medians over these fields
            out["device"] = self.dev
        return out


# -- isolated runs ---------------------------------------------------------------------------------
#: A fixed mmap threshold turns off glibc's adaptive one, so every large buffer freed by one case is
#: unmapped and the next case faults in fresh pages, as a fresh process would.
CHILD_ENV = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10), "OMP_NUM_THREADS": "2"}


def run_child(argv: Sequence[str], timeout: float = 600) -> Any:
    """Run ``python argv...`` in a fresh process; its last stdout line is JSON, returned decoded."""
    env = {**os.environ, **CHILD_ENV}
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"child {' '.join(argv)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    return json.loads(lines[-1])


def compile_package() -> None:
    """Byte-compile the ucl package the benchmarks import, as ``pip install`` does: where
    PYTHONDONTWRITEBYTECODE is set (these machines) a source checkout would otherwise be compiled anew in
    every fresh process, a cost no installed ucl has."""
    import compileall

    import ucl

    compileall.compile_dir(os.path.dirname(os.path.abspath(ucl.__file__)), quiet=1)


# -- the C device probes (bench/probe.c) ------------------------------------------------------------
PROBE_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "probe.c")


def probe_binary() -> str:
    """bench/probe.c built with the system cc (once per source version, under bench-out/.probe/)."""
    with open(PROBE_SRC, "rb") as fh:
        tag = hashlib.sha256(fh.read()).hexdigest()[:12]
    out_dir = os.path.join(os.path.dirname(PROBE_SRC), "..", "bench-out", ".probe")
    exe = os.path.abspath(os.path.join(out_dir, f"probe-{tag}"))
    if not os.path.exists(exe):
        os.makedirs(out_dir, exist_ok=True)
        cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
        tmp = f"{exe}.{os.getpid()}"
        subprocess.run([cc, "-O2", "-pthread", "-o", tmp, PROBE_SRC], check=True)
        os.replace(tmp, exe)
    return exe


def probe_write(directory: str, sizes: Sequence[int], threads: int = 4, block: int = 8 << 20,
                sync: str = "fdatasync") -> dict[str, Any]:
    """The write probe: files ``directory/p0..`` of ``sizes`` (each rounded up to 4 KiB) with O_DIRECT,
    ``threads`` requests of ``block`` bytes in flight, ``sync`` (fdatasync each file, one syncfs, none);
    timed open to close. Returns the probe's JSON (``seconds``, ``joined``, ``bytes``, ...)."""
    os.makedirs(directory, exist_ok=True)
    argv = [probe_binary(), "write", directory, *(str(-(-n // 4096) * 4096) for n in sizes),
            "-t", str(threads), "-b", str(block), "-s", sync]
    out: dict[str, Any] = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    return out


def probe_read(files: Sequence[str], threads: int = 4, block: int = 8 << 20) -> dict[str, Any]:
    """The read probe: ``files`` read with O_DIRECT, ``threads`` requests of ``block`` bytes in flight, into
    one touched destination; timed open to close. Returns the probe's JSON."""
    argv = [probe_binary(), "read", *files, "-t", str(threads), "-b", str(block)]
    out: dict[str, Any] = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    return out


# -- statistics and tables -------------------------------------------------------------------------
def median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return math.nan
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def fmt_bytes(n: float) -> str:
    if n != n:  # NaN
        return "-"
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}" if unit == "GB" else f"{n / k:.1f} {unit}"
    return f"{int(n)} B"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one letter per column (l/r), default: first left, rest right."""
    align = align or "l" + "r" * (len(headers) - 1)
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return (
            "| "
            + " | ".join(
                c.ljust(w) if a == "l" else c.rjust(w) for c, w, a in zip(r, widths, align, strict=True)
            )
            + " |"
        )

    sep = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if a == "r" else (":" + "-" * (w + 1))
            for w, a in zip(widths, align, strict=True)
        )
        + "|"
    )
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def machine_line() -> str:
    """One line describing the machine: CPUs, memory, the filesystem of the current directory."""
    ncpu = os.cpu_count()
    try:
        with open("/proc/meminfo") as fh:
            mem = int(fh.readline().split()[1]) * 1024
    except OSError:
        mem = 0
    return f"{ncpu} CPUs, {fmt_bytes(mem)} RAM, Python {sys.version.split()[0]}"
