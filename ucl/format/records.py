"""Delta metadata (spec/delta.md §3-§4, §8): frozen dataclasses <-> JSON, parsed field by field.

- :class:`DeltaRecord` is an array's ``attributes.ucl.delta``; :meth:`DeltaRecord.codec` is the matching
  inner codec ``{"name": "ucl.delta", "configuration": {...}}``.
- :class:`OptimizerFingerprint` and :class:`GradientRecords` describe the optional ``ucl.gradient_records``
  step extension (LowDiff-style: gradients plus what is needed to replay the optimizer).
- :class:`Composite` and :class:`StaleGroup` describe the ``ucl.composite`` step extension
  (spec/delta.md §9): the approximate marker of a composite step, naming its stale groups, the step
  each one's values come from and their age.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ucl.errors import FormatError, InconsistentMetadataError, SchemaError

__all__ = [
    "CODEC_NAME",
    "COMPOSITE",
    "Composite",
    "REFERENCE_MODES",
    "StaleGroup",
    "DeltaRecord",
    "GRADIENT_RECORDS",
    "GradientRecords",
    "OptimizerFingerprint",
    "parse_codec",
]

CODEC_NAME = "ucl.delta"
GRADIENT_RECORDS = "ucl.gradient_records"
COMPOSITE = "ucl.composite"
MODES = ("unchanged", "chunked", "stale")
#: Modes whose array stores no data: its values are the base step's (bit for bit: ``unchanged``; the
#: values of an older step standing in for this step's, in a composite step: ``stale``).
REFERENCE_MODES = ("unchanged", "stale")
ENCODINGS = ("xor", "sub")
_MAX_STEP = (1 << 63) - 1


def _int(v: Any, what: str, lo: int = 0, hi: int = _MAX_STEP) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise SchemaError(f"{what}: expected an integer in [{lo}, {hi}], found {v!r}")
    return v


def _keys(d: Any, what: str, required: set[str], optional: set[str] = frozenset()) -> dict[str, Any]:  # type: ignore[assignment]
    if not isinstance(d, dict):
        raise SchemaError(f"{what}: expected an object, found {type(d).__name__}")
    missing = required - d.keys()
    if missing:
        raise SchemaError(f"{what}: missing {sorted(missing)}")
    unknown = d.keys() - required - optional
    if unknown:
        raise SchemaError(f"{what}: unknown fields {sorted(unknown)} (readers fail closed, spec/delta.md §3)")
    return d


def _configuration(ext: Any, name: str, what: str, required: set[str], why: str = "") -> dict[str, Any]:
    """The checked ``configuration`` of a step extension that readers must understand (spec/core.md §9)."""
    _keys(ext, what, {"name", "configuration"}, {"must_understand"})
    if ext["name"] != name:
        raise SchemaError(f"{what}: name must be {name!r}")
    if ext.get("must_understand", True) is not True:
        raise SchemaError(f"{what}: must_understand must be true{why}")
    return _keys(ext["configuration"], f"{what} configuration", required)


@dataclass(frozen=True)
class DeltaRecord:
    """``attributes.ucl.delta`` of an array in a delta step.

    ``mode`` is ``"unchanged"`` (no data: the tensor equals the base step's, bit for bit),
    ``"chunked"`` (inner chunks encoded with the ``ucl.delta`` codec against ``base_step``; an absent
    inner chunk equals the base's) or ``"stale"`` (no data, and *not* exact: a composite step,
    spec/delta.md §9, left this tensor's group out and reads stand in ``base_step``'s values, ``age``
    steps old). ``encoding`` is the writer's choice for chunked arrays.
    """

    mode: str
    base_step: int
    encoding: str | None = None
    age: int | None = None  # stale records only: the step number minus base_step

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SchemaError(f"delta record: mode must be one of {MODES}, found {self.mode!r}")
        _int(self.base_step, "delta record: base_step")
        if self.mode == "chunked" and self.encoding not in ENCODINGS:
            raise SchemaError(
                f"delta record: a chunked array needs encoding in {ENCODINGS}, found {self.encoding!r}"
            )
        if self.mode in REFERENCE_MODES and self.encoding is not None:
            raise SchemaError(f"delta record: an {self.mode} array has no encoding")
        if self.mode == "stale":
            _int(self.age, "delta record: a stale array's age", lo=1)
        elif self.age is not None:
            raise SchemaError(f"delta record: only a stale array has an age, found one on a {self.mode} one")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": self.mode, "base_step": self.base_step}
        if self.encoding is not None:
            d["encoding"] = self.encoding
        if self.age is not None:
            d["age"] = self.age
        return d

    @classmethod
    def from_dict(cls, d: Any, what: str = "delta record") -> DeltaRecord:
        if isinstance(d, dict) and d.get("mode") == "stale":
            _keys(d, what, {"mode", "base_step", "age"})
        else:
            _keys(d, what, {"mode", "base_step"}, {"encoding"})
        if d["mode"] not in MODES:
            raise SchemaError(f"{what}: mode must be one of {MODES}, found {d['mode']!r}")
        try:
            return cls(
                mode=d["mode"],
                base_step=_int(d["base_step"], f"{what}: base_step"),
                encoding=d.get("encoding"),
                age=d.get("age"),
            )
        except SchemaError as e:
            raise SchemaError(f"{what}: {e.message}") from None

    def codec(self) -> dict[str, Any]:
        """The inner codec of a chunked array: ``{"name": "ucl.delta", "configuration": {...}}``."""
        if self.mode != "chunked":
            raise FormatError(f"delta record: an {self.mode} array has no codec (it stores no data)")
        return {"name": CODEC_NAME, "configuration": {"encoding": self.encoding, "base_step": self.base_step}}


def parse_codec(codec: Any, record: DeltaRecord, what: str = "ucl.delta codec") -> None:
    """Check an array's inner ``ucl.delta`` codec against its delta record (they MUST agree)."""
    _keys(codec, what, {"name", "configuration"}, {"must_understand"})
    if codec["name"] != CODEC_NAME:
        raise SchemaError(f"{what}: name must be {CODEC_NAME!r}, found {codec['name']!r}")
    if codec.get("must_understand", True) is not True:
        raise SchemaError(f"{what}: must_understand cannot be false (a reader must not skip the delta codec)")
    conf = _keys(codec["configuration"], f"{what} configuration", {"encoding", "base_step"})
    if record.mode != "chunked" or conf != {"encoding": record.encoding, "base_step": record.base_step}:
        raise InconsistentMetadataError(
            f"{what}: configuration {conf} disagrees with the array's delta record {record.to_dict()}"
        )


@dataclass(frozen=True)
class OptimizerFingerprint:
    """What must match for a replayed optimizer step to be bit-exact (spec/delta.md §8.2)."""

    torch_version: str
    optimizer: str  # class, e.g. "torch.optim.AdamW"
    options: dict[str, Any] = field(default_factory=dict)  # defaults of the param groups, JSON values
    implementation: str = "foreach"  # "foreach" | "fused" | "for-loop"
    dtype: str = "float32"
    device: str = "cpu"  # device type and model, e.g. "cpu", "cuda:NVIDIA H200"

    def to_dict(self) -> dict[str, Any]:
        return {
            "torch_version": self.torch_version,
            "optimizer": self.optimizer,
            "options": dict(self.options),
            "implementation": self.implementation,
            "dtype": self.dtype,
            "device": self.device,
        }

    @classmethod
    def from_dict(cls, d: Any, what: str = "optimizer fingerprint") -> OptimizerFingerprint:
        keys = {"torch_version", "optimizer", "options", "implementation", "dtype", "device"}
        _keys(d, what, keys)
        for k in keys - {"options"}:
            if not isinstance(d[k], str):
                raise SchemaError(f"{what}: {k} must be a string, found {d[k]!r}")
        if d["implementation"] not in ("foreach", "fused", "for-loop"):
            raise SchemaError(
                f"{what}: implementation must be foreach, fused or for-loop, found {d['implementation']!r}"
            )
        if not isinstance(d["options"], dict):
            raise SchemaError(f"{what}: options must be an object")
        return cls(**{k: d[k] for k in keys})


@dataclass(frozen=True)
class GradientRecords:
    """Configuration of the ``ucl.gradient_records`` step extension (spec/delta.md §8).

    ``parameters`` are the tensor names of the optimizer's parameters in its ``state_dict()`` order
    (parameter ``i`` is ``parameters[i]``; its gradient, when it had one, is the array
    ``gradients + parameters[i]``); ``optimizer_state`` is the tree prefix of ``optimizer.state_dict()``;
    ``param_groups`` are the hyperparameters each group ran the step with (``params`` left out).
    """

    base_step: int
    fingerprint: OptimizerFingerprint
    gradients: str = "grad/"  # prefix of the gradient tensors' names in the step
    parameters: tuple[str, ...] = ()
    optimizer_state: str = "optim"
    param_groups: tuple[dict[str, Any], ...] = ()

    def gradient_name(self, parameter: str) -> str:
        return self.gradients + parameter

    def replayed(self, tree_tensors: Any) -> set[str]:
        """The tensor names the replay defines: the parameters and the optimizer's per-parameter state."""
        state = self.optimizer_state + "/state/"
        return set(self.parameters) | {n for n in tree_tensors if n.startswith(state)}

    def to_extension(self) -> dict[str, Any]:
        return {
            "name": GRADIENT_RECORDS,
            "must_understand": True,
            "configuration": {
                "base_step": self.base_step,
                "gradients": self.gradients,
                "parameters": list(self.parameters),
                "optimizer_state": self.optimizer_state,
                "param_groups": [dict(g) for g in self.param_groups],
                "fingerprint": self.fingerprint.to_dict(),
            },
        }

    @classmethod
    def from_extension(cls, ext: Any, what: str = GRADIENT_RECORDS) -> GradientRecords:
        conf = _configuration(ext, GRADIENT_RECORDS, what, {"base_step", "gradients", "parameters",
                                                            "optimizer_state", "param_groups", "fingerprint"})
        if not isinstance(conf["gradients"], str) or not conf["gradients"]:
            raise SchemaError(f"{what}: gradients must be a non-empty string prefix")
        if not isinstance(conf["optimizer_state"], str) or not conf["optimizer_state"]:
            raise SchemaError(f"{what}: optimizer_state must be a non-empty tensor name prefix")
        params = conf["parameters"]
        if not isinstance(params, list) or not all(isinstance(p, str) and p for p in params):
            raise SchemaError(f"{what}: parameters must be a list of tensor names")
        if len(set(params)) != len(params):
            raise SchemaError(f"{what}: parameters name a tensor twice")
        groups = conf["param_groups"]
        if not isinstance(groups, list) or not groups or not all(isinstance(g, dict) and "params" not in g
                                                                 for g in groups):
            raise SchemaError(f"{what}: param_groups must be a non-empty list of objects without 'params'")
        return cls(
            base_step=_int(conf["base_step"], f"{what}: base_step"),
            gradients=conf["gradients"],
            fingerprint=OptimizerFingerprint.from_dict(conf["fingerprint"], f"{what}: fingerprint"),
            parameters=tuple(params),
            optimizer_state=conf["optimizer_state"],
            param_groups=tuple(dict(g) for g in groups),
        )


def _finite(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise SchemaError(f"{what}: expected a finite number >= 0, found {v!r}")
    return float(v)


@dataclass(frozen=True)
class StaleGroup:
    """One group a composite step left out: its tensors read as ``base_step``'s, ``age`` steps old.

    ``update`` is the selection statistic when the step was saved: the group's relative update norm
    ``||x - x_base|| / ||x_base||`` over its floating-point tensors since ``base_step``.
    """

    group: str
    base_step: int
    age: int
    update: float
    tensors: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"group": self.group, "base_step": self.base_step, "age": self.age, "update": self.update,
                "tensors": list(self.tensors)}

    @classmethod
    def from_dict(cls, d: Any, what: str) -> StaleGroup:
        _keys(d, what, {"group", "base_step", "age", "update", "tensors"})
        if not isinstance(d["group"], str) or not d["group"]:
            raise SchemaError(f"{what}: group must be a non-empty string, found {d['group']!r}")
        tensors = d["tensors"]
        if not isinstance(tensors, list) or not tensors or not all(isinstance(t, str) and t for t in tensors):
            raise SchemaError(f"{what}: tensors must be a non-empty list of tensor names")
        return cls(group=d["group"], base_step=_int(d["base_step"], f"{what}: base_step"),
                   age=_int(d["age"], f"{what}: age", lo=1), update=_finite(d["update"], f"{what}: update"),
                   tensors=tuple(tensors))


@dataclass(frozen=True)
class Composite:
    """The ``ucl.composite`` step extension (spec/delta.md §9): the step is approximate.

    A composite step stored only some groups of tensors (a parameter with its optimizer state, by
    default a layer's); each group of ``stale`` is a reference to the step that carries its values.
    ``groups`` counts the step's groups, stored or not. ``threshold``, ``top_k`` and ``max_age`` are the
    writer's policy, recorded for the reader's
    information (non-normative: readers do not use them).
    """

    stale: tuple[StaleGroup, ...]
    groups: int  # the number of groups of the step, stored or stale
    threshold: float = 0.0
    top_k: int | None = None
    max_age: int = 1

    def tensors(self) -> dict[str, StaleGroup]:
        """Every stale tensor's group."""
        return {t: g for g in self.stale for t in g.tensors}

    def describe(self, limit: int = 8) -> str:
        """``"model/layers.0 (from step 12, 3 steps old), ..."``: the stale groups, for messages."""
        parts = [f"{g.group} (from step {g.base_step}, {g.age} step{'s' if g.age != 1 else ''} old)"
                 for g in self.stale[:limit]]
        if len(self.stale) > limit:
            parts.append(f"and {len(self.stale) - limit} more")
        return ", ".join(parts)

    def to_extension(self) -> dict[str, Any]:
        return {"name": COMPOSITE, "must_understand": True,
                "configuration": {"groups": self.groups, "threshold": self.threshold, "top_k": self.top_k,
                                  "max_age": self.max_age,
                                  "stale": [g.to_dict() for g in self.stale]}}

    @classmethod
    def from_extension(cls, ext: Any, what: str = COMPOSITE) -> Composite:
        conf = _configuration(ext, COMPOSITE, what, {"groups", "threshold", "top_k", "max_age", "stale"},
                              " (a reader must not present it as exact)")
        top_k = conf["top_k"]
        if top_k is not None:
            top_k = _int(top_k, f"{what}: top_k", lo=1)
        stale = conf["stale"]
        if not isinstance(stale, list) or not stale:
            raise SchemaError(f"{what}: stale must be a non-empty list (a step without stale groups is exact "
                              "and has no ucl.composite extension)")
        groups = tuple(StaleGroup.from_dict(g, f"{what}: stale[{i}]") for i, g in enumerate(stale))
        seen: set[str] = set()
        for g in groups:
            twice = seen & set(g.tensors)
            if twice or len(set(g.tensors)) != len(g.tensors):
                name = sorted(twice)[0] if twice else g.tensors[0]
                raise SchemaError(f"{what}: tensor {name!r} is listed in more than one stale group")
            seen |= set(g.tensors)
        if len({g.group for g in groups}) != len(groups):
            raise SchemaError(f"{what}: a group is listed twice")
        total = _int(conf["groups"], f"{what}: groups", lo=1)
        if total < len(groups):
            raise SchemaError(f"{what}: {len(groups)} stale groups of a step of {total} groups")
        return cls(stale=groups, groups=total, threshold=_finite(conf["threshold"], f"{what}: threshold"),
                   top_k=top_k,
                   max_age=_int(conf["max_age"], f"{what}: max_age", lo=1))


def choose_encoding(name: str, dtype: str) -> str:
    """The delta encoding a writer uses for a tensor: ``"sub"`` or ``"xor"``.

    Integer subtraction compresses Adam's second moments (``exp_avg_sq``: positive, slowly varying, so
    the difference stays small across the exponent boundary) and integer counters better; XOR is better
    for weights and first moments, whose sign and exponent bits rarely change.

    Parameters
    ----------
    name : str
        The tensor name (state-dict key), e.g. ``"optim/state/3/exp_avg_sq"``.
    dtype : str
        The spec's data type name (``"float32"``, ``"bfloat16"``, ``"int64"``, ...).

    Returns
    -------
    str
        ``"sub"`` for second-moment estimates and integer types, else ``"xor"``.
    """
    leaf = name.replace(".", "/").rsplit("/", 1)[-1]
    if leaf in ("exp_avg_sq", "max_exp_avg_sq", "square_avg"):
        return "sub"
    if dtype.startswith(("int", "uint")):
        return "sub"
    return "xor"
