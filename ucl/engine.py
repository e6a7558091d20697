"""Deprecated: ``ucl.engine`` is now ``ucl.CheckpointManager`` (ucl/write/manager.py)."""

from ucl._deprecated import alias

__getattr__ = alias("ucl.engine", {"CheckpointManager": "ucl:CheckpointManager", "SaveHandle": "ucl:SaveHandle"})
