"""The snippets of docs/dcp.md and docs/cli.md run as written.

Every ```python block runs, in order, in one namespace, in an empty directory; every ```sh block whose
first command starts with ``ucl `` runs each ``ucl ...`` line through :func:`ucl.tools.cli.main` and checks its
exit status (0, or the ``# exit N`` the line ends with). A block preceded by ``<!-- skip: why -->`` is
not run.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from ucl.tools.cli import main

DOCS = Path(__file__).resolve().parent.parent / "docs"
FENCE = re.compile(r"(?P<skip><!-- skip:[^>]*-->\n)?```(?P<lang>\w*)\n(?P<body>.*?)\n```", re.S)


def blocks(doc: Path) -> list[tuple[str, str, int, bool]]:
    text = doc.read_text()
    return [(m["lang"], m["body"], text.count("\n", 0, m.start("body")) + 1, bool(m["skip"]))
            for m in FENCE.finditer(text)]


def run_sh(body: str, where: str) -> int:
    n = 0
    for line in body.splitlines():
        if not line.startswith("ucl "):
            continue
        m = re.search(r"#\s*exit\s+(\d+)", line)
        expected = int(m.group(1)) if m else 0
        argv = shlex.split(line, comments=True)[1:]
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(argv)
        assert rc == expected, f"{where}: {line!r} exited {rc}, expected {expected}\n{out.getvalue()}{err.getvalue()}"
        n += 1
    return n


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
@pytest.mark.parametrize("name", ["dcp.md", "cli.md"])
def test_doc_snippets_run(name, tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    doc = DOCS / name
    ns: dict[str, object] = {"__name__": f"docs.{name}"}
    ran = {"python": 0, "sh": 0, "skipped": 0}
    for lang, body, line, skip in blocks(doc):
        where = f"{doc}:{line}"
        if skip:
            ran["skipped"] += 1
            continue
        if lang == "python":
            exec(compile(body, where, "exec"), ns)  # noqa: S102 - our own documentation
            ran["python"] += 1
        elif (lang == "sh"
              and next((x for x in body.splitlines() if x and not x.startswith("#")), "").startswith("ucl ")):
            ran["sh"] += run_sh(body, where)
    capsys.readouterr()
    assert ran["python"] >= 5 and ran["sh"] >= 2, ran  # the page really was exercised
    if name == "dcp.md":
        assert ran["skipped"] == 1  # the torchrun example, which tests/adapters/test_dcp.py runs on two processes


def test_every_command_is_documented() -> None:
    text = (DOCS / "cli.md").read_text()
    for cmd in ("ls", "info", "validate", "diff", "gc", "compact", "import", "export"):
        assert re.search(rf"^ucl {cmd} ", text, re.M), cmd
