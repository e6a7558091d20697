"""Views: a step's logical tensors under another framework's names, fused tensors split (pure).

A layout says how each rank's shards map into the logical tensors; a *view* says how the logical tensors
map to the tensors of another framework's model, which may cut one logical tensor into several (Megatron's
fused ``linear_qkv`` is Hugging Face's ``q_proj``, ``k_proj`` and ``v_proj``). A view answers with a
plan, ``{target name: Take}``, each take a list of row ranges of one logical tensor; reading it
(:func:`ucl.load` with ``view=``, ``ucl export --to hf``) reads only those rows, lazily, checked.

``hf-llama`` (:class:`HFLlama`): a Megatron-core GPT/LLaMA step (TE or local layer-norm names, GQA,
SwiGLU, tied or untied output) as ``transformers``' ``LlamaForCausalLM``. Megatron-core's rotary
embedding rotates halves (``rotary_interleaved=False``, megatron/core/models/common/embeddings/
rope_utils.py ``_rotate_half``), as Hugging Face's ``rotate_half`` does, so query and key rows are
taken as they are, without the permutation an interleaved-rotary checkpoint would need.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ucl.errors import InvalidArgumentError
from ucl.layout import patterns
from ucl.layout.model import Fused, Grouped, Layout


@dataclass(frozen=True)
class Take:
    """Target tensor = rows ``ranges`` (half-open, along dim 0, concatenated) of logical tensor
    ``source``; ``ranges`` None: the whole tensor."""

    source: str
    ranges: tuple[tuple[int, int], ...] | None = None

    @property
    def whole(self) -> bool:
        return self.ranges is None


_LAYER = re.compile(r"decoder\.layers\.(0|[1-9][0-9]*)\.(.+)")
# Megatron-core parameter (after decoder.layers.{i}.) -> Hugging Face LLaMA parameter (after model.layers.{i}.)
_DIRECT = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",  # TE's fused norm + linear
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
    "mlp.linear_fc2.bias": "mlp.down_proj.bias",
}
_QKV = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_FC1 = ("mlp.linear_fc1.weight", "mlp.linear_fc1.bias")
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
    "output_layer.weight": "lm_head.weight",
}


@dataclass(frozen=True)
class HFLlama:
    """The ``hf-llama`` view. Attention heads, key/value groups and head size come from the step's layout
    (the parts of ``grouped`` or ``fused`` on ``linear_qkv``: ``megatron_gpt``'s); give them here for a
    step without one, or whose ``linear_qkv`` is stored in Megatron's own per-group order (a step saved
    without a layout, by one process, or with ``megatron_gpt(qkv="interleaved")``)."""

    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    name: str = "hf-llama"

    def plan(self, shapes: Mapping[str, tuple[int, ...]], layout: Layout | None = None) -> dict[str, Take]:
        """``{Hugging Face name: Take}`` for the Megatron model tensors among ``shapes`` (logical name ->
        shape; other tensors, such as optimizer state, are left out). Raises InvalidArgumentError naming
        what does not fit: no Megatron model, a layer tensor LLaMA has no place for, heads that do not
        divide the fused QKV."""
        prefix, model = _model(shapes)
        out: dict[str, Take] = {}
        for rest, hf in _TOP.items():
            if rest in model:
                out[hf] = Take(prefix + rest)
        if "lm_head.weight" not in out:
            out["lm_head.weight"] = out["model.embed_tokens.weight"]  # tied: LLaMA keeps both names
        for rest, shape in model.items():
            m = _LAYER.fullmatch(rest)
            if m is None:
                if rest not in _TOP and not _is_state(rest):
                    raise InvalidArgumentError(f"view hf-llama: tensor {prefix + rest!r} is not a parameter of a "
                                               "Megatron-core GPT/LLaMA model", tensor=prefix + rest)
                continue
            i, p = m.group(1), m.group(2)
            hf = f"model.layers.{i}."
            source = prefix + rest
            if p in _DIRECT:
                out[hf + _DIRECT[p]] = Take(source)
            elif p in _QKV:
                kind = p.rsplit(".", 1)[1]
                for part, ranges in zip(("q", "k", "v"), self._qkv(source, shape, layout), strict=True):
                    out[f"{hf}self_attn.{part}_proj.{kind}"] = Take(source, ranges)
            elif p in _FC1:
                kind = p.rsplit(".", 1)[1]
                gate, up = _fc1(source, shape, layout)
                out[f"{hf}mlp.gate_proj.{kind}"] = Take(source, (gate,))
                out[f"{hf}mlp.up_proj.{kind}"] = Take(source, (up,))
            elif not _is_state(p):
                raise InvalidArgumentError(f"view hf-llama: LLaMA has no place for tensor {source!r} "
                                           f"({p!r} of layer {i})", tensor=source)
        return out

    def config(self, shapes: Mapping[str, tuple[int, ...]], layout: Layout | None, dtype: str) -> dict[str, Any]:
        """A ``config.json`` for ``LlamaForCausalLM`` from the step's shapes. What the tensors do not say
        is Megatron-core's default: ``rms_norm_eps`` 1e-5 (``layernorm_epsilon``), ``rope_theta`` 10000
        (``rotary_base``); give the model's own config to keep its values."""
        prefix, model = _model(shapes)
        layers = sorted({int(m.group(1)) for r in model if (m := _LAYER.fullmatch(r))})
        vocab, hidden = model[_EMBEDDING]
        qkv = f"{prefix}decoder.layers.{layers[0]}.self_attention.linear_qkv.weight"
        nh, kv, hd, _ = self._heads(qkv, model[qkv[len(prefix):]], layout)
        ffn = model[f"decoder.layers.{layers[0]}.mlp.linear_fc2.weight"][1]
        bias = f"decoder.layers.{layers[0]}.self_attention.linear_qkv.bias" in model
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": ffn, "num_hidden_layers": len(layers),
            "num_attention_heads": nh, "num_key_value_heads": kv, "head_dim": hd,
            "hidden_act": "silu", "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "max_position_embeddings": 4096, "attention_bias": bias,
            "mlp_bias": f"decoder.layers.{layers[0]}.mlp.linear_fc1.bias" in model,
            "tie_word_embeddings": "output_layer.weight" not in model, "torch_dtype": dtype,
        }

    # -- the fused QKV -------------------------------------------------------------------------------
    def _heads(self, source: str, shape: tuple[int, ...], layout: Layout | None) -> tuple[int, int, int, bool]:
        """(heads, key/value groups, head size, logical tensor in Megatron's per-group order), checked
        against the tensor's rows."""
        parts = _parts(_rule(source, layout), (Grouped, Fused), len(shape))
        if parts is not None:
            if [p.name for p in parts] != ["q", "k", "v"]:
                raise InvalidArgumentError(f"view hf-llama: {source!r} is fused from parts "
                                           f"{[p.name for p in parts]}, not q, k, v", tensor=source)
            nh, kv, hd, per_group = parts[0].count, parts[1].count, parts[0].unit, False
        elif self.num_heads is None:
            raise InvalidArgumentError(
                f"view hf-llama: {source!r} is stored in Megatron's per-group order (no grouped or fused q, k, v "
                "in the step's layout): give its heads, HFLlama(num_heads=..., num_kv_heads=...)", tensor=source)
        else:
            nh, kv = self.num_heads, self.num_kv_heads or self.num_heads
            hd, per_group = self.head_dim or shape[0] // (nh + 2 * kv), True
        if nh % kv or (nh + 2 * kv) * hd != shape[0]:
            raise InvalidArgumentError(f"view hf-llama: {nh} heads in {kv} groups of head size {hd} do not make the "
                                       f"{shape[0]} rows of {source!r}", tensor=source)
        return nh, kv, hd, per_group

    def _qkv(self, source: str, shape: tuple[int, ...], layout: Layout | None) -> list[tuple[tuple[int, int], ...]]:
        nh, kv, hd, per_group = self._heads(source, shape, layout)
        if not per_group:  # the natural [all Q; all K; all V]
            q, k = nh * hd, kv * hd
            return [((0, q),), ((q, q + k),), ((q + k, q + 2 * k),)]
        # Megatron's order: per group g, [its nh/kv query heads; k_g; v_g] (attention.py)
        qg = nh // kv * hd
        step = qg + 2 * hd
        return [tuple((g * step, g * step + qg) for g in range(kv)),
                tuple((g * step + qg, g * step + qg + hd) for g in range(kv)),
                tuple((g * step + qg + hd, (g + 1) * step) for g in range(kv))]


