"""The runnable snippets of docs/delta.md, executed in order, as a reader would paste them."""

from __future__ import annotations

import torch

from .docs_pages import run_page


def test_delta_page(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch, "__version__", torch.__version__)  # the page patches and restores it
    run_page("delta.md", min_blocks=5)
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in out[:5]] == [["1", "full", "None"]] + [[str(s), "delta", "1"]
                                                                               for s in range(2, 6)]
    assert out[5:7] == ["True", "True"]  # the slice, validation
    assert out[7] == "True 4 torch.optim.adamw.AdamW"  # step 5 is gradient records of step 4
    assert out[8].startswith("['grad/")
    assert out[9] == "True True"  # replayed bit-exactly, exact
    assert out[10:12] == ["unknown_extension", "False ReplayWarning"]
    assert out[12:] == ["step 3 rewritten as a full step", "full True", "True"]
