"""ucl.io.fds: the descriptor budget a bulk read's batches share."""

from __future__ import annotations

import os
import threading
import time

from ucl.io import fds


def test_a_batch_waits_until_all_it_asks_for_is_free() -> None:
    b = fds.Budget(4)
    order: list[str] = []

    def second() -> None:
        with b.hold(2):
            order.append("second")

    with b.hold(3):
        t = threading.Thread(target=second)
        t.start()
        time.sleep(0.05)
        order.append("first done")  # 1 free: the second batch of 2 still waits
    t.join(5)
    assert order == ["first done", "second"]


def test_a_batch_larger_than_the_budget_takes_all_of_it() -> None:
    b = fds.Budget(0)  # never less than one
    assert b.size == 1
    with b.hold(50):
        pass
    with b.hold(1):  # all of it given back
        pass


def test_headroom_counts_what_is_open() -> None:
    before = fds.in_use()
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(10)]
    try:
        assert fds.in_use() == before + 10
        assert fds.headroom() == fds.limit() - before - 10
    finally:
        for fd in held:
            os.close(fd)
