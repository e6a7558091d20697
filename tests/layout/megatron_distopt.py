"""An independent reference of what each rank of a Megatron-core GPT job holds, its distributed-optimizer
buffers included, written from Megatron-LM's source at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553
(2026-08-22). Nothing here uses ucl's layout code; the tests compare ucl against these functions.

Model tensors of tensor-parallel rank ``r`` of ``tp``:

- megatron/core/tensor_parallel/layers.py: ``VocabParallelEmbedding`` and the column-parallel output layer
  hold rows ``[r V/tp, (r+1) V/tp)`` of the vocabulary padded to a multiple of
  ``make_vocab_size_divisible_by * tp`` (megatron/training/tokenizer ``_vocab_size_with_padding``);
  ``ColumnParallelLinear`` a contiguous 1/tp of the output rows, ``RowParallelLinear`` of the input
  columns (its bias whole).
- ``linear_qkv`` per query group ``[its query heads; k; v]``, split in rows (tests/layout/megatron_qkv.py).
- megatron/core/transformer/mlp.py ``apply_swiglu_sharded_factory``: with a gated linear unit each rank's
  ``linear_fc1`` is ``[gate_r; up_r]``, the r-th 1/tp of each.
- megatron/core/transformer/transformer_block.py ``get_num_layers_to_build``: stage ``s`` of ``pp`` holds
  ``L/pp`` layers, or with ``num_layers_in_first/last_pipeline_stage`` those on the first and last stage
  and the rest split evenly; numbered from 0 locally.
- Transformer Engine's layer spec fuses the input and pre-MLP norms into ``linear_qkv`` and ``linear_fc1``
  (``layer_norm_weight``, registered before the linear's weight: TransformerEngine d0067d0,
  transformer_engine/pytorch/module/layernorm_linear.py ``LayerNormLinear.__init__``).

Registration order (``named_parameters``, which DistributedDataParallel walks): gpt_model.py builds the
embedding, the decoder (per layer: transformer_layer.py input norm, attention.py ``linear_proj`` in
``Attention.__init__`` before ``linear_qkv`` in ``SelfAttention.__init__``, pre-MLP norm, mlp.py
``linear_fc1`` then ``linear_fc2``; final norm) and the output layer; a linear layer registers its weight
before its bias. With tied embeddings and ``pp > 1`` the last stage holds a copy of the embedding as
``output_layer.weight`` (language_module.py ``setup_embeddings_and_output_layer``), and that copy and
the first stage's embedding are marked ``shared_embedding``.

The distributed optimizer's buffer (one per dtype; one here):

- megatron/core/optimizer/distrib_optimizer.py ``DistributedOptimizer._compute_per_buffer_param_layout``:
  parameters in reverse registration order; each start padded to a multiple of 64
  (optimizer/param_layout.py ``pad_param_start``); a ``shared_embedding`` parameter closes the bucket
  before it and gets its own; a bucket closes once ``param_end - bucket_start >= bucket_size``; each
  bucket's end is padded to ``lcm(dp, 128)`` (``pad_bucket_end``, ``bucket_end_divisor``; with
  ``pad_buckets_for_high_nccl_busbw`` ``lcm(dp, 128, 2**16)``).
- megatron/core/distributed/distributed_data_parallel.py: ``bucket_size`` is None (one bucket) on every
  pipeline stage but the first, and without ``overlap_grad_reduce``.
- distrib_optimizer.py ``_build_model_gbuf_range`` and ``get_parameter_state_dp_zero``: data-parallel rank
  ``d`` owns the contiguous ``d``-th ``1/dp`` of every bucket; its ``local_shards[key]`` (``param``, the
  fp32 main parameters, and each optimizer state) hold the owned range of the bucket, gaps zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import megatron_qkv


@dataclass(frozen=True)
class GPT:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    hidden: int
    ffn_hidden: int
    vocab_size: int
    make_vocab_size_divisible_by: int = 128
    bias: bool = False
    tied: bool = False
    te: bool = False  # Transformer Engine's layer spec: the norms fused into linear_qkv and linear_fc1
    first_stage_layers: int | None = None  # num_layers_in_first_pipeline_stage
    last_stage_layers: int | None = None  # num_layers_in_last_pipeline_stage

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


def logical_names(c: GPT) -> list[tuple[str, tuple[int, ...]]]:
    """The framework-neutral logical tensors of the model (QKV as [all Q; all K; all V], unpadded
    vocabulary, global layer numbers)."""
    hd, qkv = c.head_dim, (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
    out = [("embedding.word_embeddings.weight", (c.vocab_size, c.hidden))]
    for i in range(c.num_layers):
        p = f"decoder.layers.{i}."
        out += [
            (
                p + ("self_attention.linear_qkv.layer_norm_weight" if c.te else "input_layernorm.weight"),
                (c.hidden,),
            ),
            (p + "self_attention.linear_proj.weight", (c.hidden, c.num_heads * hd)),
            (p + "self_attention.linear_qkv.weight", (qkv, c.hidden)),
            (p + ("mlp.linear_fc1.layer_norm_weight" if c.te else "pre_mlp_layernorm.weight"), (c.hidden,)),
            (p + "mlp.linear_fc1.weight", (2 * c.ffn_hidden, c.hidden)),
            (p + "mlp.linear_fc2.weight", (c.hidden, c.ffn_hidden)),
        ]
        if c.bias:
            out += [
                (p + "self_attention.linear_proj.bias", (c.hidden,)),
                (p + "self_attention.linear_qkv.bias", (qkv,)),
                (p + "mlp.linear_fc1.bias", (2 * c.ffn_hidden,)),
                (p + "mlp.linear_fc2.bias", (c.hidden,)),
            ]
    out.append(("decoder.final_layernorm.weight", (c.hidden,)))
    if not c.tied:
        out.append(("output_layer.weight", (c.vocab_size, c.hidden)))
    return out


def _vocab_rows(c: GPT, t: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    multiple = c.make_vocab_size_divisible_by * tp
    padded = -(-c.vocab_size // multiple) * multiple
    full = torch.zeros((padded, *t.shape[1:]), dtype=t.dtype)
    full[: t.shape[0]] = t
    return full.chunk(tp, 0)[r].clone()


def tp_local(c: GPT, name: str, t: torch.Tensor, tp: int, r: int) -> torch.Tensor:
    """What tensor-parallel rank ``r`` holds of logical tensor ``name`` (a parameter or a state of it)."""
    if name.endswith("layer_norm_weight"):  # TE's fused norm: replicated, as every norm
        return t.clone()
    if name.endswith("word_embeddings.weight") or name == "output_layer.weight":
        return _vocab_rows(c, t, tp, r)
    if "linear_qkv" in name:
        nq, nk = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        return megatron_qkv.rank_local(
            t[:nq], t[nq : nq + nk], t[nq + nk :], c.num_heads, c.num_kv_heads, tp, r
        )
    if "linear_fc1" in name:
        gate, up = t.chunk(2, 0)
        return torch.cat([gate.chunk(tp, 0)[r], up.chunk(tp, 0)[r]], 0)
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return t.chunk(tp, 1)[r].clone()
    return t.clone()  # norms, row-parallel biases


def stage_layers(c: GPT, pp: int) -> list[int]:
    """The first global layer of each stage, and the end: transformer_block.py ``get_num_layers_to_build``
    (uniform, or ``num_layers_in_first/last_pipeline_stage`` with the rest split evenly)."""
    left, stages = c.num_layers, pp
    for n in (c.first_stage_layers, c.last_stage_layers):
        if n is not None:
            left, stages = left - n, stages - 1
    per = left // stages if stages else 0
    counts = [per] * pp
    if c.first_stage_layers is not None:
        counts[0] = c.first_stage_layers
    if c.last_stage_layers is not None:
        counts[-1] = c.last_stage_layers
    return [sum(counts[:s]) for s in range(pp + 1)]


def stage_params(c: GPT, pp: int, s: int) -> list[tuple[str, str]]:
    """(Megatron's local name, logical name) of stage ``s``'s parameters, in registration order."""
    bounds = stage_layers(c, pp)
    out = []
    if s == 0:
        out.append(("embedding.word_embeddings.weight", "embedding.word_embeddings.weight"))
    layer = [
        *([] if c.te else ["input_layernorm.weight"]),
        "self_attention.linear_proj.weight",
        *(["self_attention.linear_proj.bias"] if c.bias else []),
        *(["self_attention.linear_qkv.layer_norm_weight"] if c.te else []),
        "self_attention.linear_qkv.weight",
        *(["self_attention.linear_qkv.bias"] if c.bias else []),
        "mlp.linear_fc1.layer_norm_weight" if c.te else "pre_mlp_layernorm.weight",
        "mlp.linear_fc1.weight",
        *(["mlp.linear_fc1.bias"] if c.bias else []),
        "mlp.linear_fc2.weight",
        *(["mlp.linear_fc2.bias"] if c.bias else []),
    ]
    for j in range(bounds[s + 1] - bounds[s]):
        lp, gp = f"decoder.layers.{j}.", f"decoder.layers.{bounds[s] + j}."
        out += [(lp + suffix, gp + suffix) for suffix in layer]
    if s == pp - 1:
        out.append(("decoder.final_layernorm.weight", "decoder.final_layernorm.weight"))
        if not c.tied:
            out.append(("output_layer.weight", "output_layer.weight"))
        elif pp > 1:
            out.append(("output_layer.weight", "embedding.word_embeddings.weight"))  # the tied copy
    return out


def buffer_layout(
    numels: list[int], shared: list[bool], bucket_size: int | None, dp: int, high_busbw: bool = False
) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(start, end) of each parameter (registration order) and of each bucket in the buffer, as
    ``_compute_per_buffer_param_layout`` computes them."""
    divisor = math.lcm(dp, 128, 2**16) if high_busbw else math.lcm(dp, 128)

    def pad_start(i: int) -> int:
        return -(-i // 64) * 64

    def pad_end(i: int) -> int:
        return -(-i // divisor) * divisor

    index: dict[int, tuple[int, int]] = {}
    buckets: list[tuple[int, int]] = []
    param_start = bucket_start = 0
    in_bucket = 0
    param_end = 0
    for p in reversed(range(len(numels))):
        param_start = pad_start(param_start)
        if shared[p] and in_bucket:
            buckets.append((bucket_start, pad_end(param_start)))
            bucket_start = param_start = buckets[-1][1]
            in_bucket = 0
        param_end = param_start + numels[p]
        index[p] = (param_start, param_end)
        in_bucket += 1
        if (bucket_size is not None and param_end - bucket_start >= bucket_size) or shared[p]:
            buckets.append((bucket_start, pad_end(param_end)))
            bucket_start = param_start = buckets[-1][1]
            in_bucket = 0
        else:
            param_start = param_end
    if in_bucket:
        buckets.append((bucket_start, pad_end(param_end)))
    return [index[p] for p in range(len(numels))], buckets


def rank_state(
    c: GPT,
    logical: dict[str, torch.Tensor],
    states: tuple[str, ...],
    *,
    tp: int,
    pp: int,
    dp: int,
    rank: int,
    bucket_size: int | None = None,
    high_busbw: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """What global rank ``rank`` of a (pp, dp, tp) job holds (tp fastest, then dp, then pp, as Megatron
    orders ranks): its model tensors by Megatron's local name, and for each bucket ``b`` its
    ``local_shards`` (state -> 1-D tensor). ``logical`` holds ``model/<name>`` and
    ``optim/state/<name>/<state>``."""
    r, d, s = rank % tp, rank // tp % dp, rank // (tp * dp)
    params = stage_params(c, pp, s)
    model = {local: tp_local(c, name, logical["model/" + name], tp, r) for local, name in params}
    numels = [model[local].numel() for local, _ in params]
    shared = [c.tied and pp > 1 and name == "embedding.word_embeddings.weight" for _, name in params]
    index, buckets = buffer_layout(numels, shared, bucket_size if s == 0 else None, dp, high_busbw)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for b, (b0, b1) in enumerate(buckets):
        shard = (b1 - b0) // dp
        lo, hi = b0 + d * shard, b0 + (d + 1) * shard
        out[b] = {}
        for state in states:
            whole = torch.zeros(b1 - b0, dtype=torch.float32)
            for (_, name), (p0, p1) in zip(params, index, strict=True):
                if b0 <= p0 < b1:
                    t = tp_local(c, name, logical[f"optim/state/{name}/{state}"], tp, r)
                    whole[p0 - b0 : p1 - b0] = t.reshape(-1)
            out[b][state] = whole[lo - b0 : hi - b0].clone()
    return model, out
