"""The GPT of ucl.testing.gpt as a resharding subject: its layout (fused QKV with GQA, gate/up, padded
vocabulary, pipeline stages, ZeRO flat optimizer buffers) and its state with named optimizer state."""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

import torch

from ucl.layout import Layout, Mesh, parse_layout
from ucl.testing import gpt

# tiny, with a vocabulary that pads differently under each tp, and fewer kv heads than tp=4 ranks (GQA
# units replicated across tensor-parallel ranks)
CONFIG = gpt.PRESETS["tiny"].replace(vocab=500, n_kv_heads=2)
VOCAB_MULTIPLE = 24
CONFIGS = [(2, 1, 1), (1, 2, 1), (2, 2, 1), (1, 1, 2), (4, 1, 1)]  # (tp, pp, dp)
ONE = (1, 1, 1)


def mesh_of(tp: int, pp: int, dp: int) -> Mesh:
    return Mesh.of(pp=pp, dp=dp, tp=tp)


def _q(name: str) -> str:
    return json.dumps(name)


def layout_text(
    c: gpt.GPTConfig = CONFIG, *, tp: int = 1, pp: int = 1, dp: int = 1, vocab_multiple: int = VOCAB_MULTIPLE
) -> str:
    """The layout of the GPT's state: "model/<param>", "optim/state/<param>/<exp_avg|exp_avg_sq>", and with
    dp > 1 ZeRO flat buffers "optim/flat/<state>" (one per pipeline stage) in place of the latter."""
    hd = c.head_dim

    def both(p: str) -> str:
        return f"{_q('**' + p)}, {_q('**' + p + '/*')}"

    vocab = f"size(0, {c.vocab}), pad(0, {vocab_multiple}*tp), shard(0, tp)"
    lines = [
        "ucl-layout 1",
        f"renumber {_q('**layers.{i}.**')} over pp: {c.n_layers}",
        f"{both('embedding.word_embeddings.weight')}: {vocab} on pp=0",
        f"{both('.attention.qkv.weight')}: fused(0, q={c.n_heads}x{hd}, k={c.n_kv_heads}x{hd}, "
        f"v={c.n_kv_heads}x{hd}), shard(0, tp)",
        f"{both('.attention.dense.weight')}: shard(1, tp)",
        f"{both('.mlp.gate_up.weight')}: fused(0, gate={c.ffn_hidden}, up={c.ffn_hidden}), shard(0, tp)",
        f"{both('.mlp.down.weight')}: shard(1, tp)",
        f"{both('final_norm.weight')}: replicate on pp=-1",
        f"{both('lm_head.weight')}: {vocab} on pp=-1",
    ]
    if dp > 1:
        shapes = gpt.param_shapes(c)
        per = -(-c.n_layers // pp)
        for s in range(pp):
            lo, hi = min(s * per, c.n_layers), min((s + 1) * per, c.n_layers)
            members = []
            for name, shape in shapes.items():
                if name.startswith("layers."):
                    i = int(name.split(".")[1])
                    if not lo <= i < hi:
                        continue
                    name = f"layers.{i - lo}." + name.split(".", 2)[2]
                elif (name.startswith("embedding.") and s != 0) or (
                    name.startswith(("final_norm.", "lm_head.")) and s != pp - 1
                ):
                    continue
                members.append(f"  {_q('model/' + name)} {list(shape)},")
            on = f" on pp={s}" if pp > 1 else ""
            lines.append(f'flat "optim/flat/{{state}}" -> "optim/state/{{member}}/{{state}}" over dp{on}: [')
            lines += members
            lines.append("]")
    return "\n".join(lines) + "\n"


def layout_of(tp: int, pp: int, dp: int) -> Layout:
    return parse_layout(layout_text(tp=tp, pp=pp, dp=dp))


def logical_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Flat logical state: "model/<p>", "optim/state/model/<p>/exp_avg", ".../exp_avg_sq"."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        out[f"model/{name}"] = p.detach().clone()
        st = opt.state[p]
        out[f"optim/state/model/{name}/exp_avg"] = st["exp_avg"].clone()
        out[f"optim/state/model/{name}/exp_avg_sq"] = st["exp_avg_sq"].clone()
    return out


def optimizer_step(opt: torch.optim.Optimizer) -> int:
    steps = {int(s["step"].item()) for s in opt.state.values()}
    assert len(steps) == 1
    return steps.pop()


def nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, v in flat.items():
        node = out
        parts = name.split("/")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = v
    return out


def flatten(state: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in state.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, name + "/"))
        else:
            out[name] = v
    return out


def restore(
    state: dict[str, torch.Tensor], step: int, seed: int = 0
) -> tuple[gpt.GPT, torch.optim.Optimizer]:
    """A model and optimizer holding a logical state (flat names)."""
    model, opt = gpt.make_model_and_optimizer(CONFIG, seed=seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(state[f"model/{name}"])
            opt.state[p] = {
                "step": torch.tensor(float(step)),
                "exp_avg": state[f"optim/state/model/{name}/exp_avg"].clone(),
                "exp_avg_sq": state[f"optim/state/model/{name}/exp_avg_sq"].clone(),
            }
    return model, opt


def reference(steps: int = 2) -> dict[str, Any]:
    """Train ``steps`` steps, then the logical state, the step and the loss of the next step."""
    model, opt = gpt.make_model_and_optimizer(CONFIG, seed=0)
    data = gpt.SyntheticData(CONFIG, seed=0)
    for s in range(1, steps + 1):
        gpt.train_step(model, opt, data.batch(s))
    state = logical_state(model, opt)
    m2, o2 = copy.deepcopy(model), copy.deepcopy(opt)
    loss = gpt.train_step(m2, o2, data.batch(steps + 1))
    return {"state": state, "step": optimizer_step(opt), "next_loss": loss}


def next_loss(state: dict[str, torch.Tensor], step: int) -> float:
    model, opt = restore(state, step)
    data = gpt.SyntheticData(CONFIG, seed=0)
    return gpt.train_step(model, opt, data.batch(step + 1))


def digest(t: torch.Tensor) -> str:
    return (
        hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]
        + f":{list(t.shape)}:{t.dtype}"
    )
