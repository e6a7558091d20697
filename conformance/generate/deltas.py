"""``cases/deltas.json``: delta steps, their payloads and their chains (spec/delta.md §3-§7).

Valid fixtures (read cases: the sha256 of the *original* tensors, whole and sliced):

- ``valid/delta_chain``: written by the engine (``CheckpointManager`` with ``DeltaPolicy(base="previous")``):
  a full step and three delta steps, each the parent of the next (chain length 3). float32 weights and
  first moments (``xor``), a second moment and an int64 counter (``sub``), bfloat16 and bool tensors, a
  frozen tensor (``unchanged``), and a tensor replaced by new values (mode-0 payloads).
- ``valid/delta_sharded``: written shard by shard (``StepWriter`` and ``ucl.delta.shardfile``) with chosen
  chunk grids: several shards and inner chunks, clipped edge chunks, absent inner chunks and absent shard
  files, every payload mode, complex128 (two words per element) and float8 words, a base step older than
  the parent, an ``unchanged`` array whose base is itself a delta, and an array stored full in a delta step.

Invalid fixtures ``invalid/delta/<what_is_wrong>``: copies of one small chain with one defect each; semantic
defects are resealed (every size, crc32c and checksum recomputed) so only the lie is left.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ucl.delta.shardfile import encode_delta_shard
from ucl.format.metadata import ArrayMeta, StepMeta
from ucl.format.records import choose_encoding
from ucl.format.repository import Repository
from ucl.format.shardfile import shard_digest
from ucl.plan.save import all_shards, array_for, shard_block
from ucl.write.manager import CheckpointManager
from ucl.write.policy import DeltaPolicy
from ucl.write.step import StepWriter

from .fixture import V1, Fx, random_tensor
from .suite import Cases

S_RECORD = "delta.md §3.2 The array's delta record"
S_STEP = "delta.md §3.1 Step document and commit record"
S_CODEC = "delta.md §3.3 The `ucl.delta` codec"
S_SHARDS = "delta.md §4 Shards of a chunked array"
S_PAYLOAD = "delta.md §5.2 Layout"
S_RECON = "delta.md §6.1 Reconstruction"
S_LIMIT = "delta.md §6.2 Length limit"
S_READING = "delta.md §6.3 Reading"
S_VALID = "delta.md §7 Validation"
S_ORDER = "delta.md §7.1 Error precedence"

# ucl's validator decodes every payload of a step and of the bases it uses (§7 checks 6-7) once
# ucl/tools/validate.py and validate_chain.py call ucl.delta.codec.check_payload; until then the validate
# cases that need it are left out (True: declare them, and regenerate).
VALIDATOR_DECODES_PAYLOADS = True


# -- writing delta steps shard by shard ------------------------------------------------------------------
Entry = tuple[ArrayMeta, torch.Tensor, "torch.Tensor | None"]


def delta_meta(name: str, t: torch.Tensor, chunk: tuple[int, ...], inner: tuple[int, ...],
               record: dict[str, Any] | None) -> ArrayMeta:
    return dataclasses.replace(array_for(name, t, chunk_shape=chunk), inner_chunk_shape=inner, delta=record)


def write_step(f: Fx, step: int, parent: int | None, arrays: list[Entry]) -> None:
    """A step of arrays with chosen grids: stored full (no record), ``unchanged`` (no data) or ``chunked``
    (each shard encoded against the base tensor; a shard whose inner chunks all equal the base's is not
    written). Its kind is ``delta`` when ``parent`` is given."""
    repo = Repository.open(f.path, create=True)
    w = StepWriter(repo, step, format_version=1)
    w.begin()
    files = {}
    for meta, t, base in arrays:
        rec = meta.delta
        if rec is not None and rec["mode"] == "unchanged":
            continue
        for coords in all_shards(meta):
            block = shard_block(meta, coords, t)
            if rec is None:
                rel, entry = w.write_shard(meta, coords, block)
                files[rel] = entry
                continue
            assert base is not None
            bufs = encode_delta_shard(meta, coords, block, shard_block(meta, coords, base), rec["encoding"])
            if bufs is None:
                continue
            rel = meta.shard_key(coords)
            size, _ = repo.store.write(f"{w.prefix}/{rel}", bufs)
            files[rel] = (size, shard_digest(bufs))
    tree = {"t": "dict", "items": [[m.name, {"t": "tensor", "name": m.name}] for m, _, _ in arrays]}
    kind = "full" if parent is None else "delta"
    w.commit(StepMeta(step=step, kind=kind, tree=tree, arrays={m.name: m for m, _, _ in arrays}, parent=parent),
             files)
    f.fix_time(step)
    compact(f, step)


def compact(f: Fx, step: int) -> None:
    """Rewrite the step's documents and commit record as compact JSON (the same documents once parsed),
    resealed: fixtures stay small."""
    rels = sorted(p.relative_to(f.p(f"steps/{step}")).as_posix() for p in f.p(f"steps/{step}").rglob("zarr.json"))
    for rel in rels:
        f.put(f"steps/{step}/{rel}", json.dumps(f.read_json(f"steps/{step}/{rel}"), separators=(",", ":")).encode())
    f.reseal(step, *rels)
    doc = f.commit_doc(step)
    f.put(f"commits/{step}.json", json.dumps(doc, separators=(",", ":")).encode())


def chunk_records(f: Fx, step: int, key: str) -> list[tuple[int, int]]:
    """(offset, nbytes) of the present inner chunks of a shard (index order)."""
    rel = f"steps/{step}/{key}"
    doc = f.read_json(f"steps/{step}/{key.split('/c')[0]}/zarr.json")
    cfg = doc["codecs"][0]["configuration"]
    n = 1
    for o, i in zip(doc["chunk_grid"]["configuration"]["chunk_shape"], cfg["chunk_shape"], strict=True):
        n *= o // i
    return [(o, b) for o, b in f.shard_index(rel, n) if o != (1 << 64) - 1]


def edit_payload(f: Fx, step: int, key: str, fn: Callable[[bytes], bytes], which: int = 0) -> None:
    """Replace the payload of the ``which``-th present inner chunk of a shard by ``fn(payload)``, its crc32c
    recomputed, the index and the commit record resealed."""
    rel = f"steps/{step}/{key}"
    data = f.read(rel)
    doc = f.read_json(f"steps/{step}/{key.split('/c')[0]}/zarr.json")
    cfg = doc["codecs"][0]["configuration"]
    n = 1
    for o, i in zip(doc["chunk_grid"]["configuration"]["chunk_shape"], cfg["chunk_shape"], strict=True):
        n *= o // i
    index = f.shard_index(rel, n)
    chunks: list[bytes | None] = []
    present = 0
    for off, nb in index:
        if off == (1 << 64) - 1:
            chunks.append(None)
            continue
        payload = data[off : off + nb - 4]
        chunks.append(fn(payload) if present == which else payload)
        present += 1
    f.put_shard(step, key, chunks)


# -- valid fixtures ---------------------------------------------------------------------------------------
def engine_chain(root: Path, cases: Cases) -> None:
    fx = "valid/delta_chain"
    f = Fx(root, fx)
    g = torch.Generator().manual_seed(2100)
    state: dict[str, torch.Tensor] = {
        "model/w": torch.randint(-512, 512, (24, 8), generator=g).to(torch.float32) / 256,
        "model/frozen": random_tensor((6, 5), torch.float32, 2101),
        "optim/state/0/exp_avg_sq": torch.randint(1, 1 << 12, (24, 8), generator=g).to(torch.float32) / 4096,
        "noise": random_tensor((16,), torch.float32, 2102),
    }
    ref: dict[int, dict[str, torch.Tensor]] = {}
    with CheckpointManager(f.path, delta=DeltaPolicy(base="previous", full_every=None), options=V1) as mgr:
        for s in range(1, 5):
            ref[s] = {k: v.clone() for k, v in state.items()}
            mgr.save(s, state)
            mgr.wait()
            state = {k: v.clone() for k, v in state.items()}
            state["model/w"][3 * s : 3 * s + 2] += 1 / 64  # a few rows change
            state["optim/state/0/exp_avg_sq"] *= 1 + 1 / 128
            # step 2: all new values, smaller stored full (mode 0) than as a difference to random bits
            state["noise"] = torch.zeros(16) if s == 1 else random_tensor((16,), torch.float32, 2110 + s)
    (f.path / ".ucl-writer.lock").unlink(missing_ok=True)
    for s in ref:
        f.fix_time(s)
        compact(f, s)
    # what the engine wrote is what the cases describe
    for s in (2, 3, 4):
        attrs = f.read_json(f"steps/{s}/zarr.json")["attributes"]["ucl"]
        assert attrs["kind"] == "delta" and attrs["parent"] == s - 1, attrs
        rec = f.read_json(f"steps/{s}/model/frozen/zarr.json")["attributes"]["ucl"]["delta"]
        assert rec == {"mode": "unchanged", "base_step": s - 1}, rec
        rec = f.read_json(f"steps/{s}/optim/state/0/exp_avg_sq/zarr.json")["attributes"]["ucl"]["delta"]
        assert rec["encoding"] == "sub", rec
    assert f.read("steps/2/noise/c/0")[0] == 0  # mode 0: full values
    cases.valid("a full step and a chain of three delta steps validate", S_VALID, fx, "validate")
    for s in (1, 2, 3, 4):
        cases.valid(f"step {s} validates on its own (with the steps its chain needs)", S_VALID, fx, "validate",
                    {"step": s})
    cases.valid("delta steps are steps", "delta.md §3.1 Step document and commit record", fx, "list_steps",
                steps=[1, 2, 3, 4])
    cases.valid("the latest step is the newest delta step", S_RECON, fx, "open", step=4, keys=sorted(state))
    for s in (2, 4):
        cases.reads(S_RECON, fx, ref[s], step=s,
                    boxes={"model/w": [[[4, 12], [3, 7]]], "noise": [[[5, 6]]]},
                    what=lambda n, s=s: f", step {s}: {s - 1} delta link(s) of {_kind(n)}")
    cases.reads(S_RECON, fx, {k: ref[3][k] for k in ("model/w", "model/frozen")}, step=3,
                what=lambda n: f", step 3: {_kind(n)}")


def _kind(name: str) -> str:
    return {"model/frozen": "an unchanged tensor (no data)", "noise": "mode-0 payloads (full values)",
            "optim/state/0/exp_avg_sq": "sub payloads"}.get(name, "xor payloads")


def sharded_chain(root: Path, cases: Cases) -> None:
    fx = "valid/delta_sharded"
    f = Fx(root, fx)
    # name, shape, dtype, chunk (one writer's block), inner chunk
    specs = [
        ("w", (10, 7), torch.float32, (4, 3), (2, 3)),  # 3x3 shards, clipped edges, an edge inner chunk absent
        ("v", (9,), torch.bfloat16, (4,), (2,)),
        ("m", (5, 4, 3), torch.bool, (2, 4, 2), (1, 2, 2)),
        ("i", (6, 6), torch.int64, (3, 3), (3, 3)),
        ("f8", (7, 5), torch.float8_e5m2, (7, 2), (1, 2)),
        ("c", (3, 4), torch.complex128, (2, 4), (1, 4)),
    ]
    t1 = {n: random_tensor(shape, dt, 2200 + k) for k, (n, shape, dt, _, _) in enumerate(specs)}
    grid = {n: (chunk, inner) for n, _, _, chunk, inner in specs}

    def meta(name: str, t: torch.Tensor, record: dict[str, Any] | None) -> ArrayMeta:
        return delta_meta(name, t, *grid[name], record)

    write_step(f, 1, None, [(meta(n, t, None), t, None) for n, t in t1.items()])
    # step 2, parent 1: a few elements change
    t2 = {n: t.clone() for n, t in t1.items()}
    t2["w"][0, 0] = t2["w"][0, 0] + 1  # shard (0, 0) only
    t2["w"][9, 6] = -t2["w"][9, 6]  # the clipped corner shard (2, 2)
    t2["v"][4:6] = torch.tensor([1.5, -2.25], dtype=torch.bfloat16)
    t2["m"][4] = ~t2["m"][4]
    t2["i"] += 1  # every chunk: sub, +1
    t2["c"][1, 2] = complex(0.5, -0.25)
    enc = {n: choose_encoding(n, str(t.dtype).removeprefix("torch.")) for n, t in t1.items()}
    enc["v"] = "sub"  # the writer's choice (recorded)
    write_step(f, 2, 1, [
        (meta("w", t2["w"], {"mode": "chunked", "base_step": 1, "encoding": "xor"}), t2["w"], t1["w"]),
        (meta("v", t2["v"], {"mode": "chunked", "base_step": 1, "encoding": "sub"}), t2["v"], t1["v"]),
        (meta("m", t2["m"], {"mode": "chunked", "base_step": 1, "encoding": "xor"}), t2["m"], t1["m"]),
        (meta("i", t2["i"], {"mode": "chunked", "base_step": 1, "encoding": "sub"}), t2["i"], t1["i"]),
        (meta("f8", t2["f8"], {"mode": "unchanged", "base_step": 1}), t2["f8"], None),
        (meta("c", t2["c"], {"mode": "chunked", "base_step": 1, "encoding": "xor"}), t2["c"], t1["c"]),
    ])
    # step 3, parent 2: w encoded against step 1 (an older ancestor), v new values (mode 0), i unchanged
    # against 2 (itself a delta), m stored full in a delta step, f8 unchanged against 1, c against 2
    t3 = {n: t.clone() for n, t in t2.items()}
    t3["w"][5, 1] = 3.0
    t3["v"] = torch.full((9,), 1.0, dtype=torch.bfloat16)  # smaller stored full than as a difference
    t3["m"] = random_tensor((5, 4, 3), torch.bool, 2231)
    t3["c"][2] = t3["c"][2] * 2
    write_step(f, 3, 2, [
        (meta("w", t3["w"], {"mode": "chunked", "base_step": 1, "encoding": "xor"}), t3["w"], t1["w"]),
        (meta("v", t3["v"], {"mode": "chunked", "base_step": 2, "encoding": "sub"}), t3["v"], t2["v"]),
        (meta("m", t3["m"], None), t3["m"], None),
        (meta("i", t3["i"], {"mode": "unchanged", "base_step": 2}), t3["i"], None),
        (meta("f8", t3["f8"], {"mode": "unchanged", "base_step": 1}), t3["f8"], None),
        (meta("c", t3["c"], {"mode": "chunked", "base_step": 2, "encoding": "xor"}), t3["c"], t2["c"]),
    ])
    files2 = f.commit_doc(2)["files"]
    assert "w/c/0/0" in files2 and "w/c/2/2" in files2 and "w/c/1/1" not in files2, sorted(files2)
    assert {f.read(f"steps/3/v/c/{k}")[0] for k in range(3)} == {0, 2}, "v: mode 0 and mode 2 payloads"
    if VALIDATOR_DECODES_PAYLOADS:  # complex128 payloads: two words per element
        cases.valid("a chain of delta steps with several shards per array validates", S_VALID, fx, "validate")
    cases.valid("the full step validates", S_VALID, fx, "validate", {"step": 1})
    cases.valid("every step is listed", S_STEP, fx, "list_steps", steps=[1, 2, 3])
    boxes = {"w": [[[1, 9], [2, 6]], [[9, 10], [6, 7]]], "v": [[[3, 7]]], "m": [[[3, 5], [1, 3], [0, 3]]],
             "i": [[[2, 4], [0, 6]]], "f8": [[[0, 7], [1, 3]]], "c": [[[1, 3], [1, 3]]]}
    cases.reads(S_RECON, fx, t2, step=2, boxes=boxes, what=lambda n: ", step 2 (one delta link)")
    what3 = {"w": ", step 3: encoded against step 1, an ancestor older than the parent",
             "v": ", step 3: mode-0 payloads (older links not needed) and mode-2 ones",
             "m": ", step 3: stored full in a delta step",
             "i": ", step 3: unchanged against step 2, itself a delta of step 1",
             "f8": ", step 3: unchanged against step 1",
             "c": ", step 3: two delta links (complex128: two words per element)"}
    cases.reads(S_RECON, fx, t3, step=3, boxes=boxes, what=lambda n: what3[n])


# -- invalid fixtures ---------------------------------------------------------------------------------------
def tiny_chain(root: Path, rel: str, steps: int = 2,
               names: tuple[str, ...] = ("w",)) -> tuple[Fx, dict[int, dict[str, torch.Tensor]]]:
    """Step 1 full; steps 2.. delta, each the parent of the next: of ``w`` (float32 [4, 6], two inner
    chunks, xor), ``n`` (int64, sub) and ``s`` (0-d, unchanged), those in ``names``."""
    f = Fx(root, rel)
    every = {"w": random_tensor((4, 6), torch.float32, 2300), "n": torch.arange(8, dtype=torch.int64),
             "s": torch.tensor(0.5, dtype=torch.float32)}
    cur = {k: every[k] for k in names}
    grid = {"w": ((4, 6), (2, 6)), "n": ((8,), (8,)), "s": ((), ())}
    enc = {"w": "xor", "n": "sub"}
    ref = {1: cur}
    write_step(f, 1, None, [(delta_meta(n, t, *grid[n], None), t, None) for n, t in cur.items()])
    for s in range(2, steps + 1):
        nxt = {k: v.clone() for k, v in cur.items()}
        if "w" in nxt:
            nxt["w"][s % 4, :3] += 1
        if "n" in nxt:
            nxt["n"] += s
        entries: list[Entry] = []
        for n, t in nxt.items():
            rec = ({"mode": "unchanged", "base_step": s - 1} if n == "s"
                   else {"mode": "chunked", "base_step": s - 1, "encoding": enc[n]})
            entries.append((delta_meta(n, t, *grid[n], rec), t, cur[n]))
        write_step(f, s, s - 1, entries)
        ref[s], cur = nxt, nxt
    return f, ref


def drop_step(f: Fx, step: int, files: bool = True) -> None:
    f.p(f"commits/{step}.json").unlink()
    if files:
        shutil.rmtree(f.p(f"steps/{step}"))


def edit_record(f: Fx, step: int, name: str, fn: Callable[[dict[str, Any]], Any], codec: bool = True) -> None:
    """Edit an array's delta record (and, with ``codec``, the same change in its ucl.delta codec), resealed."""

    def upd(d: dict[str, Any]) -> None:
        fn(d["attributes"]["ucl"]["delta"])
        if codec:
            fn(d["codecs"][0]["configuration"]["codecs"][0]["configuration"])

    f.edit_array(step, name, upd)


