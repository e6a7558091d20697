"""The demo (``python examples/demo.py``, which ``./dev demo`` runs): ucl on a small model, end to end, on CPU.

Acts, in order (each a function of :class:`Demo`; later features add theirs to :data:`ACTS`):

1. train      train a small GPT for ``--steps`` steps; ``CheckpointManager.save`` of model + AdamW state
              every step (delta steps between full ones, retention), its cost beside the step time
2. crash      a child process resumes from the latest step, trains and saves, and is SIGKILLed in the
              middle of a save: the latest committed step is intact, the half-written step is invisible
3. resume     reload the latest step into a fresh model and optimizer and train on: every loss, and the
              final state, equal those of an uninterrupted run bit for bit
4. lazy_read  ``ckpt[name][:8]`` reads only the inner chunks holding those rows
5. validate   ``ucl.validate`` over every committed step
6. native     the same bytes through zarr-python and through tensorstore (in a process with no ucl code)
7. zarr       a delta step mounted as a zarr store (``ucl.adapters.zarr_store``): chain resolved, bit-exact
8. reshard    the state saved as the 4 ranks of TP=2 x PP=2 hold it, loaded as TP=4 and as one process:
              bit-exact, and the next training step gives the same loss

Exit status: 0 when every check passes, 1 when one fails, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import ucl
from ucl.errors import CheckpointNotFoundError
from ucl.format import names, structure
from ucl.io.stores.local import LocalStore
from ucl.testing.gpt import (
    SyntheticData,
    full_state,
    get_config,
    load_full_state,
    make_model_and_optimizer,
    train_step,
)
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy

EMBEDDING = "model/embedding.word_embeddings.weight"
MARKER = ".ucl-demo"  # a --dir holding this file is a previous demo output and may be replaced
CHILD_TIMEOUT_S = 300.0


# -- the demo's state, shared by the acts --------------------------------------------------------
@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Demo:
    """What the acts share. An act reads what earlier acts left here and adds its own results."""

    args: argparse.Namespace
    root: str  # the demo directory
    repo: str  # the checkpoint repository inside it
    model: Any = None  # the uninterrupted run (in memory; never reloaded)
    opt: Any = None
    data: SyntheticData | None = None
    step: int = 0  # the uninterrupted run's last step
    losses: dict[int, float] = field(default_factory=dict)  # uninterrupted run: step -> loss
    train_times: list[float] = field(default_factory=list)
    save_times: list[float] = field(default_factory=list)
    step_bytes: float = 0  # bytes one full step occupies (from its commit record)
    delta_bytes: float = 0  # median bytes of a delta step
    n_tensors: int = 0
    crash_losses: dict[int, float] = field(default_factory=dict)  # losses the crashed child reported
    crashed_step: int | None = None  # the step whose save was killed
    resumed: Any = None  # (model, opt) of the run resumed from the repository
    checks: list[Check] = field(default_factory=list)
    summary: dict[str, str] = field(default_factory=dict)  # ordered lines of the closing summary

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append(Check(name, bool(ok), detail))
        print(f"  [{'ok' if ok else 'FAIL'}] {name}{': ' + detail if detail else ''}", flush=True)
        return bool(ok)

    def latest(self) -> int:
        with ucl.open(self.repo) as ck:
            return ck.step


# -- helpers ---------------------------------------------------------------------------------------
def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (NaN payloads and signed zeros included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def states_bit_equal(x: Mapping[str, Any], y: Mapping[str, Any]) -> tuple[bool, str]:
    """Compare two nested state dicts: structure, JSON leaves, and every tensor's bytes."""
    tx, treex = structure.flatten(x)
    ty, treey = structure.flatten(y)
    if treex != treey:
        return False, "structure or non-tensor values differ"
    bad = [n for n in tx if not bit_equal(tx[n], ty[n])]
    if bad:
        return False, f"{len(bad)} of {len(tx)} tensors differ, e.g. {bad[0]!r}"
    return True, f"{len(tx)} tensors, {fmt_bytes(sum(t.nbytes for t in tx.values()))}"


