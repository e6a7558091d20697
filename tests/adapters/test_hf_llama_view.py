"""The ``hf-llama`` view (ucl/layout/views.py): a Megatron-core GPT/LLaMA step, saved by real gloo ranks
under tensor and pipeline parallelism, loads as transformers' LlamaForCausalLM (``strict=True``) and
computes the logits an independent Megatron-core forward computes from the logical weights; ``ucl
export --to hf`` writes a directory ``from_pretrained`` loads.

The reference forward below is written from Megatron-LM's source at
d98e8a64ddf34856e74b24714e3bedb2f5a39553 (NVIDIA/Megatron-LM):
- megatron/core/transformer/attention.py ``SelfAttention.get_query_key_value_tensors``: the fused QKV
  output viewed as ``[s, b, ng, (nh/ng + 2) * hd]`` and split into ``nh/ng * hd, hd, hd``: per query group
  its query heads, its key, its value;
- megatron/core/transformer/dot_product_attention.py: keys and values repeated to the query heads,
  ``repeat_interleave(nh // ng, dim=2)``; softmax of ``q k^T / sqrt(hd)`` under the causal mask;
- megatron/core/models/common/embeddings/rope_utils.py ``_rotate_half`` (``rotary_interleaved=False``:
  halves), ``_apply_rotary_pos_emb_bshd`` (``t * cos + rotate_half(t) * sin``) and rotary_pos_embedding.py
  (``inv_freq = 1 / base^(arange(0, dim, 2) / dim)``, ``emb = cat(freqs, freqs)``);
- megatron/core/transformer/mlp.py with ``gated_linear_unit``: ``torch.chunk(fc1, 2)``, ``silu(x0) * x1``;
- RMSNorm (megatron/core/transformer/torch_norm.py): ``x * rsqrt(mean(x^2) + eps) * weight``;
- megatron/core/models/gpt/gpt_model.py: embedding, the layers (pre-norm, residuals), final norm, output
  layer (the embedding when tied).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ucl
from ucl.errors import InvalidArgumentError
from ucl.layout import Mesh
from ucl.layout.builtins import megatron_gpt, megatron_gpt_params
from ucl.layout.views import HFLlama
from ucl.testing import dist
from ucl.testing.layout_reference import shard_local_state

from ..layout import megatron_qkv as qkv_ref

CFG = dict(num_layers=4, num_heads=4, num_kv_heads=2, hidden=32, ffn_hidden=48, vocab_size=61)
EPS, BASE = 1e-5, 10000.0


def logical_model(seed: int = 0, tied: bool = False) -> dict[str, torch.Tensor]:
    """The framework-neutral logical weights (QKV as [all Q; all K; all V], vocabulary unpadded)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for n, s in megatron_gpt_params(**CFG, tied=tied):
        if n.endswith("layernorm.weight"):
            out[n] = 1 + 0.1 * torch.randn(s, generator=g)
        else:
            out[n] = 0.2 * torch.randn(s, generator=g)
    return out


