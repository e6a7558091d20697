"""Deprecated: ``ucl.reshard`` is now ``ucl.load`` / ``ucl.load_into`` / ``ucl.save_sharded``."""

from ucl._deprecated import alias

__getattr__ = alias("ucl.reshard", {
    "load": "ucl:load",
    "load_into": "ucl:load_into",
    "load_plan": "ucl.read.load:load_plan",
    "save_sharded": "ucl:save_sharded",
})
