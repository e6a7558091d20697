"""Which holder of a replicated chunk writes it (ucl/plan/layout_save.py ``_choose_writers``): the largest
chunk first, each to the least-loaded holder, ties to the lowest index; every holder computes the same
assignment. Checked against the plain linear scan it replaced (a heap, so that a chunk held by thousands
of data-parallel replicas costs log(holders) instead of a pass over them)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ucl.plan.layout_save import _choose_writers


def _linear(items: list[Any], size: int, pos: int) -> list[Any]:
    load = [0] * size
    mine = []
    for w in sorted(items, key=lambda x: (-x.nbytes, x.array.name, x.chunk_index)):
        who = min(range(size), key=lambda r: (load[r], r))
        load[who] += max(1, w.nbytes)
        if who == pos:
            mine.append(w)
    return sorted(mine, key=lambda w: (w.array.name, w.chunk_index))


@settings(max_examples=200, deadline=None)
@given(sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=40), holders=st.integers(2, 70),
       data=st.data())
def test_the_heap_assigns_as_the_linear_scan(sizes: list[int], holders: int, data: Any) -> None:
    items = [SimpleNamespace(nbytes=n, array=SimpleNamespace(name=f"a{i % 3}"), chunk_index=(i,))
             for i, n in enumerate(sizes)]
    pos = data.draw(st.integers(0, holders - 1))
    got = _choose_writers([(w, ("g",), holders, pos) for w in items])
    assert got == _linear(items, holders, pos)
    # every chunk has exactly one writer among the holders
    owners = [w for p in range(holders) for w in _choose_writers([(x, ("g",), holders, p) for x in items])]
    assert sorted(id(w) for w in owners) == sorted(id(w) for w in items)
