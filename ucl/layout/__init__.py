"""The UCL layout language (spec/layout.md): the model of a layout (rules per tensor pattern: sharding
per mesh axis, fused parts, padding, flat fragments, renumbering), its text syntax, meshes, and the
builtins of real frameworks. Pure: no I/O, no torch.distributed. Planning with a layout (which boxes a
rank writes and reads) is :mod:`ucl.plan`.

>>> from ucl.layout import format_layout, parse_layout
>>> layout = parse_layout('ucl-layout 1\\n"**.weight": shard(0, tp)\\n')
>>> format_layout(layout).splitlines()[-1]
'"**.weight": shard(0, tp)'
"""

from ucl.layout.args import as_layout, as_mesh
from ucl.layout.boxes import Box
from ucl.layout.builtins import BUILTINS, builtin, megatron_gpt, zero_flat
from ucl.layout.dtensor import layout_from_dtensors, mesh_rank
from ucl.layout.mesh import Mesh, parse_mesh
from ucl.layout.model import (
    Flat,
    Fused,
    Grouped,
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
from ucl.layout.syntax import format_layout, parse_layout
from ucl.layout.views import VIEWS, HFLlama, Take, as_view

__all__ = [
    "BUILTINS",
    "VIEWS",
    "HFLlama",
    "Take",
    "as_view",
    "Box",
    "Flat",
    "Fused",
    "Grouped",
    "Layout",
    "Mesh",
    "Pad",
    "Part",
    "Partial",
    "Renumber",
    "Replicate",
    "Rule",
    "Shard",
    "Size",
    "as_layout",
    "as_mesh",
    "builtin",
    "check_mesh",
    "format_layout",
    "layout_from_dtensors",
    "megatron_gpt",
    "mesh_rank",
    "parse_layout",
    "parse_mesh",
    "zero_flat",
]
