"""Resharding a Megatron-core style step with ZeRO flat optimizer buffers: what one target rank reads
beside what it holds, and the time, in a fresh process with a cold page cache.

    ./dev bench reshard_flat [--reps 3] [--dir DIR] [--drop auto|fadvise|drop_caches] [--tiny]

The state: ``megatron_gpt`` (8 heads in 2 query groups, hidden 512, ffn 1376, 4 layers, vocabulary 32001)
with each parameter's ``exp_avg``, saved from one process (``ucl.save_sharded``: the files a distributed
save writes) under the source (pp, dp, tp), the optimizer state as flat buffers split over dp
(``megatron_gpt(zero=mesh)``). A target rank loads its local state (``ucl.load(path, layout=, mesh=,
rank=)``): "read / local" is ucl's bytes read (chunks and shard indexes, ``Checkpoint.bytes_read``) over
the bytes of the tensors it returns. Under another tp a column-split member of a flat buffer is one row
run per row; each inner chunk is read once per batch and delivered to every run that needs it.

DCP has no counterpart here: a flat buffer's members are not DTensors it could reshard.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

CFG = dict(num_layers=4, num_heads=8, num_kv_heads=2, hidden=512, ffn_hidden=1376, vocab_size=32001)
TINY = dict(num_layers=2, num_heads=4, num_kv_heads=2, hidden=64, ffn_hidden=176, vocab_size=1001)  # smoke test
CASES = [((1, 2, 2), (1, 1, 4)), ((1, 2, 2), (1, 4, 1)), ((2, 1, 2), (1, 2, 2)), ((1, 1, 4), (1, 4, 1)),
         ((1, 1, 4), (2, 2, 1))]


def _mesh(c: tuple[int, ...]) -> Any:
    from ucl.layout import Mesh

    return Mesh.of(pp=c[0], dp=c[1], tp=c[2])


def full_state() -> dict[str, Any]:
    import torch

    from ucl.layout.builtins import megatron_gpt_params

    g = torch.Generator().manual_seed(0)
    out = {}
    for n, s in megatron_gpt_params(**CFG):
        out["model/" + n] = torch.randn(s, generator=g)
        out[f"optim/state/{n}/exp_avg"] = torch.randn(s, generator=g)
    return out


def save_child(path: str, src: tuple[int, ...]) -> dict[str, Any]:
    import ucl
    from ucl.layout.builtins import megatron_gpt
    from ucl.testing.layout_reference import shard_local_state

    full = full_state()
    mesh = _mesh(src)
    layout = megatron_gpt(**CFG, zero=mesh)
    ucl.save_sharded([shard_local_state(full, layout, mesh, r) for r in range(mesh.size)], path, 1,
                     layout=layout, mesh=mesh)
    return {"nbytes": C.state_nbytes(full)}


def load_child(path: str, dst: tuple[int, ...], rank: int, drop: str) -> dict[str, Any]:
    import ucl
    from ucl.layout.builtins import megatron_gpt

    mesh = _mesh(dst)
    layout = megatron_gpt(**CFG, zero=mesh)
    C.drop_cache([path], drop)
    with C.Meter() as m, ucl.open(path) as ckpt:
        t0 = time.perf_counter()
        got = ucl.load(ckpt, layout=layout, mesh=mesh, rank=rank, flat=True)
        secs = time.perf_counter() - t0
        read = ckpt.bytes_read
    local = sum(t.numel() * t.element_size() for t in got.values())
    flat = sum(t.numel() * t.element_size() for n, t in got.items() if n.startswith("optim/flat"))
    return m.result(bytes_read=read, local=local, flat=flat, load_s=secs)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir")
    ap.add_argument("--drop", default="auto")
    ap.add_argument("--tiny", action="store_true", help="a tiny model (the smoke test)")
    ap.add_argument("--child", nargs="*")
    a = ap.parse_args(argv)
    if a.tiny:
        CFG.update(TINY)
    tiny = ["--tiny"] if a.tiny else []
    if a.child:
        import json

        kind, path, conf, *rest = a.child
        c = tuple(int(x) for x in conf.split(","))
        out = save_child(path, c) if kind == "save" else load_child(path, c, int(rest[0]), a.drop)
        print(json.dumps(out))
        return 0
    os.makedirs("bench-out", exist_ok=True)
    d = a.dir or tempfile.mkdtemp(prefix="reshard-flat-", dir="bench-out")
    me = os.path.abspath(__file__)
    rows = []
    t_all = time.perf_counter()
    try:
        for src in dict.fromkeys(s for s, _ in CASES):
            path = os.path.join(d, "x".join(map(str, src)))
            shutil.rmtree(path, ignore_errors=True)
            C.run_child([me, *tiny, "--child", "save", path, ",".join(map(str, src))])
            C.settle(d)
            for s2, dst in CASES:
                if s2 != src:
                    continue
                world = dst[0] * dst[1] * dst[2]
                for rank in dict.fromkeys((0, world - 1)):
                    runs = [C.run_child([me, *tiny, "--drop", a.drop, "--child", "load", path, ",".join(map(str, dst)),
                                         str(rank)]) for _ in range(a.reps)]
                    r = runs[0]
                    ratio = C.median([x["bytes_read"] / x["local"] for x in runs])
                    rows.append([f"{src} -> {dst}", rank, C.fmt_bytes(r["local"]), C.fmt_bytes(r["flat"]),
                                 C.fmt_bytes(C.median([x["bytes_read"] for x in runs])), f"{ratio:.2f}x",
                                 f"{C.median([x['load_s'] for x in runs]):.2f} s"])
            shutil.rmtree(path, ignore_errors=True)
    finally:
        if a.dir is None:
            shutil.rmtree(d, ignore_errors=True)
    print(f"`./dev bench reshard_flat --reps {a.reps}{' --tiny' if a.tiny else ''}`\n\n{C.machine_line()}; "
          f"megatron_gpt {CFG} + exp_avg, "
          f"(pp, dp, tp) source -> target; median of {a.reps} fresh processes, cold cache; total "
          f"{time.perf_counter() - t_all:.0f} s.\n")
    print(C.markdown_table(["(pp, dp, tp)", "rank", "local", "of it flat buffers", "ucl read", "read / local",
                            "load"], rows, "lrrrrrr"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
