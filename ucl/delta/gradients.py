"""Gradient records (spec/delta.md §8): fingerprint an optimizer, compare fingerprints, replay a step.

A step stored as gradients is rebuilt by loading its parent's parameters and optimizer state, setting
each parameter's ``.grad`` and running one ``optimizer.step()``. That is bit-exact only when the
replaying optimizer is the one that ran (same torch, class, options, kernels, dtype, device): the
fingerprint records those, and :func:`fingerprint_mismatches` says which differ.
"""

from __future__ import annotations

import importlib
import json
import warnings
from collections.abc import Mapping
from typing import Any

from ucl.errors import DeltaChainError, InvalidArgumentError, UnknownExtensionError
from ucl.format import structure
from ucl.format.records import GradientRecords, OptimizerFingerprint

__all__ = [
    "GradientTracker",
    "ReplayWarning",
    "fingerprint_mismatches",
    "optimizer_fingerprint",
    "register_optimizer",
    "replay_records",
    "replay_step",
]


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
        (``fused``, ``foreach`` or ``for-loop``), the first parameter's dtype, and the device:
        ``cuda:<device name>``, or ``cpu:<ATen CPU capability>`` such as ``cpu:AVX2`` (the vectorised
        kernels, and so the rounding, differ between capabilities).
    """
    import torch

    params = [p for g in optimizer.param_groups for p in g["params"]]
    if not params:
        raise InvalidArgumentError("optimizer_fingerprint: the optimizer has no parameters")
    p0 = params[0]
    device = p0.device.type
    if device == "cuda":
        device = f"cuda:{torch.cuda.get_device_name(p0.device)}"
    elif device == "cpu":  # the kernels ATen dispatches to (vector width, FMA) depend on it, not the model
        device = f"cpu:{torch.backends.cpu.get_cpu_capability()}"
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


# -- writing: when may a save be stored as the gradients of one optimizer step ------------------------
def _params(optimizer: Any) -> list[Any]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def _hyper(optimizer: Any) -> list[dict[str, Any]] | None:
    """The groups' hyperparameters as JSON values, or None when one is not JSON (it could not be replayed)."""
    out = []
    for g in optimizer.param_groups:
        h = {k: _json_value(v) for k, v in g.items() if k != "params"}
        try:
            json.dumps(h, allow_nan=False)
        except (TypeError, ValueError):
            return None
        if any(isinstance(v, str) and v.startswith("<") for v in h.values()):  # repr() of an object
            return None
        out.append(h)
    return out


class GradientTracker:
    """Watches an optimizer (step pre/post hooks) so that a save can be stored as gradient records.

    A save of step t may store the gradients of the optimizer step that led to it, instead of the state,
    only when replaying that step on the previous save reproduces the state bit for bit. The tracker
    checks what it can cheaply: exactly one ``optimizer.step()`` ran since the previous save; the
    parameters and optimizer state were not modified between that save and the step, nor after the
    step (``Tensor._version``); each ``.grad`` is the tensor the step used, unmodified. It also records
    the hyperparameters the step ran with (a scheduler may change them right after).
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.steps = 0
        self._saved_at: int | None = None  # self.steps at the last save
        self._saved_versions: tuple[int, ...] | None = None
        self._dirty = False
        self._after: tuple[tuple[int, ...], tuple[Any, ...], list[dict[str, Any]] | None] | None = None
        self._hooks = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def _versions(self) -> tuple[int, ...]:
        out = []
        for p in _params(self.optimizer):
            out.append(p._version)
            for v in self.optimizer.state.get(p, {}).values():
                if hasattr(v, "_version"):
                    out.append(v._version)
        return tuple(out)

    def _grads(self) -> tuple[Any, ...]:
        return tuple(None if p.grad is None else (id(p.grad), p.grad.data_ptr(), p.grad._version)
                     for p in _params(self.optimizer))

    def _pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._saved_versions is not None and self._versions() != self._saved_versions:
            self._dirty = True  # the state changed between the save and this step: a replay would differ

    def _post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        self._after = (self._versions(), self._grads(), _hyper(optimizer))

    def check(self) -> str | None:
        """None when the state now is one recorded optimizer step after the previous save, else why not."""
        if self._saved_at is None:
            return "no previous save"
        if self.steps - self._saved_at != 1:
            return f"{self.steps - self._saved_at} optimizer steps since the previous save (gradient records need 1)"
        if self._dirty:
            return "the parameters or optimizer state changed between the previous save and the step"
        assert self._after is not None
        versions, grads, hyper = self._after
        if self._versions() != versions:
            return "the parameters or optimizer state changed after the optimizer step"
        if self._grads() != grads:
            return "the gradients changed after the optimizer step (zero_grad before save?)"
        if all(g is None for g in grads):
            return "no parameter has a gradient"
        if hyper is None:
            return "a hyperparameter is not a JSON value"
        return None

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The hyperparameters the last step ran with."""
        assert self._after is not None and self._after[2] is not None
        return self._after[2]

    def saved(self) -> None:
        """Call when a save has staged the state (every save, whatever it stores)."""
        self._saved_at = self.steps
        self._saved_versions = self._versions()
        self._dirty = False


