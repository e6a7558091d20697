"""A small GPT/LLaMA-like decoder in plain torch, for the demo, the benchmarks and the resharding tests.

CPU, float32, deterministic: the same preset and seed give bit-identical parameters, batches, losses and
optimizer states, in any process (with the same number of torch threads: CPU matmul reductions may
depend on it).

Parameters are named the Megatron way, with fused projections, so that the layout language has real
fused sub-parameters to describe::

    embedding.word_embeddings.weight     [vocab, d_model]
    layers.{i}.input_norm.weight         [d_model]                  RMSNorm
    layers.{i}.attention.qkv.weight      [q_rows + 2 * kv_rows, d_model]
                                         rows [q; k; v], q_rows = n_heads * head_dim,
                                         kv_rows = n_kv_heads * head_dim (GQA)
    layers.{i}.attention.dense.weight    [d_model, n_heads * head_dim]
    layers.{i}.post_attn_norm.weight     [d_model]                  RMSNorm
    layers.{i}.mlp.gate_up.weight        [2 * ffn_hidden, d_model]  rows [gate; up] (SwiGLU)
    layers.{i}.mlp.down.weight           [d_model, ffn_hidden]
    final_norm.weight                    [d_model]
    lm_head.weight                       [vocab, d_model]           (not tied)

Typical use::

    model, opt = make_model_and_optimizer("tiny", seed=0)
    data = SyntheticData(model.config, seed=0)
    for step in range(1, 31):
        loss = train_step(model, opt, data.batch(step))
        ucl.save(full_state(model, opt), "ckpt", step=step)

The data stream is a function of the step number only (``data.batch(step)``), so a run resumed from a
checkpoint of step ``s`` sees exactly the batches ``s + 1, s + 2, ...`` an uninterrupted run sees.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "PRESETS",
    "GPT",
    "GPTConfig",
    "SyntheticData",
    "full_state",
    "get_config",
    "load_full_state",
    "make_model_and_optimizer",
    "param_shapes",
    "train_step",
]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder (and its optimizer's settings).

    ``head_dim = d_model // n_heads``; ``n_heads`` is a multiple of ``n_kv_heads`` (GQA).
    """

    vocab: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    seq_len: int
    batch_size: int = 8
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    lr: float = 3e-3
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self) -> None:
        ints = ("vocab", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "seq_len",
                "batch_size")
        for f in ints:
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"GPTConfig.{f} must be a positive int, got {v!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be a multiple of n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("head_dim must be even (rotary embeddings)")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def q_rows(self) -> int:
        """Rows of q in the fused qkv weight."""
        return self.n_heads * self.head_dim

    @property
    def kv_rows(self) -> int:
        """Rows of k (and of v) in the fused qkv weight."""
        return self.n_kv_heads * self.head_dim

    @property
    def qkv_rows(self) -> int:
        return self.q_rows + 2 * self.kv_rows

    @property
    def n_params(self) -> int:
        return sum(math.prod(s) for s in param_shapes(self).values())

    def replace(self, **changes: Any) -> GPTConfig:
        return dataclasses.replace(self, **changes)


# Every dimension that tensor parallelism splits (vocab, heads, kv heads, ffn_hidden) is divisible by 4, so
# every preset reshards across tp in {1, 2, 4} (medium: also 8).
PRESETS: dict[str, GPTConfig] = {
    # ~0.2M parameters: unit and resharding tests, milliseconds per step
    "tiny": GPTConfig(vocab=512, d_model=64, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=192, seq_len=32,
                      batch_size=8),
    # ~11M parameters (~136 MB with AdamW state): the demo
    "small": GPTConfig(vocab=16384, d_model=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_hidden=704,
                       seq_len=64, batch_size=4),
    # ~124M parameters (~1.5 GB with AdamW state): benchmarks
    "medium": GPTConfig(vocab=32000, d_model=768, n_layers=12, n_heads=16, n_kv_heads=8, ffn_hidden=2048,
                        seq_len=256, batch_size=4, lr=1e-3),
}


def get_config(preset: str | GPTConfig) -> GPTConfig:
    """A preset by name ("tiny", "small", "medium"), or the config itself."""
    if isinstance(preset, GPTConfig):
        return preset
    try:
        return PRESETS[preset]
    except KeyError:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}") from None


