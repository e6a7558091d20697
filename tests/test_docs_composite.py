"""The runnable snippets of docs/composite.md, executed in order, as a reader would paste them."""

from __future__ import annotations

from .docs_pages import run_page


def test_composite_page(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    run_page("composite.md", min_blocks=3)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "1 exact"
    assert any(line.endswith("of 5 groups stale") for line in out[1:6]), out
    assert out[6] == "unknown_extension"
    assert out[7].startswith("False [('model/")
    assert out[8] == "ApproximateWarning True"
