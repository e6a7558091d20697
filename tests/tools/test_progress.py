"""Progress bars (ucl.io.progress, ucl.tools.progress): drawn on a terminal only, forced by UCL_PROGRESS,
at most 10 times a second; ``ucl validate`` and large loads draw one (checked on a real pty)."""

from __future__ import annotations

import io
import os
import pty
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import ucl
from ucl.io import progress as io_progress
from ucl.tools import progress
from ucl.tools.validate import validate_repo

BAR = re.compile(r"(\w+) \[([#.]{28})\] +(\d+)%  ([\d.]+ [kMGT]?B) / ([\d.]+ [kMGT]?B)  ([\d.]+ [kMGT]?B)/s")


class TTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(autouse=True)
def _auto_env(monkeypatch):
    """The defaults as on a developer's terminal: no UCL_PROGRESS, no CI."""
    for k in ("UCL_PROGRESS", "UCL_PROGRESS_MIN_BYTES", "CI"):
        monkeypatch.delenv(k, raising=False)


def lines(text: str) -> list[str]:
    """The successive states of a bar: what each carriage return redraws."""
    states = (x.replace("\x1b[K", "").strip() for x in re.split(r"\r\n?|\n", text))
    return [x for x in states if x]


# -- the bar ---------------------------------------------------------------------------------------
def test_bar_draws_on_a_terminal_only() -> None:
    quiet = io.StringIO()
    with progress.bar(100, "import", stream=quiet) as b:
        b.update(50)
    assert quiet.getvalue() == ""
    tty = TTY()
    with progress.bar(3_000_000, "export", stream=tty) as b:
        for _ in range(3):
            b.update(1_000_000)
    text = tty.getvalue()
    assert text.startswith("\rexport [") and text.endswith("\n")
    m = BAR.fullmatch(lines(text)[-1])
    assert m and m.groups()[:5] == ("export", "#" * 28, "100", "3.0 MB", "3.0 MB")


def test_environment_forces_the_bar_on_and_off(monkeypatch) -> None:
    monkeypatch.setenv("UCL_PROGRESS", "1")
    piped = io.StringIO()
    with progress.bar(10, "validate", stream=piped) as b:
        b.update(10)
    assert "validate [" in piped.getvalue()
    monkeypatch.setenv("UCL_PROGRESS", "0")
    tty = TTY()
    with progress.bar(10, "validate", stream=tty) as b:
        b.update(10)
    assert tty.getvalue() == ""
    with progress.bar(10, "validate", stream=tty, enabled=True) as b:  # an explicit choice wins
        b.update(10)
    assert "validate [" in tty.getvalue()


def test_ci_silences_the_processes_stderr(monkeypatch) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(sys, "stderr", TTY())
    assert not progress.enabled()
    monkeypatch.setenv("CI", "false")
    assert progress.enabled()


def test_redrawn_at_most_ten_times_a_second() -> None:
    tty = TTY()
    t0 = time.monotonic()
    with progress.bar(0, "load", stream=tty) as b:  # no total: a counter
        while time.monotonic() - t0 < 0.35:
            b.update(1)
    states = lines(tty.getvalue())
    assert 2 <= len(states) <= 6  # the first draw, ~3 more in 0.35 s, the final one
    assert all(re.fullmatch(r"load  [\d.]+ [kMGT]?B  [\d.]+ [kMGT]?B/s", s) for s in states)


def test_small_library_calls_and_nested_bars_stay_silent() -> None:
    tty = TTY()
    with progress.bar(100, "validate", stream=tty, min_total=1000) as b:  # below the library threshold
        b.update(100)
    assert tty.getvalue() == "" and not b.enabled
    with progress.bar(100, "export", stream=tty) as outer:
        with progress.bar(100, "load", stream=tty) as inner:  # an export's reads: the outer bar speaks
            inner.update(100)
        outer.update(100)
    assert "load" not in tty.getvalue() and "export [" in tty.getvalue()
    with progress.bar(1, "after", stream=tty) as b:  # the outer one closed: bars draw again
        assert b.enabled


def test_watch_polls_a_counter_and_ends_full() -> None:
    tty = TTY()
    done = [0]

    def work() -> None:
        for _ in range(30):
            done[0] += 10
            time.sleep(0.01)

    with progress.watch(300, "load", lambda: done[0], stream=tty, min_total=0) as bar:
        assert bar is not None
        work()
    states = lines(tty.getvalue())
    assert BAR.fullmatch(states[-1]).group(3) == "100"
    assert not any(t.name == "ucl-progress" for t in threading.enumerate())
    quiet = TTY()
    with progress.watch(300, "load", lambda: 0, stream=quiet, min_total=301) as bar:  # below: no thread
        assert bar is None
    assert quiet.getvalue() == ""


def test_the_tools_module_is_the_io_one() -> None:
    assert progress.Progress is io_progress.Progress and progress.bar is io_progress.bar


