"""An independent reference of Megatron-core's fused QKV, as each tensor-parallel rank holds it, written
from Megatron-LM's source at commit d98e8a64ddf34856e74b24714e3bedb2f5a39553 (2026-08-22):

- megatron/core/transformer/attention.py, ``SelfAttention.__init__``: ``linear_qkv`` is a column-parallel
  linear of ``query_projection_size + 2 * kv_projection_size`` outputs (weight and, with
  ``add_qkv_bias``, bias).
- the same file, ``SelfAttention.get_query_key_value_tensors``: the output is viewed as
  ``[sq, b, ng, (np/ng + 2) * hn]`` and split into ``np/ng * hn`` query rows, then ``hn`` key rows, then
  ``hn`` value rows per query group; the query heads of a group are consecutive heads
  (``query.reshape(..., -1, hn)``). With fewer groups than TP ranks (``num_query_groups < world_size``)
  the ranks' outputs are all-gathered, the group ``rank // (tp / ng)`` sliced out, and of its query heads
  the ``rank % (tp / ng)``-th ``np/tp`` taken. ``SelfAttention._clip_linear_qkv`` views a rank's weight
  the same way: ``[groups per partition, q + k + v rows per group, hidden]``.
- megatron/core/tensor_parallel/layers.py, ``ColumnParallelLinear`` and ``_initialize_affine_weight_cpu``:
  ``output_size_per_partition = divide(output_size, tp)``; the master weight is ``torch.split`` into pieces
  of that size along dim 0 (stride 1) and rank r keeps piece r: a contiguous row range.

Nothing here uses ucl's layout code: the tests compare ucl against these functions.
"""

from __future__ import annotations

import torch


def allowed(num_heads: int, groups: int, tp: int) -> bool:
    """The TP sizes Megatron-core accepts for this attention (``divide`` asserts divisibility)."""
    return num_heads % tp == 0 and num_heads % groups == 0 and (groups % tp == 0 or tp % groups == 0)


def master(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, groups: int) -> torch.Tensor:
    """The unsplit ``linear_qkv`` weight (or bias) from natural Q (all heads), K and V (all groups):
    per group, its ``num_heads / groups`` query heads, then its key, then its value rows."""
    hd = q.shape[0] // num_heads
    per = num_heads // groups
    rows = []
    for g in range(groups):
        rows.append(q[g * per * hd:(g + 1) * per * hd])
        rows.append(k[g * hd:(g + 1) * hd])
        rows.append(v[g * hd:(g + 1) * hd])
    return torch.cat(rows, 0)


def rank_local(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, num_heads: int, groups: int, tp: int,
               rank: int) -> torch.Tensor:
    """What TP rank ``rank`` of ``tp`` holds: piece ``rank`` of the master weight split into ``tp``."""
    m = master(q, k, v, num_heads, groups)
    return torch.split(m, m.shape[0] // tp, dim=0)[rank].clone()


def forward_heads(locals_: list[torch.Tensor], num_heads: int, groups: int, hd: int,
                  rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron's get_query_key_value_tensors on the weights' rows (a row of the weight is an output
    feature): the (query heads, key, value) rows rank ``rank`` computes attention with, in its order."""
    tp = len(locals_)
    mixed = locals_[rank]
    if groups < tp:
        gathered = torch.cat(locals_, 0)  # all_gather_last_dim_from_tensor_parallel_region
        idx = rank // (tp // groups)
        size = gathered.shape[0] // groups
        mixed = gathered[idx * size:(idx + 1) * size]
        groups_here, heads_here = 1, num_heads // groups
    else:
        groups_here, heads_here = groups // tp, num_heads // tp
    per = heads_here // groups_here
    view = mixed.reshape(groups_here, (per + 2) * hd, *mixed.shape[1:])
    query, key, value = torch.split(view, [per * hd, hd, hd], dim=1)
    query = query.reshape(-1, hd, *mixed.shape[1:])  # [heads, hd, ...]
    if groups < tp:
        idx = rank % (tp // groups)
        size = (num_heads // tp)
        query = query[idx * size:(idx + 1) * size]
    return query.reshape(-1, *mixed.shape[1:]), key.reshape(-1, *mixed.shape[1:]), value.reshape(-1, *mixed.shape[1:])
