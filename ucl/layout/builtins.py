"""Built-in layouts (spec/layout.md §11): Megatron-style GPT/LLaMA and ZeRO-style flat optimizer partitions.

:data:`BUILTINS` is a small registry with lazy entries: ``builtin("megatron-gpt", **config)``.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Sequence
from typing import Any

from ucl.errors import InvalidLayoutError
from ucl.layout.mesh import Mesh
from ucl.layout.model import (
    Flat,
    Fused,
    Grouped,
    Layout,
    Pad,
    Part,
    Placement,
    Renumber,
    Replicate,
    Rule,
    Shard,
    Size,
)

BUILTINS: dict[str, str] = {
    "megatron-gpt": "ucl.layout.builtins:megatron_gpt",
    "zero": "ucl.layout.builtins:zero_flat",
    "deepspeed-zero": "ucl.layout.builtins:deepspeed_zero",
    "fsdp1": "ucl.layout.builtins:fsdp1_flat",
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
    te: bool = False,
    padded_vocab: int | None = None,
    layers: Sequence[int] | None = None,
    first: bool = True,
    last: bool = True,
) -> list[tuple[str, tuple[int, ...]]]:
    """(name, logical shape) of the parameters of a Megatron-core GPT model (local layer-norm names), in
    the order the model registers them (``named_parameters``).

    ``layers`` (default all) and ``first``/``last`` select the parameters of one pipeline stage. A tied
    embedding on a last stage that is not also the first is listed where Megatron's copy of it,
    ``output_layer.weight``, is registered: after the final norm.

    Registration order (Megatron-LM d98e8a6): GPTModel.__init__ builds ``embedding``, ``decoder``, then
    ``output_layer`` (megatron/core/models/gpt/gpt_model.py); a TransformerLayer its input norm,
    ``self_attention``, pre-MLP norm, ``mlp`` (transformer/transformer_layer.py); ``Attention.__init__``
    builds ``linear_proj`` before ``SelfAttention.__init__`` builds ``linear_qkv``
    (transformer/attention.py); MLP ``linear_fc1`` then ``linear_fc2`` (transformer/mlp.py); a linear
    layer its weight, then its bias. With ``te`` (Transformer Engine's layer spec) the two layer norms are
    fused into ``linear_qkv`` and ``linear_fc1`` as their ``layer_norm_weight``, which TE's LayerNormLinear
    registers before its weight (TransformerEngine d0067d0, pytorch/module/layernorm_linear.py).
    """
    kv = num_kv_heads or num_heads
    hd = head_dim or hidden // num_heads
    vocab = padded_vocab or vocab_size
    embedding = ("embedding.word_embeddings.weight", (vocab, hidden))
    out: list[tuple[str, tuple[int, ...]]] = []
    if first:
        out.append(embedding)
    for i in range(num_layers) if layers is None else layers:
        p = f"decoder.layers.{i}."
        if not te:
            out.append((p + "input_layernorm.weight", (hidden,)))
        out.append((p + "self_attention.linear_proj.weight", (hidden, num_heads * hd)))
        if bias:
            out.append((p + "self_attention.linear_proj.bias", (hidden,)))
        if te:
            out.append((p + "self_attention.linear_qkv.layer_norm_weight", (hidden,)))
        out.append((p + "self_attention.linear_qkv.weight", ((num_heads + 2 * kv) * hd, hidden)))
        if bias:
            out.append((p + "self_attention.linear_qkv.bias", ((num_heads + 2 * kv) * hd,)))
        mlp_norm = "mlp.linear_fc1.layer_norm_weight" if te else "pre_mlp_layernorm.weight"
        out.append((p + mlp_norm, (hidden,)))
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
        elif not first:
            out.append(embedding)
    return out


def megatron_buckets(
    numels: Sequence[int],
    *,
    bucket_size: int | None,
    shared: Sequence[bool] | None = None,
) -> list[list[int]]:
    """Megatron-core's distributed-optimizer buckets: indices into ``numels`` (parameters in registration
    order), bucket by bucket, each bucket in buffer order.

    Megatron-LM d98e8a6, megatron/core/optimizer/distrib_optimizer.py,
    ``DistributedOptimizer._compute_per_buffer_param_layout``: parameters are placed in reverse
    registration order, each start rounded up to 64 elements; a bucket closes once its parameters span
    ``bucket_size`` elements or more, and a ``shared_embedding`` parameter gets a bucket of its own. Each
    bucket's end is then padded to ``lcm(dp, 128)`` (optimizer/param_layout.py ``pad_bucket_end``), which
    the flat statements' ``pad`` says; since that is a multiple of 64, offsets within a bucket do not
    depend on ``dp``.
    """
    shared = shared or [False] * len(numels)
    buckets: list[list[int]] = []
    current: list[int] = []
    start = 0  # offset from the bucket's start
    for i in reversed(range(len(numels))):
        start = -(-start // 64) * 64
        if shared[i] and current:
            buckets.append(current)
            current, start = [], 0
        current.append(i)
        end = start + numels[i]
        if (bucket_size is not None and end >= bucket_size) or shared[i]:
            buckets.append(current)
            current, start = [], 0
        else:
            start = end
    if current:
        buckets.append(current)
    return buckets


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
    te: bool = False,
    qkv: str = "megatron",
    pp_bounds: Sequence[int] | None = None,
    zero: Mesh | None = None,
    zero_axes: Sequence[str] = ("dp",),
    bucket_size: int | None = None,
    pad_buckets_for_high_nccl_busbw: bool = False,
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
    - Layer norms by Megatron's local names (``input_layernorm``, ``pre_mlp_layernorm``) or, with ``te``,
      Transformer Engine's (``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``).
    - Layers are renumbered over ``pp`` (evenly by torch.chunk, or by ``pp_bounds``); the embedding lives on
      the first stage (and the last when ``tied``), the final norm and output layer on the last.
    - Optimizer states ``optim/state/<param>/<state>`` follow their parameters. With ``zero`` (the mesh),
      they are the flat buffers of Megatron-core's distributed optimizer, exactly: per stage, the stage's
      parameters (their TP-local pieces) in reverse registration order, each start a multiple of 64
      elements, cut into buckets (:func:`megatron_buckets`; ``bucket_size`` on the first stage only, as
      DistributedDataParallel sets it: None, the default, is one bucket, Megatron's default without
      ``overlap_grad_reduce``), each bucket's end padded to ``lcm(dp, 128)`` (``lcm(dp, 128, 2**16)``
      with ``pad_buckets_for_high_nccl_busbw``) and split evenly over ``zero_axes``. The rank's share of
      bucket ``b`` of a state (``param``: the fp32 main parameters, ``exp_avg``, ...) is the 1-D local
      tensor ``optim/flat/bucket<b>/<state>``, as DistributedOptimizer.get_parameter_state_dp_zero
      builds each bucket's ``local_shards`` before gathering them.
    """
    if bucket_size is not None and (type(bucket_size) is not int or bucket_size < 1):
        raise InvalidLayoutError(
            f"bucket_size must be a positive number of elements or None, got {bucket_size!r}"
        )
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
    _megatron_allows(zero, num_layers=num_layers, num_heads=num_heads, num_kv_heads=kv, head_dim=hd,
                     ffn_hidden=ffn_hidden, pp_bounds=pp_bounds)
    return _distributed_optimizer(
        layout, renumber, zero, tuple(zero_axes), bucket_size,
        65536 if pad_buckets_for_high_nccl_busbw else 128,
        dict(num_layers=num_layers, num_heads=num_heads, hidden=hidden, ffn_hidden=ffn_hidden,
             vocab_size=vocab_size, num_kv_heads=kv, head_dim=hd, swiglu=swiglu, bias=bias, tied=tied,
             te=te),
    )


