"""The runnable snippets of docs/reshard.md, executed in order, as a reader would paste them."""

from __future__ import annotations

from .docs_pages import run_page


def test_reshard_page(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    run_page("reshard.md", min_blocks=8)
    out = capsys.readouterr().out
    for shown in [
        "45 torch.Size([128, 64])",
        "torch.Size([64, 64])",
        "torch.Size([288, 64])",
        "False",
        "2 torch.Size([512, 64])",
        "torch.Size([192, 64])",
        "tensor(0.)",
        "torch.Size([43168])",
        "rules_overlap",
        "pattern_unmatched",
    ]:
        assert shown in out, shown