def megatron_order(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What one Megatron-core process (tp=1) holds: linear_qkv in its per-group order."""
    nh, ng, hd = CFG["num_heads"], CFG["num_kv_heads"], CFG["hidden"] // CFG["num_heads"]
    out = dict(w)
    for n in w:
        if n.endswith("linear_qkv.weight"):
            q, k, v = w[n][: nh * hd], w[n][nh * hd: (nh + ng) * hd], w[n][(nh + ng) * hd:]
            out[n] = qkv_ref.rank_local(q, k, v, nh, ng, 1, 0)
    return out


def _rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def megatron_forward(w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Logits of Megatron-core's GPT (LLaMA options) for one sequence, from Megatron's own tensors."""
    nh, ng, hidden = CFG["num_heads"], CFG["num_kv_heads"], CFG["hidden"]
    hd = hidden // nh
    s = tokens.shape[0]
    inv_freq = 1.0 / (BASE ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    x = w["embedding.word_embeddings.weight"][tokens]
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)
    for i in range(CFG["num_layers"]):
        p = f"decoder.layers.{i}."
        h = _rms(x, w[p + "input_layernorm.weight"])
        mixed = (h @ w[p + "self_attention.linear_qkv.weight"].T).view(s, ng, (nh // ng + 2) * hd)
        q, k, v = torch.split(mixed, [nh // ng * hd, hd, hd], dim=-1)
        q = q.reshape(s, nh, hd)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        k, v = k.repeat_interleave(nh // ng, dim=1), v.repeat_interleave(nh // ng, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
        ctx = torch.einsum("hqk,khd->qhd", probs, v).reshape(s, nh * hd)
        x = x + ctx @ w[p + "self_attention.linear_proj.weight"].T
        h = _rms(x, w[p + "pre_mlp_layernorm.weight"])
        gate, up = torch.chunk(h @ w[p + "mlp.linear_fc1.weight"].T, 2, dim=-1)
        x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.linear_fc2.weight"].T
    x = _rms(x, w["decoder.final_layernorm.weight"])
    return x @ w.get("output_layer.weight", w["embedding.word_embeddings.weight"]).T


def hf_model(sd: dict[str, torch.Tensor] | None, tied: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=CFG["vocab_size"], hidden_size=CFG["hidden"], intermediate_size=CFG["ffn_hidden"],
                      num_hidden_layers=CFG["num_layers"], num_attention_heads=CFG["num_heads"],
                      num_key_value_heads=CFG["num_kv_heads"], head_dim=CFG["hidden"] // CFG["num_heads"],
                      rms_norm_eps=EPS, rope_theta=BASE, max_position_embeddings=64, tie_word_embeddings=tied,
                      attn_implementation="eager")
    model = LlamaForCausalLM(cfg).eval()
    if sd is not None:
        model.load_state_dict(sd, strict=True)
    return model


TOKENS = torch.tensor([3, 17, 42, 0, 60, 5, 5, 23, 11])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS[None]).logits[0]


def save_ranks(rank: int, world: int, path: str) -> dict[str, object]:
    """A (pp=2, tp=2) rank of Megatron-core: its local model tensors, saved through CheckpointManager."""
    from ucl.write.manager import CheckpointManager

    layout = megatron_gpt(**CFG)
    mesh = Mesh.of(pp=2, tp=2)
    full = {"model/" + n: t for n, t in logical_model().items()}
    local = shard_local_state(full, layout, mesh, rank)
    with CheckpointManager(path, layout=layout, mesh=mesh) as mgr:
        mgr.save(1, local).result()
    return {"rank": rank, "tensors": len(local)}


@pytest.fixture(scope="module")
def megatron_step(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("megatron")
    dist.run(4, "tests.adapters.test_hf_llama_view:save_ranks", {"path": str(path)})
    assert ucl.validate(path).ok
    return path


@pytest.mark.dist
def test_a_megatron_tp_pp_step_loads_as_hf_llama(megatron_step: Path) -> None:
    w = logical_model()
    sd = ucl.load(megatron_step, view="hf-llama")
    nh, ng, hd = CFG["num_heads"], CFG["num_kv_heads"], CFG["hidden"] // CFG["num_heads"]
    qkv = w["decoder.layers.2.self_attention.linear_qkv.weight"]
    assert torch.equal(sd["model.layers.2.self_attn.q_proj.weight"], qkv[: nh * hd])
    assert torch.equal(sd["model.layers.2.self_attn.v_proj.weight"], qkv[(nh + ng) * hd:])
    assert torch.equal(sd["model.layers.3.mlp.up_proj.weight"], w["decoder.layers.3.mlp.linear_fc1.weight"][48:])
    assert torch.equal(sd["model.embed_tokens.weight"], w["embedding.word_embeddings.weight"])  # unpadded
    model = hf_model(sd)  # strict: every name and shape of LlamaForCausalLM, nothing else
    again = ucl.load(megatron_step, layout="hf-llama")  # the view by its name where a layout goes
    assert sorted(again) == sorted(sd) and all(torch.equal(again[n], sd[n]) for n in sd)
    want = megatron_forward(megatron_order(w), TOKENS)
    torch.testing.assert_close(_logits(model), want, rtol=1e-5, atol=1e-5)


@pytest.mark.dist
def test_export_to_hf_is_a_from_pretrained_directory(megatron_step: Path, tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "ucl", "export", str(megatron_step), str(out), "--to", "hf"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (4, 2, 61)
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
    model = LlamaForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    want = megatron_forward(megatron_order(logical_model()), TOKENS)
    torch.testing.assert_close(_logits(model), want, rtol=1e-5, atol=1e-5)


def test_a_one_process_step_in_megatrons_order_with_tied_embeddings(tmp_path: Path) -> None:
    """Saved without a layout (one Megatron process: linear_qkv in its per-group order), tied output: the
    view needs the heads, and then gives the model that computes Megatron's logits."""
    w = megatron_order(logical_model(seed=1, tied=True))
    ucl.save({"model": w, "iteration": 7}, tmp_path, step=1)
    with pytest.raises(InvalidArgumentError, match="per-group order"):
        ucl.load(tmp_path, view="hf-llama")
    sd = ucl.load(tmp_path, view=HFLlama(num_heads=4, num_kv_heads=2))
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]
    model = hf_model(sd, tied=True)
    torch.testing.assert_close(_logits(model), megatron_forward(w, TOKENS), rtol=1e-5, atol=1e-5)
    with pytest.raises(InvalidArgumentError, match="do not make"):
        ucl.load(tmp_path, view=HFLlama(num_heads=3, num_kv_heads=1))


def test_a_step_that_is_no_megatron_model_is_refused(tmp_path: Path) -> None:
    ucl.save({"w": torch.ones(2)}, tmp_path, step=1)
    with pytest.raises(InvalidArgumentError, match="no Megatron-core GPT model"):
        ucl.load(tmp_path, view="hf-llama")
    with pytest.raises(InvalidArgumentError, match="unknown view"):
        ucl.load(tmp_path, view="hf-gpt9")
    w = logical_model()
    w["decoder.layers.0.self_attention.q_layernorm.weight"] = torch.ones(8)
    ucl.save({"model": megatron_order(w)}, tmp_path / "qk", step=1)
    with pytest.raises(InvalidArgumentError, match="no place for tensor"):
        ucl.load(tmp_path / "qk", view=HFLlama(num_heads=4, num_kv_heads=2))
