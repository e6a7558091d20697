"""Deprecated: ``ucl.policy`` is now ``ucl.DeltaPolicy`` / ``ucl.AdaptiveInterval`` (ucl/write/policy.py)."""

from ucl._deprecated import alias

__getattr__ = alias("ucl.policy", {
    "DeltaPolicy": "ucl:DeltaPolicy",
    "AdaptiveInterval": "ucl:AdaptiveInterval",
    "young_interval": "ucl.write.policy:young_interval",
    "daly_interval": "ucl.write.policy:daly_interval",
})