def record_bytes(record: Any) -> int:
    return sum(size for size, _crc in record.files.values())


# -- act 1: train, checkpointing every step through the engine ----------------------------------
def act_train(d: Demo) -> None:
    a = d.args
    d.model, d.opt = make_model_and_optimizer(a.preset, a.seed)
    d.data = SyntheticData(d.model.config, a.seed, batch_size=a.batch)
    c = d.model.config
    print(f"  {a.preset}: {c.n_params / 1e6:.2f}M parameters (vocab {c.vocab}, d_model {c.d_model}, "
          f"{c.n_layers} layers, {c.n_heads} heads / {c.n_kv_heads} kv heads), "
          f"batch {d.data.batch_size}x{c.seq_len}, {torch.get_num_threads()} threads")
    # a few steps without checkpointing: the baseline step time (the uninterrupted run is unaffected:
    # these steps train a throw-away copy)
    probe, probe_opt = make_model_and_optimizer(a.preset, a.seed)
    base = []
    for step in range(1, 4):
        t0 = time.perf_counter()
        train_step(probe, probe_opt, d.data.batch(step))
        base.append(time.perf_counter() - t0)
    del probe, probe_opt
    policy = DeltaPolicy(full_every=a.full_every, gradients=a.gradient_records)
    records: dict[int, Any] = {}
    t_loop = time.perf_counter()
    with CheckpointManager(d.repo, delta=policy, keep_last=a.keep_last) as mgr:
        handles = {}
        for step in range(1, a.steps + 1):
            t0 = time.perf_counter()
            d.losses[step] = train_step(d.model, d.opt, d.data.batch(step))
            t1 = time.perf_counter()
            # returns once staged; with the optimizer, a save one step after the previous stores its gradients
            handles[step] = mgr.save(step, full_state(d.model, d.opt),
                                     optimizer=d.opt if a.gradient_records else None)
            t2 = time.perf_counter()
            d.train_times.append(t1 - t0)
            d.save_times.append(t2 - t1)
            done = [s for s, h in handles.items() if h.done()]
            for s in done:
                records[s] = handles.pop(s).result()
            if step <= 3 or step % 5 == 0 or step == a.steps:
                print(f"  step {step:3d}  loss {d.losses[step]:.4f}  train {t1 - t0:.3f} s  save blocked "
                      f"{1e3 * (t2 - t1):.1f} ms")
        mgr.wait()
        for s, h in handles.items():
            records[s] = h.result()
    loop = time.perf_counter() - t_loop
    d.step = a.steps
    full = [r for r in records.values() if r.kind == "full"]
    deltas = [r for r in records.values() if r.kind == "delta"]
    grads = [r for r in deltas if any(f.startswith("grad/") for f in r.files)]  # gradient-record steps
    states = [r for r in deltas if r not in grads]
    d.step_bytes = statistics.median(record_bytes(r) for r in full)
    d.delta_bytes = statistics.median(record_bytes(r) for r in deltas) if deltas else 0
    d.n_tensors = len(next(iter(records.values())).files)
    first, last = d.losses[1], d.losses[a.steps]
    d.check("loss decreases", last < first,
            f"{first:.4f} -> {last:.4f} (best possible <= {d.data.loss_bound:.2f})")
    d.check("every step committed", sorted(records) == list(range(1, a.steps + 1)),
            f"steps 1..{a.steps}: {len(full)} full, {len(deltas)} delta ({len(grads)} of them gradient records)")
    kept = ucl.Repository.open(d.repo).steps()
    newest = list(range(max(1, a.steps - a.keep_last + 1), a.steps + 1))
    d.check("retention kept the newest steps and the bases their deltas need", kept[-len(newest):] == newest
            and all(ucl.open(d.repo, s).load(flat=True) is not None for s in newest), f"kept {kept}")
    med = statistics.median
    block = med(d.save_times) / med(d.train_times)
    wall = loop / (med(base) * a.steps) - 1
    print(f"  bytes per step: full {fmt_bytes(d.step_bytes)}, delta {fmt_bytes(d.delta_bytes)} "
          f"({d.step_bytes / max(d.delta_bytes, 1):.2f}x smaller, bit-exact)")
    for label, group in (("gradient records", grads), ("state deltas", states)):
        if group:
            b = statistics.median(record_bytes(r) for r in group)
            print(f"    {label}: {len(group)} steps of median {fmt_bytes(b)} ({d.step_bytes / max(b, 1):.2f}x smaller)")
    print(f"  checkpoint cost: save blocks {1e3 * med(d.save_times):.1f} ms = {100 * block:.1f}% of a "
          f"{1e3 * med(d.train_times):.0f} ms step; loop wall time {100 * wall:+.1f}% vs steps without saves")
    d.summary["model"] = (f"{a.preset}: {c.n_params / 1e6:.2f}M params; model + AdamW state "
                          f"{fmt_bytes(d.step_bytes)} per full step")
    d.summary["deltas"] = (f"{len(deltas)} delta steps of median {fmt_bytes(d.delta_bytes)} beside "
                           f"{fmt_bytes(d.step_bytes)} full ({d.step_bytes / max(d.delta_bytes, 1):.2f}x smaller)")
    d.summary["engine"] = (f"save blocks training {100 * block:.1f}% of its step time (median "
                           f"{1e3 * med(d.save_times):.1f} ms); wall time of the loop {100 * wall:+.1f}% "
                           "(CPU shared with the background writer)")