def set_parent(f: Fx, step: int, parent: int | None, commit: bool = True) -> None:
    f.edit_step_doc(step, lambda d: d["attributes"]["ucl"].update(parent=parent))
    if commit:
        f.edit_commit(step, lambda d: d.update(parent=parent))


def chain_defects(root: Path, cases: Cases) -> None:
    fx = "invalid/delta/parent_missing"
    f, ref = tiny_chain(root, fx, steps=3)
    drop_step(f, 1)
    cases.invalid("step 1, the full base of the chain, was deleted", S_VALID, fx, "broken_chain", {"step": 2})
    cases.invalid("the parent's parent is missing", S_VALID, fx, "broken_chain", {"step": 3})
    cases.error("reading a tensor of a delta step whose parent is missing", S_VALID, fx, "read", "broken_chain",
                {"tensor": "w", "step": 2})
    cases.error("reading a tensor whose chain is missing its full base", S_VALID, fx, "read", "broken_chain",
                {"tensor": "w", "step": 3})

    fx = "invalid/delta/parent_not_committed"
    f, ref = tiny_chain(root, fx)
    drop_step(f, 1, files=False)
    cases.invalid("the parent's files exist but its commit record does not", S_VALID, fx, "broken_chain",
                  {"step": 2})
    cases.error("reading through an uncommitted parent", S_VALID, fx, "read", "broken_chain",
                {"tensor": "w", "step": 2})

    fx = "invalid/delta/parent_not_older"
    f, ref = tiny_chain(root, fx, steps=3)
    set_parent(f, 2, 3)  # 2 -> 3 -> 2: a cycle, caught as a parent that is not older
    cases.invalid("step 2 names step 3 as its parent (parents are older)", S_STEP, fx, "broken_chain",
                  {"step": 2})
    cases.invalid("the chain of step 3 cycles through step 2", S_VALID, fx, "broken_chain", {"step": 3})
    cases.error("reading a step whose chain cycles", S_VALID, fx, "read", "broken_chain", {"tensor": "w", "step": 3})

    fx = "invalid/delta/commit_parent_differs"
    f, ref = tiny_chain(root, fx)
    x = torch.tensor(1.0)
    write_step(f, 0, None, [(delta_meta("x", x, (), (), None), x, None)])
    f.edit_commit(2, lambda d: d.update(parent=0))
    cases.invalid("the commit record names parent 0, the step document parent 1", S_STEP, fx,
                  "inconsistent_metadata", {"step": 2})
    cases.error("opening a step whose commit record and step document disagree on the parent", S_STEP, fx,
                "open", "inconsistent_metadata", {"step": 2})

    long_chain(root, cases)


