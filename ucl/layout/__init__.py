"""The UCL layout language (spec/layout.md): parse and print layouts, and plan which boxes each rank
writes and reads under any parallel configuration. Pure functions: no I/O, no torch.distributed.

>>> from ucl.layout import parse_layout, Mesh, plan_save
>>> layout = parse_layout('ucl-layout 1\\n"**.weight": shard(0, tp)\\n')
>>> local = {"model/w.weight": ((5, 3), "float32")}
>>> plan = plan_save(layout, Mesh.of(tp=2), 0, local)
>>> [(w.array.name, w.chunk_index) for w in plan.writes]
[('model/w.weight', (0, 0))]
"""

from ucl.layout.args import as_layout, as_mesh
from ucl.layout.boxes import Box
from ucl.layout.builtins import BUILTINS, builtin, megatron_gpt, zero_flat
from ucl.layout.dtensor import layout_from_dtensors, mesh_rank
from ucl.layout.mesh import Mesh, parse_mesh
from ucl.layout.model import (
    Flat,
    Fused,
    Layout,
    Pad,
    Part,
    Partial,
    Renumber,
    Replicate,
    Rule,
    Shard,
    Size,
    check_mesh,
)
from ucl.layout.planner import infer_shapes, merge_plans, plan_save, stored_chunks
from ucl.layout.plans import ArraySpec, LoadPlan, ReadItem, SavePlan, ShardWrite
from ucl.layout.reading import LogicalIndex, logical_read, logical_tensors, plan_load
from ucl.layout.reference import shard_local_state, unshard
from ucl.layout.syntax import format_layout, parse_layout

__all__ = [
    "BUILTINS",
    "ArraySpec",
    "Box",
    "Flat",
    "Fused",
    "Layout",
    "LoadPlan",
    "LogicalIndex",
    "Mesh",
    "Pad",
    "Part",
    "Partial",
    "ReadItem",
    "Renumber",
    "Replicate",
    "Rule",
    "SavePlan",
    "Shard",
    "ShardWrite",
    "Size",
    "as_layout",
    "as_mesh",
    "builtin",
    "check_mesh",
    "format_layout",
    "infer_shapes",
    "layout_from_dtensors",
    "logical_read",
    "logical_tensors",
    "megatron_gpt",
    "merge_plans",
    "mesh_rank",
    "parse_layout",
    "parse_mesh",
    "plan_load",
    "plan_save",
    "shard_local_state",
    "stored_chunks",
    "unshard",
    "zero_flat",
]
