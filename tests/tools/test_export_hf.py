"""A training step back to Hugging Face: subtree export with prefix stripping, restored config and
tokenizer files, and exports that write exactly what they name (no stale shards).

Real ``transformers`` models built from tiny configs (nothing is downloaded).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys

import pytest
import torch
import transformers  # noqa: E402  (a test dependency: pyproject.toml [test])
from safetensors import safe_open

import ucl
from ucl.errors import InvalidArgumentError
from ucl.tools.cli import main
from ucl.tools.convert import export_safetensors, import_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")


def tiny_llama() -> torch.nn.Module:
    cfg = transformers.LlamaConfig(vocab_size=101, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def tiny_gpt2() -> torch.nn.Module:
    cfg = transformers.GPT2Config(vocab_size=101, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                                 bos_token_id=100, eos_token_id=100)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg)


def fine_tune(model: torch.nn.Module, repo: os.PathLike[str], steps: int = 2) -> torch.Tensor:
    """A few AdamW steps, each saved by a CheckpointManager as {"model": ..., "optim": ...}; the batch."""
    g = torch.Generator().manual_seed(1)
    batch = torch.randint(0, 101, (2, 12), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model.train()
    with ucl.CheckpointManager(repo, keep_last=2, delta=True) as mgr:  # step 2: a delta step
        for step in range(1, steps + 1):
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            mgr.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    model.eval()
    return batch


def ucl_subprocess(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run([sys.executable, "-m", "ucl", *args], capture_output=True, text=True, env=env,
                          timeout=120)


def ucl_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The ucl command in this process (a subprocess costs seconds of imports)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return subprocess.CompletedProcess(["ucl", *args], rc, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("make", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
def test_training_step_exports_to_from_pretrained_with_identical_logits(make, tmp_path) -> None:
    model = make()
    repo = tmp_path / "ckpt"
    batch = fine_tune(model, repo)
    with torch.no_grad():
        want = model(input_ids=batch).logits
    assert ucl.open(repo).kind == "delta"
    names = set(ucl.open(repo).keys())
    assert any(n.startswith("optim/") for n in names) and all(n.startswith(("model/", "optim/")) for n in names)

    api, cli = tmp_path / "hf_api", tmp_path / "hf_cli"
    model.config.save_pretrained(api)  # the config beside the weights: the export leaves it alone
    model.config.save_pretrained(cli)
    e = export_safetensors(repo, api, tensors="model/", strip_prefix="model/")
    assert e.files == [str(api / "model.safetensors")] and e.index is None
    assert e.tensors == len(model.state_dict()) and e.skipped_values == []
    run = ucl_subprocess if make is tiny_llama else ucl_cli  # the real command once
    r = run("export", str(repo), str(cli), "--tensors", "model/", "--strip-prefix", "model/", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tensors"] == e.tensors
    assert (api / "model.safetensors").read_bytes() == (cli / "model.safetensors").read_bytes()
    assert sorted(os.listdir(api)) == ["config.json", "model.safetensors"]
    with safe_open(api / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(model.state_dict())  # no "model/" prefix, no optimizer state

    for out in (api, cli):
        back = type(model).from_pretrained(out)
        back.eval()
        with torch.no_grad():
            got = back(input_ids=batch).logits
        assert torch.equal(got, want)
        for n, t in model.state_dict().items():
            assert torch.equal(back.state_dict()[n], t), n


def test_selection_errors_name_the_problem(tmp_path) -> None:
    ucl.save({"model": {"w": torch.ones(2)}, "optim": {"state": {0: {"exp_avg": torch.zeros(2)}}, "lr": 0.1}},
             tmp_path / "r", step=0)
    with pytest.raises(InvalidArgumentError, match=r"tensors \(--tensors\) 'optimizer/' selects no tensor of step 0; "
                                                   r"its names begin with 'model/', 'optim/'"):
        export_safetensors(tmp_path / "r", tmp_path / "o", tensors=["model/", "optimizer/"])
    with pytest.raises(InvalidArgumentError, match=r"strip_prefix \(--strip-prefix\) 'model/' does not begin tensor "
                                                   r"'optim/state/0/exp_avg'"):
        export_safetensors(tmp_path / "r", tmp_path / "o", strip_prefix="model/")
    assert not (tmp_path / "o").exists()
    e = export_safetensors(tmp_path / "r", tmp_path / "o", tensors=["model/", "optim/state/"], strip_prefix=None)
    assert e.tensors == 2 and e.skipped_values == []  # optim.lr is outside the selection
    r = ucl_cli("export", str(tmp_path / "r"), str(tmp_path / "o2"), "--tensors", "nope")
    assert r.returncode == 1 and "'nope' selects no tensor" in r.stderr
    r = ucl_cli("export", str(tmp_path / "r"), str(tmp_path / "o2"), "--tensors", "model/,optim/",
                "--strip-prefix", "o")
    assert r.returncode == 1 and "'o' does not begin tensor 'model/w'" in r.stderr


def test_imported_directory_keeps_config_and_tokenizer_files(tmp_path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    src = tmp_path / "hf"
    model = tiny_llama()
    model.save_pretrained(src)
    model.generation_config.save_pretrained(src)
    vocab = {f"w{i}": i for i in range(100)} | {"<unk>": 100}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(src)
    (src / "tokenizer.model").write_bytes(bytes(range(256)) * 3)  # binary, as a sentencepiece model is
    (src / "README.md").write_text("# tiny\n\u00e9t\u00e9\n")
    (src / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # hidden: not kept
    torch.save({"lr": 1.0}, src / "training_args.bin")  # a pickle: not kept
    others = sorted(f for f in os.listdir(src) if f != "model.safetensors" and not f.startswith(".")
                    and not f.endswith(".bin"))
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= set(others)

    r = import_checkpoint(src, tmp_path / "repo")
    assert r.kept_files == others and r.skipped_files == []
    assert set(ucl.open(tmp_path / "repo").keys()) == set(model.state_dict())  # the files are no tensors
    assert ucl.validate(tmp_path / "repo").ok
    out = tmp_path / "out"
    e = export_safetensors(tmp_path / "repo", out)
    assert sorted(os.path.basename(f) for f in e.restored_files) == others
    assert sorted(os.listdir(out)) == sorted(["model.safetensors", *others])
    for f in [*others, "model.safetensors"]:
        assert (out / f).read_bytes() == (src / f).read_bytes(), f
    back = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(back.state_dict()[n], t) for n, t in model.state_dict().items())
    assert transformers.AutoTokenizer.from_pretrained(out)("w1 w2")["input_ids"] == [1, 2]
    # the CLI says so, and a one-file export writes exactly that file (no config beside it)
    r2 = ucl_cli("import", str(src), str(tmp_path / "repo2"))
    assert r2.returncode == 0 and f"kept {len(others)} other file(s) for export: {', '.join(others)}" in r2.stdout
    e1 = export_safetensors(tmp_path / "repo", tmp_path / "one" / "m.safetensors")
    assert os.listdir(tmp_path / "one") == ["m.safetensors"] and e1.restored_files == []


def test_exports_write_exactly_what_they_name(tmp_path) -> None:
    big = {f"layers.{i}.w": torch.full((16, 16), float(i)) for i in range(4)}  # 1 KiB each
    ucl.save({"model": big}, tmp_path / "r", step=1)
    ucl.save({"model": {"layers.0.w": torch.ones(4)}}, tmp_path / "r", step=2)
    out = tmp_path / "out"
    (out).mkdir()
    (out / "config.json").write_text("{}")
    e = export_safetensors(tmp_path / "r", out, 1, max_shard_size=2048, strip_prefix="model/")
    shards = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    assert [os.path.basename(f) for f in e.files] == shards and e.removed == []
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors.index.json", *shards])
    # a smaller step to the same directory: one file, the old shards and index gone
    e = export_safetensors(tmp_path / "r", out, 2, strip_prefix="model/")
    assert e.files == [str(out / "model.safetensors")] and e.index is None
    assert sorted(os.path.basename(f) for f in e.removed) == sorted(["model.safetensors.index.json", *shards])
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    # back to 2 shards: the single file goes, the index names exactly the files present
    export_safetensors(tmp_path / "r", out, 1, max_shard_size=2048, strip_prefix="model/")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == shards and set(index["weight_map"]) == set(big)
    assert index["metadata"]["total_size"] == 4 * 1024
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors.index.json", *shards])
    with pytest.raises(InvalidArgumentError):  # a failed export leaves the previous one whole
        export_safetensors(tmp_path / "r", out, 1, tensors="missing/")
    assert sorted(os.listdir(out)) == sorted(["config.json", "model.safetensors.index.json", *shards])

    # one named file: too big for it under the limit fails clearly, the existing file untouched
    single = tmp_path / "x.safetensors"
    export_safetensors(tmp_path / "r", single, 2)
    before = single.read_bytes()
    with pytest.raises(InvalidArgumentError, match=r"x.safetensors names one file, but the 4 tensor\(s\) exported are "
                                                   r"4096 bytes, more than max_shard_size \(--max-shard-size\) 2048"):
        export_safetensors(tmp_path / "r", single, 1, max_shard_size=2048)
    assert single.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["out", "r", "x.safetensors"]
    r = ucl_cli("export", str(tmp_path / "r"), str(single), "--step", "1", "--max-shard-size", "2KiB")
    assert r.returncode == 1 and "--max-shard-size" in r.stderr and single.read_bytes() == before
    # without a limit it is one file, whatever the size
    e = export_safetensors(tmp_path / "r", single, 1)
    assert e.files == [str(single)] and e.index is None and e.removed == []
    assert sorted(os.listdir(tmp_path)) == ["out", "r", "x.safetensors"]
    with safe_open(single, framework="pt") as f:
        assert set(f.keys()) == {f"model/{n}" for n in big}