def _fc1(source: str, shape: tuple[int, ...], layout: Layout | None) -> tuple[tuple[int, int], tuple[int, int]]:
    """Gate and up rows of a SwiGLU ``linear_fc1`` (Megatron's glu: ``torch.chunk(x, 2)``, the gate first;
    megatron/core/transformer/mlp.py)."""
    rule = _rule(source, layout)
    parts = _parts(rule, (Fused,), len(shape))
    if parts is not None:
        if [p.name for p in parts] != ["gate", "up"]:
            raise InvalidArgumentError(f"view hf-llama: {source!r} is fused from {[p.name for p in parts]}, not "
                                       "gate, up", tensor=source)
        g = parts[0].count * parts[0].unit
        return (0, g), (g, g + parts[1].count * parts[1].unit)
    if rule is not None or shape[0] % 2:  # a layout that shards it without gate and up: no SwiGLU
        raise InvalidArgumentError(f"view hf-llama: {source!r} is not SwiGLU's fused gate and up: LLaMA needs "
                                   "SwiGLU", tensor=source)
    h = shape[0] // 2  # a step without a layout holds Megatron's own [gate; up]
    return (0, h), (h, 2 * h)


def _rule(source: str, layout: Layout | None) -> Any:
    """The rule of ``layout`` that stores ``source`` (None: no layout, or no rule)."""
    if layout is None:
        return None
    for rule in layout.rules:
        if any(patterns.match(p, source) is not None for p in rule.patterns):
            return rule
    return None