def locate(optimizer: Any, tensors: Mapping[str, Any]) -> tuple[list[str], str | None]:
    """The state's names of the optimizer's parameters (state_dict order) and the tree prefix of its
    ``state_dict()`` (None before its first step), found by storage identity.

    Raises
    ------
    InvalidArgumentError
        A parameter or a state tensor is not a tensor of the saved state, or the state tensors are not
        laid out as ``optimizer.state_dict()`` lays them out.
    """
    by_ptr: dict[tuple[Any, ...], str] = {}
    for name, t in tensors.items():
        by_ptr.setdefault((t.data_ptr(), tuple(t.shape), t.dtype, t.device), name)
    params = _params(optimizer)
    names_ = []
    for i, p in enumerate(params):
        n = by_ptr.get((p.data_ptr(), tuple(p.shape), p.dtype, p.device))
        if n is None:
            raise InvalidArgumentError(
                f"gradient records: optimizer parameter {i} ({list(p.shape)} {p.dtype}) is not a tensor of the "
                "saved state; save the model's state_dict() beside the optimizer's"
            )
        names_.append(n)
    prefix = None
    for i, p in enumerate(params):
        for k, v in optimizer.state.get(p, {}).items():
            if not hasattr(v, "data_ptr"):
                continue
            n = by_ptr.get((v.data_ptr(), tuple(v.shape), v.dtype, v.device))
            suffix = f"/state/{i}/{k}"
            if n is None or not n.endswith(suffix) or (prefix is not None and n[: -len(suffix)] != prefix):
                raise InvalidArgumentError(
                    f"gradient records: the optimizer's state {k!r} of parameter {i} is not in the saved state as "
                    f"<prefix>{suffix}; save optimizer.state_dict() in the state"
                )
            prefix = n[: -len(suffix)]
    return names_, prefix


# -- reading: replaying the recorded step ------------------------------------------------------------
class ReplayWarning(UserWarning):
    """A gradient-record step was loaded although its optimizer fingerprint does not match: approximate."""


_OPTIMIZERS: dict[str, Any] = {}


def register_optimizer(cls: Any) -> Any:
    """Allow replaying an optimizer class outside ``torch.optim`` (usable as a class decorator).

    Readers import only ``torch.optim`` classes by the name a checkpoint records; others must be
    registered, so that opening a checkpoint never imports a module it names.
    """
    _OPTIMIZERS[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return cls


def _optimizer_class(name: str) -> Any:
    import torch

    if name in _OPTIMIZERS:
        return _OPTIMIZERS[name]
    module, _, cls_name = name.rpartition(".")
    if module != "torch.optim" and not module.startswith("torch.optim."):
        raise UnknownExtensionError(
            f"gradient records: optimizer {name!r} is not in torch.optim; register it with "
            "ucl.delta.gradients.register_optimizer to replay it"
        )
    try:
        cls = getattr(importlib.import_module(module), cls_name)
    except (ImportError, AttributeError):
        raise UnknownExtensionError(f"gradient records: this torch has no optimizer {name!r}") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise UnknownExtensionError(f"gradient records: {name!r} is not a torch optimizer")
    return cls


def _construct(cls: Any, groups: list[dict[str, Any]], options: Mapping[str, Any]) -> Any:
    import inspect

    accepted: Mapping[str, Any]
    try:
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        accepted = {}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in options.items() if k in accepted}
    return cls(groups, **kw)