def long_chain(root: Path, cases: Cases) -> None:
    """Step 0 full; steps 1-65 delta, each the parent of the next. Steps 1-63 hold no tensor (a delta step
    need not: tensors are not inherited); step 64 (chain length 64, the limit) and step 65 (65) hold
    ``x``, unchanged against step 0 and chunked against step 64."""
    fx = "invalid/delta/chain_too_long"
    f = Fx(root, fx)
    x0 = torch.arange(6, dtype=torch.int16)
    x65 = x0 + 1
    write_step(f, 0, None, [(delta_meta("x", x0, (6,), (6,), None), x0, None)])
    for s in range(1, 64):
        write_step(f, s, s - 1, [])
    write_step(f, 64, 63, [(delta_meta("x", x0, (6,), (6,), {"mode": "unchanged", "base_step": 0}), x0, None)])
    write_step(f, 65, 64, [(delta_meta("x", x65, (6,), (6,), {"mode": "chunked", "base_step": 64,
                                                               "encoding": "sub"}), x65, x0)])
    cases.valid("a chain of 64 delta steps (the limit every reader accepts) validates", S_LIMIT, fx, "validate",
                {"step": 64})
    cases.reads(S_LIMIT, fx, {"x": x0}, step=64, what=lambda n: ", step 64: a chain of 64 delta steps")
    cases.invalid("a chain of 65 delta steps", S_LIMIT, fx, "broken_chain", {"step": 65})
    cases.error("reading a step whose chain has 65 delta steps", S_LIMIT, fx, "read", "broken_chain",
                {"tensor": "x", "step": 65})