# -- validate, in process --------------------------------------------------------------------------
def test_validate_counts_the_recorded_bytes(tmp_path, capsys) -> None:
    ucl.save({"a": torch.randn(1000), "b": torch.randn(50, 50)}, tmp_path, step=1)
    ucl.save({"a": torch.randn(1000)}, tmp_path, step=2)
    total = sum(ucl.Repository.open(tmp_path).commit_record(s).nbytes for s in (1, 2))
    capsys.readouterr()
    assert validate_repo(tmp_path, progress=True).ok
    err = capsys.readouterr().err
    m = BAR.fullmatch(lines(err)[-1])
    assert m and m.group(1) == "validate" and m.group(3) == "100"
    assert m.group(5) == f"{total / 1000:.1f} kB"
    assert validate_repo(tmp_path).ok and capsys.readouterr().err == ""  # stderr is not a terminal here


# -- the command and a load on a real terminal -----------------------------------------------------
def _run(argv: list[str], tty: bool, **env: str) -> tuple[int, str, str]:
    """Run ``argv`` with stderr on a pty (``tty``) or a pipe; (exit status, stdout, stderr)."""
    e = {k: v for k, v in os.environ.items() if k not in ("UCL_PROGRESS", "UCL_PROGRESS_MIN_BYTES", "CI",
                                                          "PYTEST_CURRENT_TEST")}
    e.update(env)
    if not tty:
        r = subprocess.run(argv, capture_output=True, text=True, env=e, timeout=300)
        return r.returncode, r.stdout, r.stderr
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=e)
    finally:
        os.close(slave)
    chunks = []
    out: list[bytes] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()))  # type: ignore[union-attr]
    reader.start()
    try:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        os.close(master)
    rc = proc.wait(timeout=300)
    reader.join()
    proc.stdout.close()  # type: ignore[union-attr]
    return rc, b"".join(out).decode(), b"".join(chunks).decode()


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    p = tmp_path_factory.mktemp("progress") / "ckpt"
    g = torch.Generator().manual_seed(0)
    ucl.save({f"w{i}": torch.randn(256, 1024, generator=g) for i in range(4)}, p, step=1)  # 4 MiB
    return p


def test_validate_draws_a_bar_on_a_terminal_not_on_a_pipe(repo) -> None:
    cmd = [sys.executable, "-m", "ucl", "validate", str(repo)]
    rc, out, err = _run(cmd, tty=True)
    assert rc == 0 and "valid" in out
    states = lines(err)
    assert states, "no bar on a terminal"
    for s in states:
        m = BAR.fullmatch(s)
        assert m and m.group(1) == "validate", s
    assert BAR.fullmatch(states[-1]).group(3) == "100"
    total = ucl.Repository.open(repo).commit_record(1).nbytes
    assert BAR.fullmatch(states[-1]).group(5) == f"{total / 1e6:.1f} MB"
    percents = [int(BAR.fullmatch(s).group(3)) for s in states]
    assert percents == sorted(percents)  # never goes back
    rc, out, err = _run(cmd, tty=False)
    assert rc == 0 and err == ""  # piped: nothing
    rc, out, err = _run(cmd, tty=True, UCL_PROGRESS="0")
    assert rc == 0 and err == ""
    rc, out, err = _run(cmd + ["--json"], tty=False, UCL_PROGRESS="1")  # forced into a pipe; stdout: JSON
    assert rc == 0 and "validate [" in err and out.lstrip().startswith("{")


def test_large_loads_draw_a_bar_on_a_terminal(repo) -> None:
    script = textwrap.dedent(f"""
        import os, sys, ucl
        p = {str(repo)!r}
        ucl.load(p)                                   # 4 MiB: below the 256 MiB of library calls
        sys.stderr.write("|small done|")
        os.environ["UCL_PROGRESS_MIN_BYTES"] = "1000000"
        ucl.load(p)                                   # ucl.load -> Checkpoint.load
        sys.stderr.write("|load done|")
        with ucl.open(p) as ckpt:
            ckpt.load()
        sys.stderr.write("|open done|")
        from ucl.layout import Layout
        ucl.load(p, layout=Layout())                  # a target layout: the planned fill
        sys.stderr.write("|layout done|")
    """)
    rc, out, err = _run([sys.executable, "-c", script], tty=True)
    assert rc == 0, err
    small, load, opened, layout, rest = err.split("|")[0::2]
    assert small == "" and rest.strip() == ""
    for part in (load, opened, layout):
        states = lines(part)
        assert states and all(BAR.fullmatch(s) and BAR.fullmatch(s).group(1) == "load" for s in states), part
        assert BAR.fullmatch(states[-1]).group(3) == "100"
    rc, out, err = _run([sys.executable, "-c", script], tty=False)
    assert rc == 0 and err == "|small done||load done||open done||layout done|"
