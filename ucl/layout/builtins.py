"""Built-in layouts (spec/layout.md §11): Megatron-style GPT/LLaMA and ZeRO-style flat optimizer partitions.

:data:`BUILTINS` is a small registry with lazy entries: ``builtin("megatron-gpt", **config)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

from ucl.errors import InvalidLayoutError
from ucl.layout.mesh import Mesh
from ucl.layout.model import Flat, Fused, Grouped, Layout, Pad, Part, Placement, Renumber, Replicate, Rule, Shard, Size

BUILTINS: dict[str, str] = {
    "megatron-gpt": "ucl.layout.builtins:megatron_gpt",
    "zero": "ucl.layout.builtins:zero_flat",
    "dtensor": "ucl.layout.dtensor:layout_from_dtensors",
}


def builtin(name: str, *args: Any, **kwargs: Any) -> Layout:
    """The built-in layout ``name`` made with the given arguments."""
    try:
        module, attr = BUILTINS[name].split(":")
    except KeyError:
        raise InvalidLayoutError(
            f"no built-in layout {name!r} (known: {', '.join(sorted(BUILTINS))})"
        ) from None
    fn: Callable[..., Layout] = getattr(importlib.import_module(module), attr)
    return fn(*args, **kwargs)


def _rule(name: str, *transforms: Any, on: Placement = ()) -> Rule:
    """A rule for a parameter suffix and its optimizer states (``<param>/<state>``)."""
    return Rule((f"**{name}", f"**{name}/*"), tuple(transforms), on)


def megatron_gpt_params(
    *,
    num_layers: int,
    num_heads: int,
    hidden: int,
    ffn_hidden: int,
    vocab_size: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    swiglu: bool = True,
    bias: bool = False,
    tied: bool = False,
    padded_vocab: int | None = None,
    layers: Sequence[int] | None = None,
    first: bool = True,
    last: bool = True,
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, logical shape) of the parameters of a Megatron-core GPT model, in module order.

    ``layers`` (default all) and ``first``/``last`` select the parameters of one pipeline stage.
    """
    kv = num_kv_heads or num_heads
    hd = head_dim or hidden // num_heads
    vocab = padded_vocab or vocab_size
    out: list[tuple[str, tuple[int, ...]]] = []
    if first:
        out.append(("embedding.word_embeddings.weight", (vocab, hidden)))
    for i in range(num_layers) if layers is None else layers:
        p = f"decoder.layers.{i}."
        out.append((p + "input_layernorm.weight", (hidden,)))
        out.append((p + "self_attention.linear_qkv.weight", ((num_heads + 2 * kv) * hd, hidden)))
        if bias:
            out.append((p + "self_attention.linear_qkv.bias", ((num_heads + 2 * kv) * hd,)))
        out.append((p + "self_attention.linear_proj.weight", (hidden, num_heads * hd)))
        if bias:
            out.append((p + "self_attention.linear_proj.bias", (hidden,)))
        out.append((p + "pre_mlp_layernorm.weight", (hidden,)))
        out.append((p + "mlp.linear_fc1.weight", ((2 if swiglu else 1) * ffn_hidden, hidden)))
        if bias:
            out.append((p + "mlp.linear_fc1.bias", ((2 if swiglu else 1) * ffn_hidden,)))
        out.append((p + "mlp.linear_fc2.weight", (hidden, ffn_hidden)))
        if bias:
            out.append((p + "mlp.linear_fc2.bias", (hidden,)))
    if last:
        out.append(("decoder.final_layernorm.weight", (hidden,)))
        if not tied:
            out.append(("output_layer.weight", (vocab, hidden)))
    return out


