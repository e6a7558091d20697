"""Delta metadata (spec/delta.md §3-§4, §8): frozen dataclasses <-> JSON, parsed field by field.

- :class:`DeltaRecord` is an array's ``attributes.ucl.delta``; :meth:`DeltaRecord.codec` is the matching
  inner codec ``{"name": "ucl.delta", "configuration": {...}}``.
- :class:`OptimizerFingerprint` and :class:`GradientRecords` describe the optional ``ucl.gradient_records``
  step extension (LowDiff-style: gradients plus what is needed to replay the optimizer).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ucl.errors import FormatError, InconsistentMetadataError, SchemaError

__all__ = [
    "CODEC_NAME",
    "DeltaRecord",
    "GRADIENT_RECORDS",
    "GradientRecords",
    "OptimizerFingerprint",
    "parse_codec",
]

CODEC_NAME = "ucl.delta"
GRADIENT_RECORDS = "ucl.gradient_records"
MODES = ("unchanged", "chunked")
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


@dataclass(frozen=True)
class DeltaRecord:
    """``attributes.ucl.delta`` of an array in a delta step.

    ``mode`` is ``"unchanged"`` (no data: the tensor equals the base step's, bit for bit) or
    ``"chunked"`` (inner chunks encoded with the ``ucl.delta`` codec against ``base_step``; an absent
    inner chunk equals the base's). ``encoding`` is the writer's choice for chunked arrays.
    """

    mode: str
    base_step: int
    encoding: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise SchemaError(f"delta record: mode must be one of {MODES}, found {self.mode!r}")
        _int(self.base_step, "delta record: base_step")
        if self.mode == "chunked" and self.encoding not in ENCODINGS:
            raise SchemaError(
                f"delta record: a chunked array needs encoding in {ENCODINGS}, found {self.encoding!r}"
            )
        if self.mode == "unchanged" and self.encoding is not None:
            raise SchemaError("delta record: an unchanged array has no encoding")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": self.mode, "base_step": self.base_step}
        if self.encoding is not None:
            d["encoding"] = self.encoding
        return d

    @classmethod
    def from_dict(cls, d: Any, what: str = "delta record") -> DeltaRecord:
        _keys(d, what, {"mode", "base_step"}, {"encoding"})
        if d["mode"] not in MODES:
            raise SchemaError(f"{what}: mode must be one of {MODES}, found {d['mode']!r}")
        try:
            return cls(
                mode=d["mode"],
                base_step=_int(d["base_step"], f"{what}: base_step"),
                encoding=d.get("encoding"),
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
        _keys(ext, what, {"name", "configuration"}, {"must_understand"})
        if ext["name"] != GRADIENT_RECORDS:
            raise SchemaError(f"{what}: name must be {GRADIENT_RECORDS!r}")
        if ext.get("must_understand", True) is not True:
            raise SchemaError(f"{what}: must_understand must be true")
        conf = _keys(ext["configuration"], f"{what} configuration",
                     {"base_step", "gradients", "parameters", "optimizer_state", "param_groups", "fingerprint"})
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