def record_defects(root: Path, cases: Cases) -> None:
    def both(fx: str, code: str, what: str, section: str, tensor: str = "w", step: int = 2) -> None:
        cases.invalid(what, section, fx, code, {"step": step})
        cases.error(f"reading {tensor!r}: {what}", section, fx, "read", code, {"tensor": tensor, "step": step})

    fx = "invalid/delta/base_step_not_in_chain"
    f, ref = tiny_chain(root, fx)
    write_step(f, 0, None, [(delta_meta("w", ref[1]["w"], (4, 6), (2, 6), None), ref[1]["w"], None)])
    edit_record(f, 2, "w", lambda r: r.update(base_step=0))
    both(fx, "broken_chain", "'w' is encoded against step 0, which is not in the step's chain", S_RECORD)

    fx = "invalid/delta/base_step_is_itself"
    f, ref = tiny_chain(root, fx)
    edit_record(f, 2, "w", lambda r: r.update(base_step=2))
    both(fx, "broken_chain", "'w' names its own step as its base", S_RECORD)

    fx = "invalid/delta/base_tensor_missing"
    f = Fx(root, fx)
    w1 = random_tensor((4, 6), torch.float32, 2310)
    n2 = torch.arange(8, dtype=torch.int64)
    write_step(f, 1, None, [(delta_meta("w", w1, (4, 6), (2, 6), None), w1, None)])
    write_step(f, 2, 1, [
        (delta_meta("w", w1, (4, 6), (2, 6), {"mode": "unchanged", "base_step": 1}), w1, None),
        (delta_meta("n", n2, (8,), (8,), {"mode": "chunked", "base_step": 1, "encoding": "sub"}), n2,
         torch.zeros(8, dtype=torch.int64)),
    ])
    both(fx, "broken_chain", "'n' is a delta of step 1, which has no tensor 'n'", S_RECORD, tensor="n")
    cases.reads(S_RECON, fx, {"w": w1}, step=2, what=lambda n: ": an unchanged tensor the defect does not reach")

    fx = "invalid/delta/base_dtype_differs"
    f, ref = tiny_chain(root, fx)
    f.edit_array(2, "w", lambda d: d.update(data_type="int32", fill_value=0))
    both(fx, "broken_chain", "'w' is int32 in the delta step and float32 in its base", S_RECORD)

    fx = "invalid/delta/base_inner_chunks_differ"
    f, ref = tiny_chain(root, fx)
    f.edit_array(2, "w", lambda d: d["codecs"][0]["configuration"].update(chunk_shape=[1, 6]))
    both(fx, "broken_chain", "'w' has inner chunks of [1, 6] in the delta step, [2, 6] in its base", S_RECORD)

    fx = "invalid/delta/record_unknown_mode"
    f, ref = tiny_chain(root, fx)
    edit_record(f, 2, "w", lambda r: r.update(mode="sparse"), codec=False)
    cases.invalid("a delta record whose mode is 'sparse'", S_RECORD, fx, "schema_violation", {"step": 2})
    cases.error("opening a step with an unknown delta record mode", S_RECORD, fx, "open", "schema_violation",
                {"step": 2})

    fx = "invalid/delta/record_unknown_field"
    f, ref = tiny_chain(root, fx)
    edit_record(f, 2, "w", lambda r: r.update(level=3), codec=False)
    cases.invalid("a delta record with an unknown field", S_RECORD, fx, "schema_violation", {"step": 2})

    fx = "invalid/delta/codec_disagrees_with_record"
    f, ref = tiny_chain(root, fx)
    f.edit_array(2, "w", lambda d: d["codecs"][0]["configuration"]["codecs"][0]["configuration"].update(
        encoding="sub"))
    cases.invalid("the ucl.delta codec says sub, the record xor", S_CODEC, fx, "inconsistent_metadata",
                  {"step": 2})
    cases.error("opening it", S_CODEC, fx, "open", "inconsistent_metadata", {"step": 2})

    fx = "invalid/delta/delta_codec_without_record"
    f, ref = tiny_chain(root, fx)
    f.edit_array(2, "w", lambda d: d["attributes"]["ucl"].pop("delta"))
    cases.invalid("an array with the ucl.delta codec and no delta record", S_CODEC, fx, "unknown_extension",
                  {"step": 2})


