"""Delta codec on real training states: sizes and single-core throughput (spec/delta.md §5).

    python bench/delta_codec.py [--warmup 20] [--pairs 3] [--d-model 256] [--layers 4] [--vocab 4096]
                                [--repeat 3] [--chain 8] [--skip-reference]

Trains a small decoder-only transformer (CPU, fp32, AdamW, synthetic Zipf/Markov token stream) for
``--warmup`` steps, then keeps ``--pairs + 1`` consecutive states (parameters, exp_avg, exp_avg_sq).
Every tensor is cut into inner chunks of at most ``--chunk-mib`` MiB (splitting leading dimensions, as
the writer does) and each consecutive pair is encoded chunk by chunk. Throughput is raw bytes over the
encoding thread's CPU time (``time.thread_time``), one thread: per core, and insensitive to other
processes sharing the machine; each chunk's time is the best of ``--repeat`` runs. The native rows encode
with ``encode_chunk_into`` into a reused buffer and decode into a reused array, as the engine does.

Tables (markdown):
1. encodings: bytes per step, ratio vs raw, ratio vs plain zstd, encode and decode GB/s per core
2. per state kind with the writer's choice (``choose_encoding``)
3. scenarios: half the layers frozen; deltas against the last full step instead of the previous one;
   gradient records (gradients instead of the optimizer state); then steps written by the engine
   (state deltas beside gradient records, with and without half the model frozen): bytes on disk and
   the median time ``save`` blocked training, in the same run; rebuilding a step through a chain of 8
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

# -- training ---------------------------------------------------------------------------------------


def train_states(
    args: argparse.Namespace, frozen_layers: int = 0, keep: int | None = None, grads: bool = False,
    callback: Callable[[int, Any, Any], None] | None = None,
) -> list[dict[str, np.ndarray]]:
    """Consecutive states (and optionally the gradients of the step that produced each); ``callback(step,
    model, optimizer)`` runs after each optimizer step past the warmup."""
    import torch
    from torch import nn

    torch.manual_seed(0)
    torch.set_num_threads(1)
    V, D, L, T, B = args.vocab, args.d_model, args.layers, 64, 8

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.attn = nn.MultiheadAttention(D, max(1, D // 64), batch_first=True)
            self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Linear(4 * D, D))

        def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
            h = self.ln1(x)
            x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
            return x + self.mlp(self.ln2(x))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.pos = nn.Parameter(torch.randn(T, D) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(L))
            self.ln = nn.LayerNorm(D)
            self.head = nn.Linear(D, V)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            mask = torch.triu(torch.full((x.shape[1], x.shape[1]), float("-inf")), 1)
            h = self.emb(x) + self.pos[: x.shape[1]]
            for b in self.blocks:
                h = b(h, mask)
            return self.head(self.ln(h))

    model = Model()
    for b in list(model.blocks)[:frozen_layers]:
        b.requires_grad_(False)
    if frozen_layers:
        model.emb.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr)
    g = torch.Generator().manual_seed(1)
    zipf = 1.0 / torch.arange(1, V + 1, dtype=torch.float64)
    follow = torch.randperm(V, generator=g)

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        z = torch.multinomial(zipf, B * (T + 1), replacement=True, generator=g).reshape(B, T + 1)
        x = z.clone()
        use = torch.rand(B, T + 1, generator=g) < 0.6
        for t in range(1, T + 1):
            x[:, t] = torch.where(use[:, t], follow[x[:, t - 1]], z[:, t])
        return x[:, :-1], x[:, 1:]

    keep = args.pairs + 1 if keep is None else keep
    states = []
    for step in range(1, args.warmup + keep + 1):
        x, y = batch()
        loss = nn.functional.cross_entropy(model(x).reshape(-1, V), y.reshape(-1))
        opt.zero_grad()
        loss.backward()
        grad = {
            f"grad/{n}": p.grad.detach().numpy().copy()
            for n, p in model.named_parameters()
            if p.grad is not None
        }
        opt.step()
        if step > args.warmup and callback is not None:
            callback(step, model, opt)
        if step > args.warmup and callback is None:
            s: dict[str, np.ndarray] = {}
            for n, p in model.named_parameters():
                s[f"model/{n}"] = p.detach().numpy().copy()
                st = opt.state.get(p)
                if st:
                    s[f"optim/{n}/exp_avg"] = st["exp_avg"].numpy().copy()
                    s[f"optim/{n}/exp_avg_sq"] = st["exp_avg_sq"].numpy().copy()
            if grads:
                s.update(grad)
            states.append(s)
    return states


# -- chunking ---------------------------------------------------------------------------------------
def inner_chunks(a: np.ndarray, target: int) -> list[np.ndarray]:
    """Contiguous inner chunks of at most ``target`` bytes, splitting the leading dimension."""
    flat = np.ascontiguousarray(a).reshape(a.shape[0] if a.ndim else 1, -1)
    row = flat.shape[1] * a.itemsize
    rows = max(1, target // max(row, 1))
    return [flat[i : i + rows].reshape(-1) for i in range(0, flat.shape[0], rows)]


def kind_of(name: str) -> str:
    if name.startswith("grad/"):
        return "gradient"
    return name.rsplit("/", 1)[-1] if name.startswith("optim/") else "param"


# -- measuring --------------------------------------------------------------------------------------
class Tally:
    def __init__(self) -> None:
        self.raw = self.stored = self.zstd = 0
        self.t_enc = self.t_dec = 0.0
        self.modes: dict[str, int] = {}

    def row(self, label: str, steps: int) -> list[str]:
        vs_zstd = self.zstd / self.stored if self.zstd else math.nan
        return [
            label,
            f"{self.stored / steps / 1e6:.2f} MB",
            f"{self.raw / self.stored:.3f}x",
            f"{vs_zstd:.3f}x",
            f"{self.raw / self.t_enc / 1e9:.2f}" if self.t_enc else "-",
            f"{self.raw / self.t_dec / 1e9:.2f}" if self.t_dec else "-",
        ]


def measure(
    pairs: Sequence[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
    target: int,
    encoding: Callable[[str, str], str] | None,
    backend: str = "native",
    plain: dict[str, int] | None = None,
    kinds: dict[str, Tally] | None = None,
    names: Callable[[str], bool] = lambda n: True,
    repeat: int = 3,
) -> Tally:
    """Encode every chunk of ``new`` against ``old`` (encoding None: full values, no base).

    The native backend encodes with ``encode_chunk_into`` into one reused buffer and decodes into one
    reused array, as the engine does (staging and destination memory is pre-touched); each chunk's time
    is the best of ``repeat`` runs (this machine is shared).
    """
    from ucl.delta import bit_view, decode_chunk, encode_chunk, encode_chunk_into, payload_bound

    t = Tally()
    out_buf = np.empty(payload_bound(target + (1 << 16), 8), np.uint8)
    dec_buf = np.empty(target // 1 + (1 << 16), np.uint8)
    for old, new in pairs:
        for name in sorted(new):
            if not names(name):
                continue
            enc = encoding(name, "float32") if encoding else "xor"
            for nc, oc in zip(inner_chunks(new[name], target), inner_chunks(old[name], target), strict=True):
                nw, ow = bit_view(nc), bit_view(oc)
                base = ow if encoding else None
                best = math.inf
                p: bytes | None = None
                for _ in range(repeat):
                    t0 = time.thread_time()
                    if backend == "native":
                        ln = encode_chunk_into(nw, base, enc, out_buf)
                    else:
                        p = encode_chunk(nw, base, enc, backend=backend)  # type: ignore[arg-type]
                    best = min(best, time.thread_time() - t0)
                if backend == "native":
                    p = bytes(out_buf[:ln]) if ln else None
                t.t_enc += best
                t.raw += nw.nbytes
                k = kinds.setdefault(kind_of(name), Tally()) if kinds is not None else None
                if k is not None:
                    k.raw += nw.nbytes
                    k.t_enc += best
                if p is None:
                    t.modes["absent"] = t.modes.get("absent", 0) + 1
                    continue
                t.stored += len(p)
                if k is not None:
                    k.stored += len(p)
                mode = ("full", "xor", "sub")[p[0]]
                t.modes[mode] = t.modes.get(mode, 0) + 1
                out = dec_buf[: nw.nbytes].view(nw.dtype)
                best = math.inf
                for _ in range(repeat):
                    t0 = time.thread_time()
                    decode_chunk(p, base, out, backend=backend)  # type: ignore[arg-type]
                    best = min(best, time.thread_time() - t0)
                t.t_dec += best
                if k is not None:
                    k.t_dec += best
                assert out.tobytes() == nw.tobytes(), f"{name}: not bit-exact"
    if plain is not None:
        t.zstd = plain["all"]
        if kinds is not None:
            for kname, k in kinds.items():
                k.zstd = plain.get(kname, 0)
    return t


def plain_zstd(
    pairs: Sequence[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]],
    target: int,
    names: Callable[[str], bool] = lambda n: True,
    repeat: int = 3,
) -> tuple[dict[str, int], Tally]:
    """Plain zstd level 1 of each full chunk (what a zarr [bytes, zstd] array would store)."""
    from numcodecs import zstd

    sizes: dict[str, int] = {"all": 0}
    t = Tally()
    dec_buf = np.empty(target + (1 << 16), np.uint8)
    for _old, new in pairs:
        for name in sorted(new):
            if not names(name):
                continue
            for c in inner_chunks(new[name], target):
                te = td = math.inf
                for _ in range(repeat):
                    t0 = time.thread_time()
                    z = zstd.compress(c, 1)
                    te = min(te, time.thread_time() - t0)
                    t0 = time.thread_time()
                    zstd.decompress(z, dec_buf[: c.nbytes])
                    td = min(td, time.thread_time() - t0)
                t.t_enc += te
                t.t_dec += td
                t.raw += c.nbytes
                t.stored += len(z)
                sizes["all"] += len(z)
                sizes[kind_of(name)] = sizes.get(kind_of(name), 0) + len(z)
    t.zstd = sizes["all"]
    return sizes, t


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in r] for r in rows]
    w = [max(len(r[i]) for r in cells) for i in range(len(headers))]

    def line(r: Sequence[str]) -> str:
        return "| " + " | ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) + " |"

    sep = (
        "|"
        + "|".join(":" + "-" * (w[0] + 1) if i == 0 else "-" * (x + 1) + ":" for i, x in enumerate(w))
        + "|"
    )
    return "\n".join([line(cells[0]), sep, *(line(r) for r in cells[1:])])


def rebuild_chain(
    states: list[dict[str, np.ndarray]], target: int, base_full: bool = False
) -> tuple[float, float, int, int]:
    """CPU seconds to rebuild the last state through its chain vs decoding it as one full payload, and the
    bytes each reads. The chain is every state in turn (base='previous'), or with ``base_full`` the first
    state and one delta against it (base='full')."""
    from ucl.delta import ArrayInfo, bit_view, decode_chunk, encode_chunk, reconstruct_inner
    from ucl.format.records import DeltaRecord, choose_encoding

    steps = [0, len(states) - 1] if base_full else list(range(len(states)))
    top = steps[-1]
    chunks: dict[tuple[int, str, int], bytes] = {}
    full_payloads: dict[tuple[str, int], bytes] = {}
    links: dict[str, list[ArrayInfo]] = {}
    for name in sorted(states[0]):
        enc = choose_encoding(name, "float32")
        per = {i: inner_chunks(states[i][name], target) for i in steps}
        shape = (states[0][name].size,)
        links[name] = [
            ArrayInfo(
                s,
                name,
                shape,
                "float32",
                shape,
                shape,
                None if j == 0 else DeltaRecord("chunked", steps[j - 1], enc),
            )
            for j, s in enumerate(steps)
        ]
        for c in range(len(per[0])):
            chunks[(0, name, c)] = per[0][c].tobytes()
            for j in range(1, len(steps)):
                p = encode_chunk(bit_view(per[steps[j]][c]), bit_view(per[steps[j - 1]][c]), enc)
                if p is not None:
                    chunks[(steps[j], name, c)] = p
            fp = encode_chunk(bit_view(per[top][c]), None, "xor")
            assert fp is not None
            full_payloads[(name, c)] = fp
    read = {"n": 0}

    def read_inner(step: int, name: str, coords: tuple[int, ...]) -> bytes | None:
        b = chunks.get((step, name, coords[0]))
        read["n"] += len(b) if b is not None else 0
        return b

    t_chain = t_full = 0.0
    full_bytes = 0
    buf = np.empty(target + (1 << 16), np.uint8)
    for name in sorted(states[0]):
        for c, ref in enumerate(inner_chunks(states[top][name], target)):
            out = buf[: ref.nbytes].view(bit_view(ref).dtype)
            t0 = time.thread_time()
            reconstruct_inner(links[name], (c,), read_inner, out)
            t_chain += time.thread_time() - t0
            assert out.tobytes() == bit_view(ref).tobytes()
            fp = full_payloads[(name, c)]
            full_bytes += len(fp)
            t0 = time.thread_time()
            decode_chunk(fp, None, out)
            t_full += time.thread_time() - t0
    return t_chain, t_full, read["n"], full_bytes


def engine_step_sizes(args: argparse.Namespace, policy: Any, frozen_layers: int = 0,
                      saves: int = 6) -> tuple[int, float, int, float]:
    """Train with the real engine saving every step (``CheckpointManager(delta=policy)``, the optimizer
    passed for gradient records); bytes on disk of the first (full) step, the mean of the next ``saves - 1``
    steps, how many of those are gradient-record steps, and the median time ``save`` blocked training for
    them (the staging copy). Every step is read back and checked bit-exact against the state it saved."""
    import copy
    import tempfile

    import torch

    import ucl
    from ucl.write.manager import CheckpointManager

    with tempfile.TemporaryDirectory(prefix="ucl-bench-") as d:
        want: dict[int, Any] = {}
        blocked: list[float] = []
        with CheckpointManager(d, delta=policy) as mgr:

            def save(step: int, model: Any, opt: Any) -> None:
                if len(want) < saves:
                    st = {"model": model.state_dict(), "optim": opt.state_dict()}
                    want[step] = copy.deepcopy(st)
                    h = mgr.save(step, st, optimizer=opt if policy.gradients else None)
                    if len(want) > 1:
                        blocked.append(h.staged_s)

            train_states(args, frozen_layers=frozen_layers, keep=saves, callback=save)
            mgr.wait()
        sizes, recorded = [], 0
        for step in sorted(want):
            top = os.path.join(d, "steps", str(step))
            files = [os.path.join(r, f) for r, _, fs in os.walk(top) for f in fs]
            sizes.append(sum(os.path.getsize(f) for f in files))
            with ucl.open(d, step) as ck:
                recorded += ck.records is not None
                got = ck.load(flat=True)
            from ucl.format import structure

            ref, _ = structure.flatten(want[step])
            assert all(torch.equal(got[k].view(-1).view(torch.uint8), ref[k].reshape(-1).view(torch.uint8))
                       for k in ref), f"step {step} is not bit-exact"
        blocked.sort()
        return sizes[0], sum(sizes[1:]) / (len(sizes) - 1), recorded, blocked[len(blocked) // 2]


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--chunk-mib", type=float, default=4.0)
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3, help="best of N timings per chunk")
    ap.add_argument("--skip-reference", action="store_true", help="skip the (slow) reference backend row")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from ucl import _delta
    from ucl.format.records import choose_encoding

    target = int(args.chunk_mib * (1 << 20))
    t0 = time.time()
    states = train_states(args)
    raw_step = sum(a.nbytes for a in states[0].values())
    print(
        f"# delta codec: {args.layers}-layer d={args.d_model} vocab={args.vocab} transformer, "
        f"AdamW lr={args.lr}, fp32, states after steps {args.warmup + 1}..{args.warmup + args.pairs + 1}"
    )
    print(
        f"# {len(states[0])} tensors, {raw_step / 1e6:.1f} MB per step, "
        f"inner chunks <= {args.chunk_mib} MiB; zstd {_delta.zstd_version()}; "
        f"trained in {time.time() - t0:.1f} s; load average {os.getloadavg()[0]:.2f} "
        f"on {os.cpu_count()} CPUs; GB/s = raw bytes / thread CPU time, one thread\n"
    )
    pairs = list(zip(states[:-1], states[1:], strict=True))
    n = len(pairs)
    plain, plain_t = plain_zstd(pairs, target, repeat=args.repeat)
    kinds: dict[str, Tally] = {}
    rows = [
        [
            "raw (no compression)",
            f"{raw_step / 1e6:.2f} MB",
            "1.000x",
            f"{plain['all'] / (raw_step * n):.3f}x",
            "-",
            "-",
        ],
        plain_t.row("plain zstd-1 (zarr [bytes, zstd])", n),
        measure(pairs, target, None, plain=plain, repeat=args.repeat).row(
            "shuffle + zstd, full values (mode 0)", n
        ),
        measure(pairs, target, lambda nm, dt: "xor", plain=plain, repeat=args.repeat).row(
            "delta, XOR everywhere", n
        ),
        measure(pairs, target, lambda nm, dt: "sub", plain=plain, repeat=args.repeat).row(
            "delta, SUB everywhere", n
        ),
    ]
    auto = measure(pairs, target, choose_encoding, plain=plain, kinds=kinds, repeat=args.repeat)
    rows.append(auto.row("delta, choose_encoding (writer default)", n))
    if not args.skip_reference:
        rows.append(
            measure(
                pairs[:1],
                target,
                choose_encoding,
                backend="reference",
                plain=plain_zstd(pairs[:1], target)[0],
                repeat=1,
            ).row("delta, choose_encoding, reference backend", 1)
        )
    print("## Encodings (consecutive steps)\n")
    print(
        table(
            ["encoding", "bytes/step", "ratio vs raw", "ratio vs plain zstd", "encode GB/s", "decode GB/s"],
            rows,
        )
    )
    print(f"\nchunk modes chosen (writer default): {auto.modes}\n")
    print("## Per state kind (writer default)\n")
    print(
        table(
            ["kind", "bytes/step", "ratio vs raw", "ratio vs plain zstd", "encode GB/s", "decode GB/s"],
            [
                k.row(
                    f"{name} ({choose_encoding('optim/x/' + name if name != 'param' else 'w', 'float32')})", n
                )
                for name, k in sorted(kinds.items())
            ],
        )
    )

    print("\n## Scenarios\n")
    srows = []
    half = max(1, args.layers // 2)
    fr = train_states(args, frozen_layers=half, keep=2)
    fr_raw = sum(a.nbytes for a in fr[1].values())
    t = measure([(fr[0], fr[1])], target, choose_encoding)
    srows.append(
        [
            f"{half} of {args.layers} blocks + embedding frozen",
            f"{fr_raw / 1e6:.2f} MB",
            f"{t.stored / 1e6:.2f} MB",
            f"{fr_raw / t.stored:.2f}x",
            "frozen tensors: unchanged, 0 bytes",
        ]
    )
    far = train_states(args, keep=args.chain + 1)
    for dist in (1, 4, args.chain):
        t = measure([(far[0], far[dist])], target, choose_encoding)
        srows.append(
            [
                f"delta against the step {dist} back",
                f"{raw_step / 1e6:.2f} MB",
                f"{t.stored / 1e6:.2f} MB",
                f"{raw_step / t.stored:.2f}x",
                "base='full' policy pays this" if dist > 1 else "base='previous'",
            ]
        )
    gr = train_states(args, keep=1, grads=True)[0]
    g_only = {k: v for k, v in gr.items() if k.startswith("grad/")}
    t = measure([(g_only, g_only)], target, None)
    srows.append(
        [
            "gradient records (gradients, shuffle+zstd)",
            f"{raw_step / 1e6:.2f} MB",
            f"{t.stored / 1e6:.2f} MB",
            f"{raw_step / t.stored:.2f}x",
            "exact only with a matching optimizer fingerprint",
        ]
    )
    from ucl.write.policy import DeltaPolicy

    for label, policy, frozen in (
        ("engine, state deltas (base=previous), on disk", DeltaPolicy(base="previous"), 0),
        ("engine, gradient records, on disk", DeltaPolicy(gradients=True), 0),
        (f"engine, gradient records, {half} blocks + embedding frozen", DeltaPolicy(gradients=True), half),
        (f"engine, state deltas (base=previous), {half} blocks + embedding frozen",
         DeltaPolicy(base="previous"), half),
    ):
        full_b, step_b, recorded, block_s = engine_step_sizes(args, policy, frozen)
        srows.append(
            [
                label,
                f"{full_b / 1e6:.2f} MB",
                f"{step_b / 1e6:.2f} MB",
                f"{full_b / step_b:.2f}x",
                f"{recorded} of 5 as gradients; save blocks {block_s * 1e3:.1f} ms; read back bit-exact",
            ]
        )
    print(table(["scenario", "full step", "stored", "ratio vs full step", "note"], srows))
    raw_bytes = sum(a.nbytes for a in far[0].values())
    crows = []
    for label, base_full in (
        (f"chain of {args.chain} deltas (base='previous')", False),
        ("one delta against the full step (base='full')", True),
    ):
        t_chain, t_full, chain_bytes, full_bytes = rebuild_chain(far[: args.chain + 1], target, base_full)
        crows.append(
            [
                label,
                f"{t_chain * 1e3:.0f} ms",
                f"{chain_bytes / 1e6:.1f} MB",
                f"{t_chain / t_full:.1f}x",
                f"{chain_bytes / full_bytes:.1f}x",
                f"{chain_bytes / raw_bytes:.1f}x",
            ]
        )
    print(
        f"\n## Rebuilding step {args.warmup + args.chain + 1} "
        "(CPU time; bytes read incl. the full base, stored raw)\n"
    )
    print(
        table(
            [
                "how",
                "CPU",
                "bytes read",
                "CPU vs decoding it stored full",
                "bytes vs stored full (shuffle+zstd)",
                "bytes vs stored raw",
            ],
            crows,
        )
    )


if __name__ == "__main__":
    main()
