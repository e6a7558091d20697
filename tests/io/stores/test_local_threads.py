"""LocalStore's cache of verified directories is shared by the threads of a manager (the caller deletes
an earlier attempt's files while the persister writes): forgetting a deleted directory never iterates a
set another thread grows (it did: "Set changed size during iteration", seen in CI)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

from ucl.io.stores.local import LocalStore


def test_forgetting_directories_while_another_thread_writes(tmp_path: Path) -> None:
    store = LocalStore(str(tmp_path))
    for i in range(3000):  # a large cache: iterating it takes long enough to be interrupted
        store._dirs_ok.add(str(tmp_path / "old" / str(i)))
    stop = threading.Event()
    errors: list[BaseException] = []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            store.write(f"steps/2/w/c/{i % 50}/{i}", [b"x"], durable=False)
            i += 1

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    t = threading.Thread(target=writer)
    t.start()
    try:
        for k in range(100):
            try:
                store.delete_prefix(f"steps/{1000 + k}")  # absent: only the cache is walked
            except BaseException as e:  # noqa: BLE001
                errors.append(e)
                break
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(old)
    assert not errors, errors
