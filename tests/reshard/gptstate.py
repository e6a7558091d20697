"""The GPT of ucl.testing.gpt as a resharding subject: its layout (fused QKV with GQA, gate/up, padded
vocabulary, pipeline stages, ZeRO flat optimizer buffers) and its state with named optimizer state."""

from __future__ import annotations

import copy
import hashlib
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


def layout_text(
    c: gpt.GPTConfig = CONFIG, *, tp: int = 1, pp: int = 1, dp: int = 1, vocab_multiple: int = VOCAB_MULTIPLE
) -> str:
    return gpt.layout_text(c, tp=tp, pp=pp, dp=dp, vocab_multiple=vocab_multiple)


def layout_of(tp: int, pp: int, dp: int) -> Layout:
    return parse_layout(layout_text(tp=tp, pp=pp, dp=dp))


logical_state = gpt.logical_state


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
