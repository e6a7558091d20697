"""metadata.acyclic: the cycle collector is paused while documents are parsed, and comes back as it was."""

import gc
import threading

import ucl
from ucl.format import metadata


def test_restores_an_enabled_collector_and_nests():
    assert gc.isenabled()
    with metadata.acyclic():
        assert not gc.isenabled()
        with metadata.acyclic():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the outer pause still holds
    assert gc.isenabled()


def test_leaves_a_disabled_collector_disabled():
    gc.disable()
    try:
        with metadata.acyclic():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_restores_it_on_an_error():
    try:
        with metadata.acyclic():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()


def test_threads_share_one_pause():
    inside, go = threading.Barrier(2), threading.Event()

    def hold():
        with metadata.acyclic():
            inside.wait()
            go.wait()

    t = threading.Thread(target=hold)
    t.start()
    inside.wait()
    with metadata.acyclic():
        pass
    assert not gc.isenabled()  # the other thread is still parsing
    go.set()
    t.join()
    assert gc.isenabled()


def test_open_starts_no_collection_over_the_process(tmp_path):
    """Opening a step of many tensors runs no collection older than the youngest generation (a full
    collection over the process's objects was most of a fresh process's ucl.open)."""
    import torch

    ucl.save({f"layer{i}.w": torch.full((3, 4), float(i)) for i in range(300)}, tmp_path / "c", step=1)
    seen = []

    def cb(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.collect()
    gc.callbacks.append(cb)
    try:
        with ucl.open(tmp_path / "c") as ck:
            names = list(ck.keys())
    finally:
        gc.callbacks.remove(cb)
    assert len(names) == 300
    assert set(seen) <= {0}, seen
    assert gc.isenabled()


def test_leaving_moves_the_young_objects_on_without_a_collection():
    """The objects made during the pause leave the youngest generation (no collection of them follows
    at the next allocation), and no collection runs on leaving: two list splices (freeze, unfreeze)."""
    gc.collect()
    seen = []

    def cb(phase, info):
        if phase == "start":
            seen.append(info["generation"])

    gc.callbacks.append(cb)
    try:
        with metadata.acyclic():
            made = [[i] for i in range(50_000)]
        young = gc.get_count()[0]
    finally:
        gc.callbacks.remove(cb)
    assert seen == [] and young < 100, (seen, young)
    assert len(made) == 50_000 and gc.isenabled()


def test_a_programs_frozen_objects_stay_frozen():
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with metadata.acyclic():
            made = [[i] for i in range(1000)]
        assert gc.get_freeze_count() == frozen  # unfreeze would have released them
        assert len(made) == 1000
    finally:
        gc.unfreeze()