# -- act 2: crash in the middle of a save --------------------------------------------------------
class PausingStore(LocalStore):
    """A local store that, once ``after`` shard files of step ``step`` are handed to the writer threads,
    announces it and waits (to be SIGKILLed) before handing out the next: a crash in the middle of a
    save, at a known point. (``ucl.save`` asks the store for each shard file's path, then its C threads
    write the file, as the manager's do.)"""

    def __init__(self, root: str, step: int, after: int, total: int) -> None:
        super().__init__(root)
        self.prefix = f"steps/{step}/"
        self.after, self.total, self.handed = after, total, 0

    def write_path(self, key: str) -> str | None:
        if key.startswith(self.prefix) and not key.endswith("zarr.json"):
            if self.handed == self.after:
                time.sleep(0.5)  # the files handed out are written meanwhile
                print(f"CRASH-POINT {self.prefix.split('/')[1]} {self.handed} {self.total}", flush=True)
                time.sleep(CHILD_TIMEOUT_S)  # the parent kills us here; if it died instead, never commit
                os._exit(4)
            self.handed += 1
        return super().write_path(key)


def crash_child(a: argparse.Namespace) -> int:
    """The child of act 2: resume from the latest step, train and save ``--crash-after`` steps, then
    train one more and die during its save."""
    torch.set_num_threads(a.threads)
    model, opt = make_model_and_optimizer(a.preset, a.seed)
    data = SyntheticData(model.config, a.seed, batch_size=a.batch)
    with ucl.open(a.dir) as ck:
        start = ck.step
        load_full_state(model, opt, ck.load())
    print(f"RESUMED {start}", flush=True)
    step = start
    for step in range(start + 1, start + a.crash_after + 1):
        loss = train_step(model, opt, data.batch(step))
        ucl.save(full_state(model, opt), a.dir, step=step)
        print(f"COMMITTED {step} {loss!r}", flush=True)
    step += 1
    loss = train_step(model, opt, data.batch(step))
    print(f"TRAINED {step} {loss!r}", flush=True)
    state = full_state(model, opt)
    total = len(structure.flatten(state)[0])
    ucl.save(state, PausingStore(a.dir, step, max(1, total // 2), total), step=step)
    print("SAVE-RETURNED", flush=True)  # the parent should have killed us before this
    return 3


def _reader(stream: Any, q: queue.Queue[str | None]) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def _watch_child(d: Demo, proc: subprocess.Popen[str]) -> tuple[int, int, int] | None:
    """Follow the child's progress lines until it reaches the crash point: (step, written, total)."""
    out: queue.Queue[str | None] = queue.Queue()
    err: list[str] = []
    threading.Thread(target=_reader, args=(proc.stdout, out), daemon=True).start()
    threading.Thread(target=lambda: err.extend(proc.stderr or []), daemon=True).start()
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while True:
        try:
            line = out.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            line = None
        if line is None:  # the child ended (or hung) without reaching the crash point
            time.sleep(0.2)
            sys.stderr.write("".join(err[-40:]))
            return None
        word, *rest = line.split() or [""]
        if word == "RESUMED":
            print(f"  child pid {proc.pid}: resumed from step {rest[0]}")
        elif word == "COMMITTED":
            d.crash_losses[int(rest[0])] = float(rest[1])
            print(f"  child: step {rest[0]} trained and committed")
        elif word == "TRAINED":
            d.crash_losses[int(rest[0])] = float(rest[1])
            print(f"  child: step {rest[0]} trained, saving it...")
        elif word == "CRASH-POINT":
            return int(rest[0]), int(rest[1]), int(rest[2])


def act_crash(d: Demo) -> None:
    a = d.args
    cmd = [sys.executable, os.path.abspath(__file__), "--crash-child", "--dir", d.repo, "--preset", a.preset,
           "--seed", str(a.seed), "--threads", str(torch.get_num_threads()), "--batch", str(a.batch),
           "--crash-after", str(a.crash_after)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        crash = _watch_child(d, proc)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    if crash is None:
        d.check("child reached the crash point", False, f"exit status {proc.returncode}")
        return
    crashed, written, total = crash
    print(f"  SIGKILL while saving step {crashed}: {written} of {total} shard files written "
          f"({time.perf_counter() - t0:.1f} s after the child started)")
    d.check("child killed by SIGKILL", proc.returncode == -signal.SIGKILL, f"exit status {proc.returncode}")
    committed = crashed - 1
    latest = d.latest()
    d.check("ucl.open(repo) gives the latest committed step", latest == committed, f"step {latest}")
    step_dir = os.path.join(d.repo, "steps", str(crashed))
    n_files = sum(len(fs) for _, _, fs in os.walk(step_dir))
    has_record = os.path.exists(os.path.join(d.repo, "commits", f"{crashed}.json"))
    print(f"  on disk: steps/{crashed}/ holds {n_files} files; commits/{crashed}.json "
          f"{'exists' if has_record else 'does not exist'}")
    try:
        ucl.open(d.repo, step=crashed)
        d.check(f"partial step {crashed} is invisible", False, "ucl.open opened it")
    except CheckpointNotFoundError as e:
        d.check(f"partial step {crashed} is invisible",
                n_files > 0 and not has_record and crashed not in ucl.Repository.open(d.repo).steps(),
                f"ucl.open(repo, step={crashed}) -> {type(e).__name__} ({e.code})")
    d.crashed_step = crashed
    d.summary["crash"] = (f"SIGKILL mid-save of step {crashed} ({written}/{total} shard files written): "
                          f"latest = {latest}, step {crashed} invisible")


# -- act 3: resume and compare with the uninterrupted run ---------------------------------------
def act_resume(d: Demo) -> None:
    a = d.args
    assert d.data is not None
    end = d.latest() + 1 + a.resume_steps
    # the uninterrupted run goes on in memory, never reloaded
    for step in range(d.step + 1, end + 1):
        d.losses[step] = train_step(d.model, d.opt, d.data.batch(step))
    d.step = end
    if d.crash_losses:
        same = all(d.losses[s] == v for s, v in d.crash_losses.items())
        d.check("child's losses equal the uninterrupted run's (another process)", same,
                ", ".join(f"step {s}: {v!r}" for s, v in sorted(d.crash_losses.items())))
    # a different init: everything must come from the checkpoint
    model, opt = make_model_and_optimizer(a.preset, a.seed + 1)
    t0 = time.perf_counter()
    with ucl.open(d.repo) as ck:
        start = ck.step
        load_full_state(model, opt, ck.load())
    t_load = time.perf_counter() - t0
    print(f"  loaded step {start} into a fresh model and optimizer in {t_load:.3f} s")
    exact = True
    for step in range(start + 1, end + 1):
        loss = train_step(model, opt, d.data.batch(step))
        ucl.save(full_state(model, opt), d.repo, step=step)
        same = loss == d.losses[step]
        exact &= same
        d.check(f"step {step} loss after resume == uninterrupted", same,
                f"{loss!r} vs {d.losses[step]!r}" + (" (bit-exact)" if same else ""))
    ok, detail = states_bit_equal(full_state(model, opt), full_state(d.model, d.opt))
    d.check(f"state at step {end} after resume == uninterrupted", ok, detail)
    d.resumed = (model, opt)
    d.summary["resume"] = (f"from step {start} (load {t_load:.2f} s): steps {start + 1}..{end} losses and "
                           f"final state {'bit-exact' if exact and ok else 'DIFFER'} vs an uninterrupted run")


# -- act 4: read a slice lazily ------------------------------------------------------------------
def act_lazy_read(d: Demo) -> None:
    with ucl.open(d.repo) as ck:
        lt = ck[EMBEDDING]
        before = ck.bytes_read
        rows = lt[:8]
        read = ck.bytes_read - before
        inner = lt.meta.inner_chunk_shape
    print(f"  ucl.open(repo)[{EMBEDDING!r}][:8] at step {ck.step}: shape {list(rows.shape)}")
    print(f"  bytes read {fmt_bytes(read)} of {fmt_bytes(lt.nbytes)} ({100 * read / lt.nbytes:.1f}%); "
          f"inner chunks of {inner[0]} rows ({fmt_bytes(lt.nbytes * inner[0] / lt.shape[0])}) are the unit "
          "of reading")
    expected = full_state(*d.resumed)["model"]["embedding.word_embeddings.weight"][:8] if d.resumed else None
    if expected is not None:
        d.check("slice equals the model's rows", bit_equal(rows, expected), "bit-exact")
    row_bytes = lt.nbytes // max(1, lt.shape[0])
    needed = -(-8 // inner[0]) * inner[0] * row_bytes  # the inner chunks holding rows 0..7
    index = 16 * -(-lt.shape[0] // inner[0]) + 4  # the shard index (offset, length per inner chunk; crc32c)
    d.check("slice reads only the inner chunks it needs", read <= needed + index + 64,
            f"{read} bytes read: {needed} of chunk data + {read - needed} of shard index")
    d.summary["lazy read"] = (f"embedding[:8]: {fmt_bytes(read)} read of {fmt_bytes(lt.nbytes)} "
                              f"({100 * read / lt.nbytes:.1f}%)")


# -- act 5: validate -----------------------------------------------------------------------------
def act_validate(d: Demo) -> None:
    try:
        validate: Callable[..., Any] = ucl.validate
        t0 = time.perf_counter()
        report = validate(d.repo)
    except (ImportError, AttributeError) as e:
        print(f"  skipped: ucl.validate is not available yet ({type(e).__name__}: {e})")
        d.summary["validate"] = "skipped (ucl.validate not available)"
        return
    dt = time.perf_counter() - t0
    ok = report.ok if hasattr(report, "ok") else bool(report)
    problems = list(getattr(report, "problems", []))
    steps = getattr(report, "steps", None)
    checked = getattr(report, "bytes_checked", None)
    what = f"{len(steps)} steps" if steps is not None else "repository"
    if checked:
        what += f", {fmt_bytes(checked)} checksummed"
    for p in problems[:10]:
        print(f"  problem: {p}")
    d.check("ucl.validate(repo)", ok, f"{'valid' if ok else 'INVALID'} ({what}, {dt:.2f} s)")
    verdict = "valid" if ok else f"INVALID ({len(problems)} problems)"
    d.summary["validate"] = f"{verdict}: {what} in {dt:.2f} s"


# -- act 6: native readers -----------------------------------------------------------------------
TENSORSTORE_READER = r"""
import json, sys
import tensorstore as ts
a = ts.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": sys.argv[1]}}, read=True).result()
x = a.read().result()
ucl_modules = sorted(m for m in sys.modules if m == "ucl" or m.startswith("ucl."))
head = {"shape": list(x.shape), "dtype": str(x.dtype), "ucl_modules": ucl_modules}
sys.stdout.write(json.dumps(head) + "\n")
sys.stdout.flush()
sys.stdout.buffer.write(x.tobytes())
"""


def act_native(d: Demo) -> None:
    import numpy as np
    import zarr

    ck = ucl.open(d.repo)
    step = ck.step
    names_ = [EMBEDDING, "optim/state/0/exp_avg_sq"]
    names_ = [n for n in names_ if n in ck]
    expected = {n: ck[n].read() for n in names_}
    ck.close()
    step_path = os.path.join(d.repo, "steps", str(step))
    group = zarr.open_group(step_path, mode="r")
    for n in names_:
        arr = group[names.to_key(n)]
        assert isinstance(arr, zarr.Array)
        got = torch.from_numpy(np.ascontiguousarray(arr[...]))
        d.check(f"zarr-python reads {n}", bit_equal(got, expected[n]),
                f"{arr.shape} {arr.dtype}, bit-exact with ucl")
    n = names_[0]
    array_path = os.path.join(step_path, names.to_key(n))
    proc = subprocess.run([sys.executable, "-c", TENSORSTORE_READER, array_path],
                          capture_output=True, timeout=CHILD_TIMEOUT_S)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr.decode(errors="replace")[-4000:])
        d.check(f"tensorstore reads {n}", False, f"exit status {proc.returncode}")
        return
    head, _, raw = proc.stdout.partition(b"\n")
    info = json.loads(head)
    got = torch.frombuffer(bytearray(raw), dtype=expected[n].dtype).reshape(info["shape"])
    d.check(f"tensorstore (zarr3 driver) reads {n}", bit_equal(got, expected[n]) and not info["ucl_modules"],
            f"{info['shape']} {info['dtype']}, bit-exact, in a process with no ucl module loaded")
    d.summary["native"] = (f"step {step} read bit-exactly by zarr-python {zarr.__version__} and "
                           "tensorstore (zarr3 driver)")


# -- act 7: mount a step as a zarr store ---------------------------------------------------------
def act_zarr(d: Demo) -> None:
    import numpy as np
    import zarr

    repo = ucl.Repository.open(d.repo)
    delta_steps = [s for s in repo.steps() if repo.commit_record(s).kind == "delta"]
    step = delta_steps[-1] if delta_steps else repo.steps()[-1]
    store = ucl.zarr_store(d.repo, step)
    group = zarr.open_group(store=store, mode="r")
    with ucl.open(d.repo, step) as ck:
        name = EMBEDDING
        want = ck[name][:16]
        kind = ck.kind
    got = torch.from_numpy(np.ascontiguousarray(group[name][:16]))
    d.check(f"zarr.open_group(store=ucl.zarr_store(repo, {step})) reads {name}[:16]", bit_equal(got, want),
            f"step {step} is a {kind} step: its chain resolved by the store, bit-exact")
    n_arrays = sum(1 for _ in group.arrays()) + sum(1 for _, g in group.groups() for _ in g.arrays())
    d.summary["zarr"] = f"step {step} ({kind}) mounted as a read-only zarr store: {n_arrays}+ arrays, bit-exact"


# -- act 8: reshard: save as TP=2 x PP=2, load as TP=4 and as one process --------------------------
def act_reshard(d: Demo) -> None:
    from ucl.layout import Mesh, parse_layout
    from ucl.testing.gpt import layout_text, logical_state
    from ucl.testing.layout_reference import shard_local_state
    from ucl.write.save import save_sharded

    assert d.data is not None
    model, opt = d.resumed if d.resumed is not None else (d.model, d.opt)
    c = model.config
    logical = logical_state(model, opt)
    src, dst = Mesh.of(pp=2, dp=1, tp=2), Mesh.of(pp=1, dp=1, tp=4)
    layout = parse_layout(layout_text(c, tp=2, pp=2))
    repo = os.path.join(d.root, "resharded")
    ranks = [shard_local_state(logical, layout, src, r) for r in range(src.size)]
    t0 = time.perf_counter()
    save_sharded(ranks, repo, d.step, layout=layout, mesh=src)
    t_save = time.perf_counter() - t0
    print(f"  saved step {d.step} as the 4 ranks of {src.to_text()} hold it (fused QKV split per rank, vocab "
          f"padded, layers renumbered per stage) in {t_save:.2f} s")
    target = parse_layout(layout_text(c, tp=4))
    ok = True
    t0 = time.perf_counter()
    for r in range(dst.size):
        mine = ucl.load(repo, layout=target, mesh=dst, rank=r, flat=True)
        want = shard_local_state(logical, target, dst, r)
        ok &= sorted(mine) == sorted(want) and all(bit_equal(mine[n], want[n]) for n in want)
    t_load = time.perf_counter() - t0
    d.check(f"loaded as {dst.to_text()}: every rank's shards bit-exact", ok, f"4 ranks in {t_load:.2f} s")
    flat = ucl.load(repo, flat=True)  # one process, the logical tensors
    same = sorted(flat) == sorted(logical) and all(bit_equal(flat[n], logical[n]) for n in logical)
    d.check("loaded in one process: every logical tensor bit-exact", same, f"{len(logical)} tensors")
    resumed, resumed_opt = make_model_and_optimizer(c, d.args.seed + 2)
    step_count = next(iter(opt.state.values()))["step"].clone()
    with torch.no_grad():
        for name, p in resumed.named_parameters():
            p.copy_(flat[f"model/{name}"])
            resumed_opt.state[p] = {"step": step_count.clone(),
                                    "exp_avg": flat[f"optim/state/model/{name}/exp_avg"].clone(),
                                    "exp_avg_sq": flat[f"optim/state/model/{name}/exp_avg_sq"].clone()}
    nxt = d.step + 1
    a = train_step(resumed, resumed_opt, d.data.batch(nxt))
    b = train_step(model, opt, d.data.batch(nxt))
    d.check(f"step {nxt} after the reshard == without it", a == b, f"loss {a!r} vs {b!r} (bit-exact)")
    d.summary["reshard"] = (f"saved as {src.to_text()}, loaded as {dst.to_text()} and as one process, "
                            f"bit-exact; next-step loss identical")


# The acts, in order. Later issues add theirs (engine saves with CheckpointManager, resharding, deltas,
# zarr mount): a function taking the Demo, printing its lines, calling d.check(...) for each claim and
# adding a line to d.summary. An act that raises stops the demo (exit 1).
ACTS: list[tuple[str, Callable[[Demo], None]]] = [
    ("train", act_train),
    ("crash", act_crash),
    ("resume", act_resume),
    ("lazy_read", act_lazy_read),
    ("validate", act_validate),
    ("native", act_native),
    ("zarr", act_zarr),
    ("reshard", act_reshard),
]


# -- driver --------------------------------------------------------------------------------------
class UsageError(Exception):
    pass


def prepare_dir(root: str) -> None:
    """Make ``root`` a fresh, empty demo directory; replace it only if it is a previous demo output."""
    if os.path.exists(root):
        if not os.path.isdir(root):
            raise UsageError(f"{root} exists and is not a directory")
        if os.listdir(root) and not os.path.exists(os.path.join(root, MARKER)):
            raise UsageError(f"{root} is not empty and not a previous demo output; choose another --dir")
        shutil.rmtree(root)
    os.makedirs(root)
    with open(os.path.join(root, MARKER), "w") as f:
        f.write("written by python examples/demo.py; removed and rewritten by the next run\n")


def print_summary(d: Demo, elapsed: float) -> None:
    med = statistics.median
    rows = dict(d.summary)
    if d.train_times and d.save_times:
        tr, sv = med(d.train_times), med(d.save_times)
        steps = ucl.Repository.open(d.repo).steps()
        rows = {
            "model": rows.pop("model", ""),
            "steps": f"{len(steps)} kept ({steps[0]}..{steps[-1]}) in {d.repo}",
            "time": f"train step {tr * 1e3:.0f} ms, save blocks {sv * 1e3:.1f} ms (medians)",
            **rows,
        }
    failed = [c for c in d.checks if not c.ok]
    rows["checks"] = f"{len(d.checks) - len(failed)} passed, {len(failed)} failed"
    rows["total"] = f"{elapsed:.1f} s"
    print("\nsummary")
    width = max(map(len, rows))
    for k, v in rows.items():
        print(f"  {k:<{width}}  {v}")
    for c in failed:
        print(f"  FAILED: {c.name}: {c.detail}")
    print("DEMO OK" if not failed else "DEMO FAILED")
    used = sum(os.path.getsize(os.path.join(dp, f)) for dp, _, fs in os.walk(d.root) for f in fs
               if not os.path.islink(os.path.join(dp, f)))
    rel = os.path.relpath(d.repo)
    print(f"\n{used / 1e6:.1f} MB on disk under {os.path.relpath(d.root)}. Try next:")
    cmds = [f"ucl ls {rel}", f"ucl info {rel}", f"ucl validate {rel}"]
    steps = ucl.Repository.open(d.repo).steps() if os.path.isdir(d.repo) else []
    if len(steps) > 1:
        cmds.append(f"ucl diff {rel}@{steps[0]} @{steps[-1]}")
    for cmd in cmds:
        print(f"  .venv/bin/{cmd}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="examples/demo.py", description=__doc__.split("\n")[0])
    p.add_argument("--dir", default="demo-out", help="fresh output directory (default ./demo-out; a previous "
                                                     "demo output there is replaced)")
    p.add_argument("--steps", type=int, default=25,
                   help="steps trained before the crash (default 25: 30 with the child's and resumed ones)")
    p.add_argument("--preset", default="small", choices=["tiny", "small", "medium"],
                   help="model size (default small; tiny runs in seconds)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's, at most 4)")
    p.add_argument("--crash-after", type=int, default=2, help="steps the child commits before it is killed")
    p.add_argument("--resume-steps", type=int, default=2, help="steps trained after the crashed one")
    p.add_argument("--batch", type=int, default=16, help="sequences per step (default 16)")
    p.add_argument("--full-every", type=int, default=10, help="a full step every N saves, deltas between")
    p.add_argument("--keep-last", type=int, default=4, help="retention: keep the newest N steps")
    p.add_argument("--gradient-records", action=argparse.BooleanOptionalAction, default=True,
                   help="store a save one optimizer step after the previous as its gradients (spec/delta.md §8)")
    p.add_argument("--crash-child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps < 2 or a.crash_after < 0 or a.resume_steps < 0 or a.full_every < 1 or a.keep_last < 1:
        p.error("--steps must be >= 2; --crash-after and --resume-steps >= 0; --full-every, --keep-last >= 1")
    get_config(a.preset)
    return a


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    torch.set_num_threads(a.threads or min(4, torch.get_num_threads()))
    if a.crash_child:
        return crash_child(a)
    root = os.path.abspath(a.dir)
    try:
        prepare_dir(root)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    d = Demo(args=a, root=root, repo=os.path.join(root, "ckpt"))
    print(f"ucl {ucl.__version__} demo: checkpoints in {d.repo}")
    t0 = time.perf_counter()
    for i, (name, act) in enumerate(ACTS, 1):
        print(f"\n[{i}/{len(ACTS)}] {name}", flush=True)
        try:
            act(d)
        except Exception as e:  # a broken act: say where, and stop
            traceback.print_exc()
            d.check(f"act {name} ran", False, f"{type(e).__name__}: {e}")
            break
    print_summary(d, time.perf_counter() - t0)
    return 0 if all(c.ok for c in d.checks) else 1


if __name__ == "__main__":
    sys.exit(main())
