"""Run a function on N real processes joined in a torch.distributed (gloo) group on localhost.

``run(world, "tests.write.dist_cases:save_replicated", {"path": ...})`` starts ``world`` Python processes,
each calling ``init_process_group("gloo")`` then the function with ``(rank, world, **kwargs)``; returns
their JSON-able results by rank, or raises with every failed rank's stderr.

The ranks are forked from a zygote (multiprocessing's fork server) that has imported torch and ucl once:
a fresh interpreter importing torch costs ~2 s of CPU, and a test suite starts well over a hundred ranks.
Each rank is still its own process with its own environment, working directory, stdout and stderr, and
nothing of the test process but what the zygote imported before any tensor was made.
"""

from __future__ import annotations

import functools
import importlib
import json
import multiprocessing
import os
import signal
import sys
import tempfile
import time
from typing import Any

# what the zygote imports once (nothing that starts a thread or makes a tensor: it forks every rank)
PRELOAD = ["torch", "torch.distributed", "ucl"]


@functools.cache
def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _Rank:
    """A rank forked from the zygote, seen through the part of Popen that :func:`run` uses."""

    def __init__(self, env: dict[str, str], out: str, err: str, target: str, kwargs: str) -> None:
        self.proc = _context().Process(target=_rank_main, args=(env, out, err, target, kwargs))
        self.proc.start()

    def poll(self) -> int | None:
        return self.proc.exitcode

    @property
    def returncode(self) -> int | None:
        return self.proc.exitcode

    def kill(self) -> None:
        self.proc.kill()

    def wait(self) -> None:
        self.proc.join()


def run(world: int, target: str, kwargs: dict[str, Any], timeout: float = 240.0,
        expect_killed: bool = False, grace: float = 30.0) -> list[Any]:
    """Each rank's result, by rank; with ``expect_killed`` every rank must end by SIGKILL (a target that
    kills its own process: a crash), and the result is None for each.

    The rendezvous store is served by this process, on a port it bound (a port found free and bound
    later by rank 0 could be taken in between, by another test's ranks: a run failed before its target
    ran). Each rank's output goes to a file (never a pipe: a rank filling a pipe nobody reads would block
    in a collective and hang the others). When a rank fails, the others get ``grace`` seconds to finish
    (they may be waiting for it in a collective), then are killed. A rank still running at ``timeout``
    has printed every thread's stack (faulthandler, a few seconds earlier); every rank's stderr is in
    the error raised, and so is the end of each rank that did not end as expected.
    """
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False)
    port = store.port
    procs: list[_Rank] = []
    with tempfile.TemporaryDirectory(prefix="ucl-dist-") as logs:
        outs = [open(os.path.join(logs, f"{r}.out"), "w+b") for r in range(world)]  # noqa: SIM115
        errs = [open(os.path.join(logs, f"{r}.err"), "w+b") for r in range(world)]  # noqa: SIM115
        try:
            for rank in range(world):
                env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                           UCL_DIST_STACKS_AFTER=str(max(1.0, timeout - 5.0)))
                procs.append(_Rank(env, outs[rank].name, errs[rank].name, target, json.dumps(kwargs)))
            hung = _wait(procs, time.monotonic() + timeout, grace)

            def tail(rank: int) -> str:
                errs[rank].seek(0)
                return errs[rank].read().decode(errors="replace")[-4000:]

            if hung:
                state = {r: "running" if r in hung else f"exited {procs[r].returncode}" for r in range(world)}
                report = "\n".join(f"--- rank {r} ({state[r]})\n{tail(r)}" for r in range(world))
                raise TimeoutError(f"rank(s) {hung} of {target} did not finish in {timeout} s:\n{report}")
            if expect_killed:
                other = [r for r, p in enumerate(procs) if p.returncode != -signal.SIGKILL]
                if other:
                    raise RuntimeError(f"{target}: rank(s) {other} ended otherwise than killed by SIGKILL:\n"
                                       + "\n".join(f"--- rank {r} exited {procs[r].returncode}\n{tail(r)}"
                                                    for r in other))
                return [None] * world
            results: list[Any] = []
            errors = []
            for rank, p in enumerate(procs):
                if p.returncode != 0:
                    errors.append(f"--- rank {rank} exited {p.returncode}\n{tail(rank)}")
                else:
                    outs[rank].seek(0)
                    results.append(json.loads(outs[rank].read().decode().strip().splitlines()[-1]))
            if errors:
                raise RuntimeError(f"{target} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
            return results
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
            for f in outs + errs:
                f.close()
            del store  # the rendezvous served until every rank has ended


def _wait(procs: list[_Rank], deadline: float, grace: float | None) -> list[int]:
    """Wait for every process until ``deadline`` (or, once one has failed and ``grace`` is given, until
    ``grace`` seconds after that); the ranks still running then, killed."""
    failed_at = None
    while True:
        codes = [p.poll() for p in procs]
        running = [r for r, c in enumerate(codes) if c is None]
        if not running:
            return []
        now = time.monotonic()
        if failed_at is None and grace is not None and any(c not in (None, 0) for c in codes):
            failed_at = now
        if now >= deadline or (failed_at is not None and grace is not None and now - failed_at >= grace):
            for r in running:
                procs[r].kill()
            # a failed rank explains the others: they were waiting for it, report them as failed too
            return running if failed_at is None else []
        time.sleep(0.05)


def _rank_main(env: dict[str, str], out: str, err: str, target: str, kwargs: str) -> None:
    """A rank, in a process forked from the zygote: the caller's environment and files (multiprocessing
    itself gives it the caller's working directory and sys.path)."""
    os.environ.clear()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, path in ((1, out), (2, err)):
        f = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.dup2(f, fd)
        os.close(f)
    import torch

    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))  # the zygote read no OMP_NUM_THREADS of ours
    _main(target, json.loads(kwargs))


def _main(target: str, kwargs: dict[str, Any]) -> None:
    import faulthandler

    import torch.distributed as dist

    # a rank that hangs prints where every thread is before the parent kills it (run's error shows it)
    faulthandler.dump_traceback_later(float(os.environ.get("UCL_DIST_STACKS_AFTER", "235")), exit=False)

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    mod, fn = target.split(":")
    sys.path.insert(0, os.getcwd())
    result = getattr(importlib.import_module(mod), fn)(rank, world, **kwargs)
    dist.barrier()  # every rank is done with its collectives
    print(json.dumps(result), flush=True)
    sys.stderr.flush()
    # Leave without interpreter teardown: destroying process groups (and DCP's device-mesh subgroups)
    # while gloo's threads wind down aborts now and then ("terminate called without an active
    # exception"), failing a rank whose work had succeeded. The result is printed; exit now.
    os._exit(0)