def param_shapes(config: str | GPTConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter's name and shape, in ``state_dict`` order, without building the model."""
    c = get_config(config)
    d = c.d_model
    out: dict[str, tuple[int, ...]] = {"embedding.word_embeddings.weight": (c.vocab, d)}
    for i in range(c.n_layers):
        p = f"layers.{i}."
        out[p + "input_norm.weight"] = (d,)
        out[p + "attention.qkv.weight"] = (c.qkv_rows, d)
        out[p + "attention.dense.weight"] = (d, c.q_rows)
        out[p + "post_attn_norm.weight"] = (d,)
        out[p + "mlp.gate_up.weight"] = (2 * c.ffn_hidden, d)
        out[p + "mlp.down.weight"] = (d, c.ffn_hidden)
    out["final_norm.weight"] = (d,)
    out["lm_head.weight"] = (c.vocab, d)
    return out


# -- the model ------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [B, H, T, hd]; rotate pairs (first half, second half)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.c = c
        self.qkv = nn.Linear(c.d_model, c.qkv_rows, bias=False)
        self.dense = nn.Linear(c.q_rows, c.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.c
        b, t, _ = x.shape
        q, k, v = self.qkv(x).split([c.q_rows, c.kv_rows, c.kv_rows], dim=-1)
        q = q.view(b, t, c.n_heads, c.head_dim).transpose(1, 2)
        k = k.view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        v = v.view(b, t, c.n_kv_heads, c.head_dim).transpose(1, 2)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        rep = c.n_heads // c.n_kv_heads
        if rep > 1:  # GQA: each kv head serves `rep` consecutive query heads
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(b, t, c.q_rows))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ffn_hidden = c.ffn_hidden
        self.gate_up = nn.Linear(c.d_model, 2 * c.ffn_hidden, bias=False)
        self.down = nn.Linear(c.ffn_hidden, c.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).split(self.ffn_hidden, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(c.d_model, c.norm_eps)
        self.attention = Attention(c)
        self.post_attn_norm = RMSNorm(c.d_model, c.norm_eps)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x), cos, sin)
        return x + self.mlp(self.post_attn_norm(x))


class Embedding(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab, c.d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.word_embeddings(tokens)


class GPT(nn.Module):
    """Pre-norm decoder: RMSNorm, rotary attention with GQA and a fused qkv, SwiGLU MLP, untied lm_head."""

    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, config: GPTConfig, seed: int | None = None) -> None:
        super().__init__()
        self.config = c = config
        self.embedding = Embedding(c)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.n_layers))
        self.final_norm = RMSNorm(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab, bias=False)
        inv = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        ang = torch.outer(torch.arange(c.seq_len, dtype=torch.float64), inv)
        self.register_buffer("rope_cos", ang.cos().float(), persistent=False)
        self.register_buffer("rope_sin", ang.sin().float(), persistent=False)
        if seed is not None:
            self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """GPT-2 style initialisation from a private generator (the global RNG is left alone)."""
        g = torch.Generator().manual_seed(seed)
        std = 0.02
        out_std = std / math.sqrt(2 * self.config.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("attention.dense.weight", "mlp.down.weight")):
                p.normal_(0.0, out_std, generator=g)
            else:
                p.normal_(0.0, std, generator=g)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [B, T, vocab] for tokens [B, T] (T <= seq_len)."""
        t = tokens.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.config.seq_len}")
        cos, sin = self.rope_cos[:t], self.rope_sin[:t]
        x = self.embedding(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.final_norm(x))


# -- data -----------------------------------------------------------------------------------------
class SyntheticData:
    """A deterministic token stream with structure a model can learn.

    Tokens follow a fixed random Markov chain: each token has ``branching`` successors, drawn once from a
    Zipf(1) distribution over the vocabulary and then chosen uniformly at each position. A model first
    learns which tokens are frequent (the loss falls fast from ``log(vocab)``), then the chain itself
    (the best possible loss is at most ``log(branching)``, 1.39 nats for 4). ``batch(step)`` depends only
    on ``(seed, step)``.
    """

    def __init__(self, config: str | GPTConfig, seed: int = 0, batch_size: int | None = None,
                 branching: int = 4) -> None:
        self.config = c = get_config(config)
        self.seed = seed
        self.batch_size = batch_size or c.batch_size
        self.branching = branching
        g = torch.Generator().manual_seed(seed ^ 0x5EED_DA7A)
        zipf = 1.0 / torch.arange(1, c.vocab + 1, dtype=torch.float64)
        self.successors = torch.multinomial(zipf, c.vocab * branching, replacement=True,
                                            generator=g).view(c.vocab, branching)

    @property
    def loss_bound(self) -> float:
        """An upper bound on the best achievable loss (the chain's entropy rate is at most this)."""
        return math.log(self.branching)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, targets)``, each int64 [batch_size, seq_len]; targets are inputs shifted by one."""
        c = self.config
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + step) & 0x7FFF_FFFF_FFFF_FFFF)
        b, t = self.batch_size, c.seq_len
        choice = torch.randint(0, self.branching, (b, t), generator=g)
        seq = torch.empty(b, t + 1, dtype=torch.int64)
        seq[:, 0] = torch.randint(0, c.vocab, (b,), generator=g)
        for i in range(t):
            seq[:, i + 1] = self.successors[seq[:, i], choice[:, i]]
        return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()

    def batches(self, start: int = 1) -> Iterator[tuple[int, tuple[torch.Tensor, torch.Tensor]]]:
        """``(step, batch)`` for step = start, start + 1, ... (forever)."""
        step = start
        while True:
            yield step, self.batch(step)
            step += 1


# -- training -------------------------------------------------------------------------------------
def make_optimizer(model: nn.Module, config: GPTConfig | None = None) -> torch.optim.AdamW:
    c = config or model.config  # type: ignore[union-attr]
    assert isinstance(c, GPTConfig)
    return torch.optim.AdamW(model.parameters(), lr=c.lr, betas=c.betas, eps=1e-8,
                             weight_decay=c.weight_decay)


def make_model_and_optimizer(preset: str | GPTConfig = "tiny",
                             seed: int = 0) -> tuple[GPT, torch.optim.AdamW]:
    """A freshly initialised model (deterministic in ``seed``) and its AdamW optimizer (no state yet)."""
    config = get_config(preset)
    model = GPT(config, seed=seed)
    return model, make_optimizer(model, config)


def train_step(model: nn.Module, opt: torch.optim.Optimizer,
               batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    """One optimizer step on ``batch``; returns the loss (before the update) as a Python float."""
    inputs, targets = batch
    model.train()
    opt.zero_grad(set_to_none=True)
    logits = model(inputs)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
    loss.backward()
    opt.step()
    return float(loss.item())


def full_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": model.state_dict(), "optim": opt.state_dict()}``: what a training checkpoint holds."""
    return {"model": model.state_dict(), "optim": opt.state_dict()}