def megatron_gpt(
    *,
    num_layers: int,
    num_heads: int,
    hidden: int,
    ffn_hidden: int,
    vocab_size: int,
    num_kv_heads: int | None = None,
    head_dim: int | None = None,
    vocab_multiple: int = 128,
    swiglu: bool = True,
    bias: bool = False,
    tied: bool = False,
    qkv: str = "megatron",
    pp_bounds: Sequence[int] | None = None,
    zero: Mesh | None = None,
    zero_axes: Sequence[str] = ("dp",),
    zero_align: int = 1,
) -> Layout:
    """A Megatron-core style GPT/LLaMA layout over mesh axes ``tp`` and ``pp`` (size 1 is fine).

    - QKV (``linear_qkv``, weight and bias) fused with grouped-query attention. ``qkv="megatron"``
      (default): Megatron-core's own order, per query group ``[its q heads; k; v]``, each TP rank the
      next contiguous 1/tp of it (whole groups when tp divides the groups, else part of one group),
      stored by the framework-neutral logical tensor ``[all q heads; all k; all v]``
      (``grouped``, spec/layout.md §7.10; megatron/core/transformer/attention.py). ``qkv="concat"``:
      each rank holds ``[q heads/tp; k groups/tp; v groups/tp]`` (as vLLM's QKVParallelLinear; fewer
      KV groups than TP ranks: each group replicated). ``qkv="interleaved"``: Megatron's order as
      the logical tensor (a plain row split; the logical view is not framework-neutral).
    - ``linear_fc1`` with SwiGLU holds ``[gate/tp; up/tp]``; column-parallel weights split rows, row-parallel
      ones (``linear_proj``, ``linear_fc2``) split columns.
    - The vocabulary is padded to a multiple of ``vocab_multiple * tp``; padding rows are not stored.
    - Layers are renumbered over ``pp`` (evenly by torch.chunk, or by ``pp_bounds``); the embedding lives on
      the first stage (and the last when ``tied``), the final norm and output layer on the last.
    - Optimizer states ``optim/state/<param>/<state>`` follow their parameters. With ``zero`` (the mesh),
      they are flat ZeRO buffers ``optim/flat/<state>``, one per stage, split over ``zero_axes``.
    """
    kv = num_kv_heads or num_heads
    hd = head_dim or hidden // num_heads
    if qkv not in ("megatron", "concat", "interleaved"):
        raise InvalidLayoutError(f"qkv must be 'megatron', 'concat' or 'interleaved', got {qkv!r}")
    if num_heads % kv:
        raise InvalidLayoutError(f"{num_heads} attention heads do not form {kv} query groups "
                                 "(num_heads must be a multiple of num_kv_heads)")
    vocab = (Size(0, vocab_size), Pad(0, (vocab_multiple, "tp")), Shard(0, ("tp",)))
    if qkv == "megatron":
        qkv_t: tuple[Any, ...] = (
            Grouped(0, kv, (Part("q", num_heads, hd), Part("k", kv, hd), Part("v", kv, hd))),
            Shard(0, ("tp",)),
        )
    elif qkv == "concat":
        qkv_t = (
            Fused(0, (Part("q", num_heads, hd), Part("k", kv, hd), Part("v", kv, hd))),
            Shard(0, ("tp",)),
        )
    else:
        qkv_t = (Shard(0, ("tp",)),)
    fc1 = (
        (Fused(0, (Part("gate", ffn_hidden), Part("up", ffn_hidden))), Shard(0, ("tp",)))
        if swiglu
        else (Shard(0, ("tp",)),)
    )
    rules = [
        _rule("embedding.word_embeddings.weight", *vocab, on=(("pp", (0, -1) if tied else (0,)),)),
        _rule("decoder.layers.*.self_attention.linear_qkv.weight", *qkv_t),
        _rule("decoder.layers.*.self_attention.linear_proj.weight", Shard(1, ("tp",))),
        _rule("decoder.layers.*.mlp.linear_fc1.weight", *fc1),
        _rule("decoder.layers.*.mlp.linear_fc2.weight", Shard(1, ("tp",))),
        _rule("decoder.final_layernorm.weight", Replicate(), on=(("pp", (-1,)),)),
    ]
    if bias:
        rules.insert(2, _rule("decoder.layers.*.self_attention.linear_qkv.bias", *qkv_t))
        rules.append(_rule("decoder.layers.*.mlp.linear_fc1.bias", *fc1))
    if not tied:
        rules.append(_rule("output_layer.weight", *vocab, on=(("pp", (-1,)),)))
    if pp_bounds is not None:
        renumber = Renumber(("**decoder.layers.{i}.**",), "pp", bounds=tuple(pp_bounds))
    else:
        renumber = Renumber(("**decoder.layers.{i}.**",), "pp", count=num_layers)
    layout = Layout(rules=tuple(rules), renumbers=(renumber,))
    if zero is None:
        return layout
    bounds = renumber.stage_bounds(zero)
    stages = len(bounds) - 1
    flats = []
    for s in range(stages):
        params = megatron_gpt_params(
            num_layers=num_layers,
            num_heads=num_heads,
            hidden=hidden,
            ffn_hidden=ffn_hidden,
            vocab_size=vocab_size,
            num_kv_heads=kv,
            head_dim=hd,
            swiglu=swiglu,
            bias=bias,
            tied=tied,
            layers=range(bounds[s + 1] - bounds[s]),
            first=s == 0 or (tied and s == stages - 1),
            last=s == stages - 1,
        )
        members = [(n, sh) for n, sh in params]  # logical shapes; layer numbers local to the stage
        if not members:
            continue  # a stage without parameters holds no buffer
        on: Placement = (("pp", (s,)),) if stages > 1 else ()
        flats.append(
            Flat(
                "optim/flat/{state}",
                "optim/state/{member}/{state}",
                tuple(zero_axes),
                tuple(members),
                zero_align,
                on,
            )
        )
    return Layout(rules=layout.rules, renumbers=layout.renumbers, flats=tuple(flats))


def zero_flat(
    params: Sequence[tuple[str, Sequence[int]]],
    *,
    buffer: str = "optim/flat/{state}",
    logical: str = "optim/state/{member}/{state}",
    axes: Sequence[str] = ("dp",),
    align: int = 1,
    on: Placement = (),
) -> Layout:
    """A ZeRO-1/2 (or FSDP1) style flat optimizer partition: the parameters' states, flattened in the
    order given (each start aligned to ``align`` elements), concatenated into one buffer per state and
    split over ``axes``. Merge it with the parameters' layout: ``model_layout.merged(zero_flat(...))``."""
    return Layout(
        flats=(Flat(buffer, logical, tuple(axes), tuple((n, tuple(s)) for n, s in params), align, on),)
    )