def _parts(rule: Any, kinds: tuple[type, ...], ndim: int) -> Any:
    """The parts of the rule's fused or grouped transform along dim 0, if it has one."""
    if rule is None:
        return None
    for t in rule.transforms:
        if isinstance(t, kinds) and getattr(t, "dim") % ndim == 0:  # noqa: B009 - narrowed to object
            return getattr(t, "parts")  # noqa: B009
    return None


def _is_state(rest: str) -> bool:
    """TE's ``_extra_state`` entries and the like: not tensors of the model."""
    return rest.endswith("_extra_state")


_EMBEDDING = "embedding.word_embeddings.weight"


def _model(shapes: Mapping[str, tuple[int, ...]]) -> tuple[str, dict[str, tuple[int, ...]]]:
    """The subtree holding the Megatron model (``""``, ``"model/"``, ...: where its word embedding is) and
    its tensors' shapes, by name within it."""
    found = sorted({n[: -len(_EMBEDDING)] for n in shapes
                    if n == _EMBEDDING or n.endswith("/" + _EMBEDDING)})
    if not found:
        raise InvalidArgumentError(f"view hf-llama: the step holds no Megatron-core GPT model (no {_EMBEDDING})")
    if len(found) > 1:
        raise InvalidArgumentError(f"view hf-llama: the step holds several Megatron models, under {found}")
    prefix = found[0]
    return prefix, {n[len(prefix):]: s for n, s in shapes.items() if n.startswith(prefix)}


VIEWS: dict[str, Any] = {"hf-llama": HFLlama}


def as_view(view: Any) -> Any:
    """A view object from a name (``"hf-llama"``) or a view."""
    if isinstance(view, str):
        if view not in VIEWS:
            raise InvalidArgumentError(f"unknown view {view!r}; known: {sorted(VIEWS)}")
        return VIEWS[view]()
    if not hasattr(view, "plan"):
        raise InvalidArgumentError(f"view must be a name ({sorted(VIEWS)}) or a view object, got {type(view).__name__}")
    return view
