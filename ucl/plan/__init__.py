"""Planning, pure (no I/O): which shards a rank writes (:mod:`ucl.plan.save`, and under a layout
:mod:`ucl.plan.layout_save`), which stored boxes a target rank reads (:mod:`ucl.plan.layout_load`), the
frozen items both speak in (:mod:`ucl.plan.items`), and box copies into destination tensors
(:mod:`ucl.plan.copies`).

>>> from ucl.layout import parse_layout, Mesh
>>> from ucl.plan import plan_save
>>> layout = parse_layout('ucl-layout 1\\n"**.weight": shard(0, tp)\\n')
>>> plan = plan_save(layout, Mesh.of(tp=2), 0, {"model/w.weight": ((5, 3), "float32")})
>>> [(w.array.name, w.chunk_index) for w in plan.writes]
[('model/w.weight', (0, 0))]
"""

from ucl.plan.items import ArraySpec, LoadPlan, RankPlan, ReadItem, ShardWrite
from ucl.plan.layout_load import LogicalIndex, logical_read, logical_tensors, plan_load
from ucl.plan.layout_save import infer_shapes, merge_plans, plan_save, stored_chunks

__all__ = ["ArraySpec", "LoadPlan", "LogicalIndex", "RankPlan", "ReadItem", "ShardWrite", "infer_shapes",
           "logical_read", "logical_tensors", "merge_plans", "plan_load", "plan_save", "stored_chunks"]