def _at(state: Any, prefix: str) -> Any:
    node = state
    for seg in prefix.split("/"):
        if isinstance(node, Mapping) and seg in node:
            node = node[seg]
        elif isinstance(node, Mapping) and seg.isdigit() and int(seg) in node:  # noqa: SIM114 - an arm per container
            node = node[int(seg)]
        elif isinstance(node, list | tuple) and seg.isdigit() and int(seg) < len(node):
            node = node[int(seg)]
        else:
            raise UnknownExtensionError(f"gradient records: the parent has no optimizer state at {prefix!r}")
    if not (isinstance(node, Mapping) and "state" in node and "param_groups" in node):
        raise UnknownExtensionError(f"gradient records: {prefix!r} of the parent is not an optimizer state_dict")
    return node


def replay_records(
    rec: GradientRecords, parent_state: Any, parent_tensors: Mapping[str, Any], grads: Mapping[str, Any],
    *, approximate: bool = False, what: str = "gradient records",
) -> tuple[dict[str, Any], list[str]]:
    """Rebuild a gradient-record step's parameters and optimizer state (spec/delta.md §8.1-§8.2).

    Parameters
    ----------
    rec
        The step's extension configuration.
    parent_state, parent_tensors
        The parent step's state dict (nested, as loaded) and its tensors by flat name.
    grads
        The stored gradients by parameter name (parameters without one had no gradient).
    approximate
        Replay even when the fingerprint does not match this environment (a :class:`ReplayWarning`
        names the fields); otherwise that is an UnknownExtensionError.

    Returns
    -------
    (tensors, mismatches)
        The replayed tensors by flat name (the parameters and ``<optimizer_state>/state/...``) and the
        fingerprint fields that differ (empty: the result is exact).
    """
    import torch


    cls = _optimizer_class(rec.fingerprint.optimizer)
    sd = _at(parent_state, rec.optimizer_state)
    missing = [n for n in rec.parameters if n not in parent_tensors]
    if missing:
        raise UnknownExtensionError(f"{what}: the parent has no parameter {missing[0]!r}", tensor=missing[0])
    device = "cpu"
    if rec.fingerprint.device.startswith("cuda") and torch.cuda.is_available():
        device = "cuda"
    params = [torch.nn.Parameter(parent_tensors[n].detach().to(device, copy=True)) for n in rec.parameters]
    groups = []
    for g in sd["param_groups"]:
        idx = g.get("params", [])
        if not all(isinstance(i, int) and 0 <= i < len(params) for i in idx):
            raise UnknownExtensionError(f"{what}: the parent's param_groups name parameters outside the record")
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [params[i] for i in idx]})
    if len(groups) != len(rec.param_groups):
        raise UnknownExtensionError(
            f"{what}: {len(rec.param_groups)} recorded param groups, the parent has {len(groups)}"
        )
    opt = _construct(cls, groups, rec.fingerprint.options)
    opt.load_state_dict(sd)
    for group, hyper in zip(opt.param_groups, rec.param_groups, strict=True):
        for k, v in hyper.items():
            cur = group.get(k)
            if isinstance(cur, torch.Tensor):
                cur.fill_(v)
            else:
                group[k] = tuple(v) if isinstance(cur, tuple) and isinstance(v, list) else v
    mismatches = fingerprint_mismatches(rec.fingerprint, optimizer_fingerprint(opt))
    if mismatches:
        if not approximate:
            raise UnknownExtensionError(
                f"{what}: the optimizer fingerprint differs in {', '.join(mismatches)}; a replay here would not "
                "be bit-exact (open with approximate=True to load it anyway)"
            )
        warnings.warn(f"{what}: loaded approximately, the optimizer fingerprint differs in {', '.join(mismatches)}",
                      ReplayWarning, stacklevel=3)
    for n, p in zip(rec.parameters, params, strict=True):
        g = grads.get(n)
        if g is not None and (tuple(g.shape) != tuple(p.shape) or g.dtype != p.dtype):
            raise DeltaChainError(f"{what}: the gradient of {n!r} is {list(g.shape)} {g.dtype}, the parameter in step "
                                  f"{rec.base_step} is {list(p.shape)} {p.dtype}", tensor=n)
    by_param = {n: grads[n].to(device) for n in rec.parameters if n in grads}
    with torch.no_grad():
        replay_step(opt, dict(zip(rec.parameters, params, strict=True)), by_param)
    out: dict[str, Any] = {n: p.detach().cpu() for n, p in zip(rec.parameters, params, strict=True)}
    nested: Any = {"state": opt.state_dict()["state"]}
    for seg in reversed(rec.optimizer_state.split("/")):
        nested = {seg: nested}
    flat, _ = structure.flatten(nested)
    out.update({n: t.detach().cpu() for n, t in flat.items()})
    return out, mismatches
