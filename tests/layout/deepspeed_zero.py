"""An independent reference of DeepSpeed ZeRO's partitioned optimizer state, as each data-parallel rank
holds it, written from DeepSpeed's source at commit edaa7221267243c7be7fb49c5d5f5c4fb97b4641. Nothing here
uses ucl's layout code; the tests compare ucl against these functions.

- ZeRO-1/2, deepspeed/runtime/zero/stage_1_and_2.py ``DeepSpeedZeroOptimizer.__init__``: per parameter
  group, its trainable parameters in order (``round_robin_gradients`` off) are flattened by
  ``flatten_dense_tensors_aligned(..., alignment)`` with ``alignment = nccl_start_alignment_factor (2) *
  dp``, which appends one zero tensor so the total is a multiple of ``alignment`` (runtime/utils.py
  ``align_dense_tensors``); ``get_data_parallel_partitions`` cuts the flat group into ``dp`` partitions
  (``base_size = total // dp``, the first ``total % dp`` one element longer); rank ``d``'s
  ``single_partition_of_fp32_groups[g]`` is partition ``d`` in fp32, and the base optimizer's state
  (``exp_avg``, ``exp_avg_sq``) is over that one flat parameter.
- ZeRO-3, runtime/zero/partition_parameters.py ``_partition_param``: each parameter's flattened data is
  padded to ``_aligned_size = numel + _padding_size`` (a multiple of ``dp``) and rank ``d`` keeps
  ``[d * partition_size, (d + 1) * partition_size)``, ``partition_size = aligned // dp``, as
  ``param.ds_tensor``; the optimizer's fp32 group concatenates the ranks' ``ds_tensor`` pieces.
"""

from __future__ import annotations

import torch


def align_dense_tensors(tensors: list[torch.Tensor], alignment: int) -> list[torch.Tensor]:
    n = sum(t.numel() for t in tensors)
    remaining = n % alignment
    if remaining:
        return [*tensors, torch.zeros(alignment - remaining, dtype=tensors[0].dtype)]
    return tensors


def data_parallel_partitions(flat: torch.Tensor, dp: int) -> list[torch.Tensor]:
    base, remaining = flat.numel() // dp, flat.numel() % dp
    out, start = [], 0
    for i in range(dp):
        size = base + (1 if i < remaining else 0)
        out.append(flat.narrow(0, start, size))
        start += size
    return out


def stage12_partition(group: list[torch.Tensor], dp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s fp32 partition of one parameter group (or of one optimizer state over it)."""
    flat = torch.cat([t.reshape(-1) for t in align_dense_tensors(list(group), 2 * dp)])
    return data_parallel_partitions(flat, dp)[rank].to(torch.float32).clone()


def stage3_piece(t: torch.Tensor, dp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``ds_tensor`` of one parameter (or of one optimizer state of it)."""
    pad = (dp - t.numel() % dp) % dp
    flat = torch.cat([t.reshape(-1), torch.zeros(pad, dtype=t.dtype)])
    size = flat.numel() // dp
    return flat[rank * size : (rank + 1) * size].to(torch.float32).clone()