def _megatron_allows(mesh: Mesh, *, num_layers: int, num_heads: int, num_kv_heads: int, head_dim: int,
                     ffn_hidden: int, pp_bounds: Sequence[int] | None) -> None:
    """Refuse the parallel sizes Megatron-core refuses (its ``divide`` asserts; Megatron-LM d98e8a6
    transformer/attention.py, tensor_parallel/layers.py, transformer/transformer_block.py), naming the
    rule."""
    tp = mesh.axis_size("tp") if "tp" in mesh.names else 1
    pp = mesh.axis_size("pp") if "pp" in mesh.names else 1
    qkv = (num_heads + 2 * num_kv_heads) * head_dim
    rules = [
        (num_heads % tp == 0, f"tp={tp} does not divide the {num_heads} attention heads"),
        (num_kv_heads % tp == 0 or tp % num_kv_heads == 0,
         f"tp={tp} and the {num_kv_heads} query groups: one must divide the other"),
        (qkv % tp == 0, f"tp={tp} does not divide linear_qkv's {qkv} rows"),
        (ffn_hidden % tp == 0, f"tp={tp} does not divide ffn_hidden {ffn_hidden}"),
        (pp_bounds is not None or num_layers % pp == 0,
         f"pp={pp} does not divide the {num_layers} layers (give pp_bounds for uneven stages)"),
    ]
    for ok, why in rules:
        if not ok:
            raise InvalidLayoutError(f"megatron-gpt: Megatron-core refuses this configuration: {why}")