def load_full_state(model: nn.Module, opt: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Inverse of :func:`full_state`: restore parameters and optimizer state (e.g. from ``ucl.load``)."""
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])


# -- the model's layout (spec/layout.md), for resharding ---------------------------------------------
def _q(name: str) -> str:
    return json.dumps(name)


def layout_text(
    c: GPTConfig, *, tp: int = 1, pp: int = 1, dp: int = 1, vocab_multiple: int = 128
) -> str:
    """The UCL layout (spec/layout.md) of this GPT's state under Megatron-style parallelism:
    "model/<param>", "optim/state/<param>/<exp_avg|exp_avg_sq>", and with
    dp > 1 ZeRO flat buffers "optim/flat/<state>" (one per pipeline stage) in place of the latter."""
    hd = c.head_dim

    def both(p: str) -> str:
        return f"{_q('**' + p)}, {_q('**' + p + '/*')}"

    vocab = f"size(0, {c.vocab}), pad(0, {vocab_multiple}*tp), shard(0, tp)"
    lines = [
        "ucl-layout 1",
        f"renumber {_q('**layers.{i}.**')} over pp: {c.n_layers}",
        f"{both('embedding.word_embeddings.weight')}: {vocab} on pp=0",
        f"{both('.attention.qkv.weight')}: fused(0, q={c.n_heads}x{hd}, k={c.n_kv_heads}x{hd}, "
        f"v={c.n_kv_heads}x{hd}), shard(0, tp)",
        f"{both('.attention.dense.weight')}: shard(1, tp)",
        f"{both('.mlp.gate_up.weight')}: fused(0, gate={c.ffn_hidden}, up={c.ffn_hidden}), shard(0, tp)",
        f"{both('.mlp.down.weight')}: shard(1, tp)",
        f"{both('final_norm.weight')}: replicate on pp=-1",
        f"{both('lm_head.weight')}: {vocab} on pp=-1",
    ]
    if dp > 1:
        shapes = param_shapes(c)
        per = -(-c.n_layers // pp)
        for s in range(pp):
            lo, hi = min(s * per, c.n_layers), min((s + 1) * per, c.n_layers)
            members = []
            for name, shape in shapes.items():
                if name.startswith("layers."):
                    i = int(name.split(".")[1])
                    if not lo <= i < hi:
                        continue
                    name = f"layers.{i - lo}." + name.split(".", 2)[2]
                elif (name.startswith("embedding.") and s != 0) or (
                    name.startswith(("final_norm.", "lm_head.")) and s != pp - 1
                ):
                    continue
                members.append(f"  {_q('model/' + name)} {list(shape)},")
            on = f" on pp={s}" if pp > 1 else ""
            lines.append(f'flat "optim/flat/{{state}}" -> "optim/state/{{member}}/{{state}}" over dp{on}: [')
            lines += members
            lines.append("]")
    return "\n".join(lines) + "\n"


def logical_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flat logical state: "model/<p>", "optim/state/model/<p>/exp_avg", ".../exp_avg_sq"."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"model/{name}"] = p.detach().clone()
        st = opt.state[p]
        out[f"optim/state/model/{name}/exp_avg"] = st["exp_avg"].clone()
        out[f"optim/state/model/{name}/exp_avg_sq"] = st["exp_avg_sq"].clone()
    return out
