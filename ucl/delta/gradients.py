"""Gradient records (spec/delta.md §8): fingerprint an optimizer, compare fingerprints, replay a step.

A step stored as gradients is rebuilt by loading its parent's parameters and optimizer state, setting
each parameter's ``.grad`` and running one ``optimizer.step()``. That is bit-exact only when the
replaying optimizer is the one that ran (same torch, class, options, kernels, dtype, device): the
fingerprint records those, and :func:`fingerprint_mismatches` says which differ.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ucl.delta.records import OptimizerFingerprint
from ucl.errors import InvalidArgumentError

__all__ = ["fingerprint_mismatches", "optimizer_fingerprint", "replay_step"]


def _json_value(v: Any) -> Any:
    try:
        import torch

        if isinstance(v, torch.Tensor):
            return v.item() if v.numel() == 1 else v.tolist()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    if isinstance(v, tuple):
        return [_json_value(x) for x in v]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, list):
        return [_json_value(x) for x in v]
    return repr(v)


def _implementation(optimizer: Any) -> str:
    d = optimizer.defaults
    if d.get("fused"):
        return "fused"
    if d.get("foreach") is not None:
        return "foreach" if d["foreach"] else "for-loop"
    # foreach=None: torch picks per call; ask it the way optimizer.step() does
    params = [p for g in optimizer.param_groups for p in g["params"]]
    try:
        from torch.optim.optimizer import _default_to_fused_or_foreach

        _fused, foreach = _default_to_fused_or_foreach(
            params, d.get("differentiable", False), use_fused=False
        )
    except (ImportError, TypeError):  # pragma: no cover - older torch
        foreach = False
    return "foreach" if foreach else "for-loop"


def optimizer_fingerprint(optimizer: Any) -> OptimizerFingerprint:
    """The fingerprint of a ``torch.optim.Optimizer`` as it would run now.

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        With at least one parameter.

    Returns
    -------
    OptimizerFingerprint
        torch version, ``module.Class`` of the optimizer, its defaults as JSON values, the kernels
        (``fused``, ``foreach`` or ``for-loop``), the first parameter's dtype, and the device (``cpu`` or
        ``cuda:<device name>``).
    """
    import torch

    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise InvalidArgumentError("optimizer_fingerprint: the optimizer has no parameters")
    p0 = params[0]
    device = p0.device.type
    if device == "cuda":
        device = f"cuda:{torch.cuda.get_device_name(p0.device)}"
    cls = type(optimizer)
    options = {k: _json_value(v) for k, v in sorted(optimizer.defaults.items())}
    json.dumps(options)  # JSON by construction
    return OptimizerFingerprint(
        torch_version=torch.__version__,
        optimizer=f"{cls.__module__}.{cls.__qualname__}",
        options=options,
        implementation=_implementation(optimizer),
        dtype=str(p0.dtype).removeprefix("torch."),
        device=device,
    )


def fingerprint_mismatches(recorded: OptimizerFingerprint, current: OptimizerFingerprint) -> list[str]:
    """Names of the fields that differ (empty: a replay is exact); options are compared key by key."""
    out = [
        f
        for f in ("torch_version", "optimizer", "implementation", "dtype", "device")
        if getattr(recorded, f) != getattr(current, f)
    ]
    keys = sorted(set(recorded.options) | set(current.options))
    out += [f"options.{k}" for k in keys if recorded.options.get(k) != current.options.get(k)]
    return out


def replay_step(optimizer: Any, params: Mapping[str, Any], grads: Mapping[str, Any]) -> None:
    """Run one optimizer step with stored gradients (spec/delta.md §8.1.3).

    Parameters
    ----------
    optimizer : torch.optim.Optimizer
        Holding the parent step's state (``load_state_dict`` done by the caller).
    params : mapping of str to torch.nn.Parameter
        The parameters, by the names the gradients are stored under (without the prefix).
    grads : mapping of str to torch.Tensor
        The stored gradients; a parameter without one has no gradient in this step (``grad = None``).
    """
    unknown = sorted(set(grads) - set(params))
    if unknown:
        raise InvalidArgumentError(f"replay_step: gradients for unknown parameters {unknown[:5]}")
    for name, p in params.items():
        g = grads.get(name)
        if g is not None and (tuple(g.shape) != tuple(p.shape) or g.dtype != p.dtype):
            raise InvalidArgumentError(
                f"replay_step: gradient of {name!r} is {tuple(g.shape)} {g.dtype}, "
                f"the parameter is {tuple(p.shape)} {p.dtype}"
            )
        p.grad = None if g is None else g.detach().clone()
    optimizer.step()