def _distributed_optimizer(
    layout: Layout, renumber: Renumber, mesh: Mesh, axes: tuple[str, ...], bucket_size: int | None,
    pad: int, model: dict[str, Any],
) -> Layout:
    """``layout`` with the flat statements of Megatron-core's distributed optimizer on ``mesh``: one per
    (stage, bucket). Bucket boundaries depend on the parameters' TP-local sizes, so they are computed here
    from the layout's own rules on this mesh."""
    from ucl.layout.resolve import Resolver  # resolve imports this module's neighbours, not this one

    bounds = renumber.stage_bounds(mesh)
    stages = len(bounds) - 1
    flats: list[Flat] = []
    for s in range(stages):
        params = megatron_gpt_params(
            **model, layers=range(bounds[s + 1] - bounds[s]), first=s == 0, last=s == stages - 1
        )
        if not params:
            continue  # a stage without parameters holds no buffer
        on: Placement = (("pp", (s,)),) if stages > 1 else ()
        whole = Flat("optim/flat/{state}", "optim/state/{member}/{state}", axes, tuple(params), 1, on)
        probe = Resolver(Layout(rules=layout.rules, renumbers=layout.renumbers, flats=(whole,)), mesh)
        coords = {a: 0 for a in mesh.names} | ({"pp": s} if "pp" in mesh.names else {})
        numels = [math.prod(m.view) for m in probe.flat_geom(0, "exp_avg", coords).members]
        shared = [stages > 1 and model["tied"] and n == "embedding.word_embeddings.weight" for n, _ in params]
        for b, idx in enumerate(megatron_buckets(numels, bucket_size=bucket_size if s == 0 else None,
                                                 shared=shared)):
            flats.append(Flat(f"optim/flat/bucket{b}/{{state}}", "optim/state/{member}/{state}", axes,
                              tuple(params[i] for i in idx), 64, on, (pad,)))
    return Layout(rules=layout.rules, renumbers=layout.renumbers, flats=tuple(flats))


def zero_flat(
    params: Sequence[tuple[str, Sequence[int]]],
    *,
    buffer: str = "optim/flat/{state}",
    logical: str = "optim/state/{member}/{state}",
    axes: Sequence[str] = ("dp",),
    align: int = 1,
    on: Placement = (),
    pad: Sequence[int | str] = (),
) -> Layout:
    """A ZeRO-1/2 (or FSDP1) style flat optimizer partition: the parameters' states, flattened in the
    order given (each start aligned to ``align`` elements), concatenated into one buffer per state and
    split over ``axes`` (the buffer's length a multiple of ``lcm(ranks, pad)`` when ``pad`` is given,
    spec/layout.md §7.6). Merge it with the parameters' layout: ``model_layout.merged(zero_flat(...))``."""
    return Layout(
        flats=(Flat(buffer, logical, tuple(axes), tuple((n, tuple(s)) for n, s in params), align, on,
                    tuple(pad)),)
    )


