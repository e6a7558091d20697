"""Run a function on N real processes joined in a torch.distributed (gloo) group on localhost.

``run(world, "tests.write.dist_cases:save_replicated", {"path": ...})`` starts ``world`` Python processes,
each calling ``init_process_group("gloo")`` then the function with ``(rank, world, **kwargs)``; returns
their JSON-able results by rank, or raises with every failed rank's stderr.
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import subprocess
import sys
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run(world: int, target: str, kwargs: dict[str, Any], timeout: float = 240.0,
        expect_fail: bool = False) -> list[Any]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-m", "ucl.testing.dist", target, json.dumps(kwargs)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results: list[Any] = []
    errors = []
    for rank, p in enumerate(procs):
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise TimeoutError(f"rank {rank} of {target} did not finish in {timeout} s") from None
        if p.returncode != 0:
            errors.append(f"--- rank {rank} exited {p.returncode}\n{err[-4000:]}")
            results.append(None)
        else:
            results.append(json.loads(out.strip().splitlines()[-1]))
    if errors and not expect_fail:
        raise RuntimeError(f"{target} failed on {len(errors)} rank(s):\n" + "\n".join(errors))
    return results


def _main() -> None:
    import torch.distributed as dist

    target, kwargs = sys.argv[1], json.loads(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
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


if __name__ == "__main__":
    _main()