def payload_defects(root: Path, cases: Cases) -> None:
    def payload_case(fx: str, what: str, tensor: str = "w", code: str = "integrity_error",
                     deps: bool = False) -> None:
        cases.valid("the full step validates", S_VALID, fx, "validate", {"step": 1})
        if VALIDATOR_DECODES_PAYLOADS:
            cases.invalid(f"{what}, its crc32c resealed", S_PAYLOAD, fx, code, {"step": 2})
        cases.error(f"reading {tensor!r}: {what}", S_PAYLOAD, fx, "read", code, {"tensor": tensor, "step": 2})
        if not deps:
            return
        if VALIDATOR_DECODES_PAYLOADS:
            cases.invalid(f"step 3 depends on it: {what}", S_VALID, fx, "broken_chain", {"step": 3})
        cases.error(f"reading {tensor!r} of step 3, whose base holds it: {what}", S_READING, fx, "read",
                    "broken_chain", {"tensor": tensor, "step": 3})

    def tiny_payload(fx: str, fn: Callable[[bytes], bytes], key: str = "w/c/0/0", which: int = 0,
                     steps: int = 2) -> Fx:
        f, _ = tiny_chain(root, fx, steps=steps)
        edit_payload(f, 2, key, fn, which)
        return f

    def frames(p: bytes) -> list[tuple[int, int]]:
        """(offset, end) of each zstd frame of a payload, from their headers (single-segment frames of
        ucl's writer)."""
        out, pos = [], 1
        while pos < len(p):
            start = pos
            fhd = p[pos + 4]
            fcs = (1 if fhd & 0x20 else 0, 2, 4, 8)[fhd >> 6]
            pos += 5 + (0 if fhd & 0x20 else 1) + (0, 1, 2, 4)[fhd & 3] + fcs
            while True:
                h = int.from_bytes(p[pos : pos + 3], "little")
                pos += 3 + (1 if (h >> 1) & 3 == 1 else h >> 3)
                if h & 1:
                    break
            pos += 4 * ((fhd >> 2) & 1)
            out.append((start, pos))
        return out

    tiny_payload("invalid/delta/payload_empty", lambda p: b"")
    payload_case("invalid/delta/payload_empty", "an empty payload (no mode byte)")
    tiny_payload("invalid/delta/payload_unknown_mode", lambda p: b"\x03" + p[1:], steps=3)
    payload_case("invalid/delta/payload_unknown_mode", "a payload whose mode byte is 3", deps=True)
    tiny_payload("invalid/delta/payload_truncated_frame", lambda p: p[:-3], steps=3)
    payload_case("invalid/delta/payload_truncated_frame", "a payload whose last zstd frame is cut short",
                 deps=True)
    tiny_payload("invalid/delta/payload_missing_frame",
                 lambda p: p[: frames(p)[-1][0]])  # one byte plane short: the sizes do not add up
    payload_case("invalid/delta/payload_missing_frame", "a payload whose frames hold one byte plane too few")
    tiny_payload("invalid/delta/payload_not_zstd", lambda p: p[:1] + b"\x00" * 4 + p[5:])
    payload_case("invalid/delta/payload_not_zstd", "a payload whose first frame has no zstd magic")

    def no_content_size(p: bytes) -> bytes:
        a, b = frames(p)[0]
        raw = p[a + 6 : b] if p[a + 4] == 0x20 else None  # single segment, 1-byte content size
        assert raw is not None, p[a : a + 8].hex()
        # the same frame without Single_Segment (a window byte instead) and no content size
        return p[:a] + b"\x28\xb5\x2f\xfd\x00\x00" + raw + p[b:]

    tiny_payload("invalid/delta/payload_frame_without_size", no_content_size)
    payload_case("invalid/delta/payload_frame_without_size",
                 "a payload whose first frame does not declare its content size")

    def dictionary(p: bytes) -> bytes:
        a, _ = frames(p)[0]
        q = bytearray(p)
        q[a + 4] |= 0x01  # Dictionary_ID_Flag 1: a 1-byte dictionary id follows the descriptor
        return bytes(q[: a + 5]) + b"\x07" + bytes(q[a + 5 :])

    tiny_payload("invalid/delta/payload_needs_dictionary", dictionary)
    payload_case("invalid/delta/payload_needs_dictionary", "a payload whose first frame needs dictionary 7")

    def wrong_plane_size(p: bytes) -> bytes:
        a, b = frames(p)[0]
        q = bytearray(p)
        assert q[a + 4] == 0x20
        q[a + 5] -= 1  # the frame declares one byte less than it holds
        return bytes(q)

    tiny_payload("invalid/delta/payload_wrong_content_size", wrong_plane_size)
    payload_case("invalid/delta/payload_wrong_content_size",
                 "a payload whose first frame declares one byte less than its blocks hold")

    # a mode that is neither 0 nor the array's encoding (w is xor: mode 2 is refused, never applied)
    fx = "invalid/delta/payload_mode_not_the_encoding"
    tiny_payload(fx, lambda p: b"\x02" + p[1:], steps=3)
    cases.valid("the full step validates", S_VALID, fx, "validate", {"step": 1})
    if VALIDATOR_DECODES_PAYLOADS:
        cases.invalid("'w' (encoding xor) holds a payload whose mode byte is 2 (sub)", S_PAYLOAD, fx,
                      "integrity_error", {"step": 2})
        cases.invalid("step 3 depends on a payload of the wrong mode", S_VALID, fx, "broken_chain", {"step": 3})
    cases.error("reading 'w' (encoding xor): a payload whose mode byte is 2 (sub)", S_PAYLOAD, fx, "read",
                "integrity_error", {"tensor": "w", "step": 2})
    cases.error("reading 'w' of step 3, whose base holds a payload of the wrong mode", S_READING, fx, "read",
                "broken_chain", {"tensor": "w", "step": 3})

    # integrity damage in a base: bytes flipped on disk, the commit record as it was
    fx = "invalid/delta/base_chunk_bit_flip"
    f, ref = tiny_chain(root, fx, steps=3, names=("w", "n"))
    off, _ = chunk_records(f, 2, "n/c/0")[0]
    f.flip("steps/2/n/c/0", off + 3)
    cases.invalid("a flipped bit in a delta payload of step 2", S_SHARDS, fx, "checksum_mismatch", {"step": 2})
    cases.invalid("step 3 depends on the damaged payload of step 2", S_VALID, fx, "broken_chain", {"step": 3})
    cases.error("reading 'n' of step 2", S_READING, fx, "read", "checksum_mismatch", {"tensor": "n", "step": 2})
    cases.error("reading 'n' of step 3, whose base is damaged", S_ORDER, fx, "read", "broken_chain",
                {"tensor": "n", "step": 3})
    cases.reads(S_READING, fx, {"w": ref[3]["w"]}, step=3,
                what=lambda n: ", step 3: the damage does not reach it")



def build(root: Path, cases: Cases) -> None:
    engine_chain(root, cases)
    sharded_chain(root, cases)
    chain_defects(root, cases)
    record_defects(root, cases)
    payload_defects(root, cases)