def deepspeed_zero(
    groups: Sequence[Sequence[tuple[str, Sequence[int]]]],
    *,
    stage: int = 2,
    axes: Sequence[str] = ("dp",),
    buffer: str = "optim/flat/group{group}/{state}",
    logical: str = "optim/state/{member}/{state}",
) -> Layout:
    """DeepSpeed ZeRO's partitioned optimizer state, exactly, for the optimizer's parameter ``groups``
    (each a list of (name, shape) of its trainable parameters, in the group's order).

    - ``stage`` 1 or 2 (deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__, at
      DeepSpeed edaa722): a group's parameters are flattened in order with no gap, the whole padded with
      zeros to a multiple of ``2 * dp`` (``nccl_start_alignment_factor * dp``; runtime/utils.py
      ``align_dense_tensors``) and cut into ``dp`` equal partitions (``get_data_parallel_partitions``).
      The rank's ``single_partition_of_fp32_groups[g]`` and its optimizer's states over it (``exp_avg``,
      ...) are the 1-D local tensors ``buffer`` with ``{group} = g``: ``pad 2*dp`` (§7.6).
    - ``stage`` 3 (runtime/zero/partition_parameters.py, ``_partition_param``): each parameter is padded
      to a multiple of ``dp`` and cut into ``dp`` equal pieces; the rank's partitioned fp32 group is the
      concatenation of its pieces, so each piece is its own 1-D local tensor: ``buffer`` with ``{group}``
      the group and the parameter's name, e.g. ``optim/flat/group0/decoder.fc.weight/exp_avg`` (views of
      ``fp32_partitioned_groups_flat[g]`` at the pieces' offsets).

    ``round_robin_gradients`` (off by default) reorders a stage 1/2 group by the data-parallel size; list
    the group in that order. Merge it with the parameters' layout (their tensor-parallel rules still apply
    per rank): ``model_layout.merged(deepspeed_zero(...))``.
    """
    if stage not in (1, 2, 3):
        raise InvalidLayoutError(f"deepspeed_zero: stage must be 1, 2 or 3, got {stage!r}")
    if "{group}" not in buffer:
        raise InvalidLayoutError(f"deepspeed_zero: buffer {buffer!r} must name {{group}}")
    flats = []
    for g, params in enumerate(groups):
        members = tuple((n, tuple(s)) for n, s in params)
        if not members:
            continue  # DeepSpeed keeps no partition of a group without trainable parameters
        if stage < 3:
            flats.append(Flat(buffer.replace("{group}", str(g)), logical, tuple(axes), members, 1, (),
                              (2, *axes)))
        else:
            flats += [Flat(buffer.replace("{group}", f"{g}/{m[0]}"), logical, tuple(axes), (m,))
                      for m in members]
    if not flats:
        raise InvalidLayoutError("deepspeed_zero: no group has a parameter")
    return Layout(flats=tuple(flats))


def fsdp1_flat(
    units: Sequence[tuple[str, Sequence[tuple[str, Sequence[int]]]]],
    *,
    use_orig_params: bool = False,
    itemsize: int = 4,
    axes: Sequence[str] = ("fsdp",),
    params: str = "model/{member}",
    states: str | None = "optim/state/{member}/{state}",
) -> Layout:
    """PyTorch FSDP1's flat parameters, exactly: for each FSDP unit ``(module path, [(parameter name
    relative to it, shape), ...])`` (the parameters the unit manages, in the order it flattens them:
    ``module.named_parameters()`` less those of nested units), the unit's FlatParameter shard is the
    local tensor ``model/<path>._flat_param`` (``model/_flat_param`` for the root), the logical tensors
    its members ``params`` with ``{member}`` the full parameter name; with ``states``, the optimizer's
    states of that flat shard are ``optim/flat/<path>._flat_param/<state>``.

    torch/distributed/fsdp/_flat_param.py (torch 2.13), ``FlatParamHandle._init_flat_param_and_metadata``
    and ``_get_shard``: members concatenated in order; with ``use_orig_params`` (``align_addresses``) each
    start padded to 16 bytes (``_get_aligned_numel``: ``16 // itemsize`` elements of the unsharded dtype)
    and the total to a multiple of the world size; the flat tensor is ``torch.chunk``-ed over the ranks,
    each shard padded with zeros to the first chunk's size: ``ceil(total / ranks)`` elements.
    """
    if itemsize not in (1, 2, 4, 8):
        raise InvalidLayoutError(f"fsdp1_flat: itemsize must be 1, 2, 4 or 8 bytes, got {itemsize!r}")
    align, pad = (16 // itemsize, (1,)) if use_orig_params else (1, ())
    flats = []
    for path, members in units:
        if not members:
            continue  # FSDP makes no FlatParameter of a unit without parameters
        full = tuple((f"{path}.{n}" if path else n, tuple(shape)) for n, shape in members)
        flat = f"{path}._flat_param" if path else "_flat_param"
        flats.append(Flat(f"model/{flat}", params, tuple(axes), full, align, (), pad))
        if states is not None:
            flats.append(Flat(f"optim/flat/{flat}/{{state}}", states, tuple(axes), full, align, (), pad))
    if not flats:
        raise InvalidLayoutError("fsdp1_flat: no unit has a parameter")
    return Layout(flats=tuple(flats))
