"""Per-data-parallel-rank state (spec/core.md §5.3 item 9): a sampler that counts consumed samples, and the
handover of the ranks' states when a step is restored by a different number of data-parallel ranks.

``CheckpointManager.save(step, state, rank_state=...)`` stores each data-parallel rank's small state (a
dataloader's or sampler's ``state_dict()``, per-rank RNG states) in the step; ``restore(rank_state=True)``
gives each rank its own back. When the data-parallel size changed, the saved states are first handed
over: ``handover(old_states, new_world) -> new_states``. The built-in :func:`default_handover` re-splits
every :class:`ConsumedSamplesSampler` state (found at the same place in every rank's state) so that the
new ranks together see exactly the samples of the epoch no old rank consumed, each once; for any other
state it raises, naming where, so that a hook must say what to do (docs/state.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from ucl.errors import InvalidArgumentError
from ucl.format import structure
from ucl.write.collectives import Collectives, error_dict, error_from

__all__ = ["KIND", "ConsumedSamplesSampler", "attach", "consumed_samples_handover", "default_handover",
           "dp_coords", "hand_over", "is_sampler_state", "restored"]

KIND = "ucl.consumed_samples"
"""The ``kind`` of a :class:`ConsumedSamplesSampler` state."""

Handover = Callable[[list[Any], int], Sequence[Any]]


def is_sampler_state(obj: Any) -> bool:
    """Whether ``obj`` is a :meth:`ConsumedSamplesSampler.state_dict`."""
    return isinstance(obj, Mapping) and obj.get("kind") == KIND


class ConsumedSamplesSampler(torch.utils.data.Sampler[int]):
    """A data-parallel sampler whose state is the samples of the epoch consumed so far.

    The epoch's order is a permutation of ``range(size)`` (``torch.randperm`` seeded with ``seed + epoch``;
    the identity without ``shuffle``), the same on every rank. Its positions are dealt round-robin: rank
    ``r`` of ``world`` gets positions ``base + r, base + r + world, ...``, after its share ``pending[r::world]``
    of the positions an earlier handover left over. Nothing is padded or dropped: the ranks' shares differ by
    at most two samples.

    ``state_dict(consumed=)`` records how many of its share this rank has consumed; restored by another
    number of ranks, :func:`consumed_samples_handover` deals what is left to them, so that the rest of the
    epoch visits every sample no rank consumed exactly once.

    Parameters
    ----------
    size
        The dataset's length.
    rank, world
        This data-parallel rank and the data-parallel size.
    shuffle, seed
        Shuffle each epoch (seeded with ``seed + epoch``), or keep the dataset's order.
    """

    def __init__(self, size: int, *, rank: int = 0, world: int = 1, shuffle: bool = True, seed: int = 0) -> None:
        if not (isinstance(size, int) and size >= 0):
            raise InvalidArgumentError(f"size must be an int >= 0, got {size!r}")
        if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
            raise InvalidArgumentError(f"rank {rank!r} of world {world!r}: need 0 <= rank < world")
        self.size, self.rank, self.world, self.shuffle, self.seed = size, rank, world, bool(shuffle), int(seed)
        self.set_epoch(0)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning (nothing consumed)."""
        self.pending: list[int] = []
        self.epoch, self.base, self.consumed = int(epoch), 0, 0
        self.yielded = 0  # indices yielded since the epoch was set or a state loaded

    def _positions(self) -> list[int]:
        """This rank's positions of the epoch's order, in the order it visits them."""
        return self.pending[self.rank::self.world] + list(range(self.base + self.rank, self.size, self.world))

    def order(self) -> list[int]:
        """The epoch's order: position -> dataset index."""
        if not self.shuffle:
            return list(range(self.size))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.size, generator=g).tolist()

    def __iter__(self) -> Iterator[int]:
        order = self.order()
        start, self.yielded = self.consumed, 0
        for pos in self._positions()[start:]:
            self.yielded += 1
            yield order[pos]

    def __len__(self) -> int:
        return max(0, len(self._positions()) - self.consumed)

    def state_dict(self, consumed: int | None = None) -> dict[str, Any]:
        """This rank's state: ``consumed`` is how many indices this rank has consumed since the epoch was
        set or the state loaded (default: how many the sampler has yielded since; pass the count of
        samples the training loop used when a DataLoader prefetches)."""
        done = self.yielded if consumed is None else int(consumed)
        if not 0 <= done <= len(self):
            raise InvalidArgumentError(f"consumed={done}: this rank has {len(self)} samples left in the epoch")
        return {"kind": KIND, "size": self.size, "shuffle": self.shuffle, "seed": self.seed, "epoch": self.epoch,
                "world": self.world, "rank": self.rank, "base": self.base, "pending": list(self.pending),
                "consumed": self.consumed + done}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from ``state`` (this rank's, handed over to this data-parallel size if it changed)."""
        if not is_sampler_state(state):
            raise InvalidArgumentError(f"not a ConsumedSamplesSampler state: {str(state)[:200]}")
        if (state["world"], state["rank"]) != (self.world, self.rank):
            raise InvalidArgumentError(
                f"the sampler state is rank {state['rank']} of {state['world']}, this sampler rank {self.rank} of "
                f"{self.world}: hand the ranks' states over first (ucl.write.rank_state.default_handover)")
        if (state["size"], state["shuffle"], state["seed"]) != (self.size, self.shuffle, self.seed):
            raise InvalidArgumentError(
                f"the sampler state is for size={state['size']}, shuffle={state['shuffle']}, seed={state['seed']}; "
                f"this sampler has size={self.size}, shuffle={self.shuffle}, seed={self.seed}")
        self.epoch, self.base = int(state["epoch"]), int(state["base"])
        self.pending, self.consumed, self.yielded = [int(p) for p in state["pending"]], int(state["consumed"]), 0


def consumed_samples_handover(old: Sequence[Mapping[str, Any]], new_world: int) -> list[dict[str, Any]]:
    """The states of ``new_world`` ranks that continue the epoch of ``old`` (one state per old rank, in rank
    order): together they visit every position no old rank consumed, each exactly once.

    The positions below ``base`` not consumed, and those between the least and the most any rank consumed,
    become ``pending`` (at most a few per old rank); ``base`` moves past the last consumed position.
    """
    first = old[0] if old else None
    if first is None or not all(is_sampler_state(s) for s in old):
        raise InvalidArgumentError("consumed_samples_handover needs one ConsumedSamplesSampler state per rank")
    world = len(old)
    same = ("size", "shuffle", "seed", "epoch", "base", "pending", "world")
    for r, s in enumerate(old):
        if any(s[k] != first[k] for k in same) or s["world"] != world or s["rank"] != r:
            raise InvalidArgumentError(f"sampler state {r} of {world} does not continue the same epoch as rank 0's "
                                       f"(rank {s['rank']} of {s['world']}, epoch {s['epoch']})")
    size, base, pending = int(first["size"]), int(first["base"]), [int(p) for p in first["pending"]]
    left = set()  # positions below the new base that are not consumed
    deep = []  # per rank: how many of its round-robin positions (from base) it consumed
    for r, s in enumerate(old):
        mine = pending[r::world]
        k = int(s["consumed"])
        left.update(mine[k:])
        deep.append(max(0, k - len(mine)))
    hi = max(deep)
    new_base = min(size, base + world * hi)
    for r in range(world):
        left.update(p for p in range(base + world * deep[r] + r, new_base, world))
    out = []
    for r in range(new_world):
        out.append({**first, "world": new_world, "rank": r, "base": new_base, "pending": sorted(left), "consumed": 0})
    return out


def default_handover(old: list[Any], new_world: int, where: str = "") -> list[Any]:
    """Hand ``old`` (one state per old data-parallel rank) over to ``new_world`` ranks: sampler states
    re-split (:func:`consumed_samples_handover`), dicts and lists with the same keys on every rank handed over
    entry by entry, values equal on every rank kept; any other state raises InvalidArgumentError naming it."""
    if len(old) == new_world:
        return list(old)
    if old and all(is_sampler_state(s) for s in old):
        return consumed_samples_handover(old, new_world)
    if old and all(isinstance(s, Mapping) for s in old) and all(list(s) == list(old[0]) for s in old):
        parts = {k: default_handover([s[k] for s in old], new_world, f"{where}/{k}") for k in old[0]}
        return [{k: parts[k][r] for k in old[0]} for r in range(new_world)]
    if old and all(type(s) is list and len(s) == len(old[0]) for s in old):
        cols = [default_handover([s[i] for s in old], new_world, f"{where}/{i}") for i in range(len(old[0]))]
        return [[c[r] for c in cols] for r in range(new_world)]
    if old and all(_equal(s, old[0]) for s in old):
        return [old[0]] * new_world
    raise InvalidArgumentError(
        f"the per-rank state at {where or '/'!r} was saved by {len(old)} data-parallel ranks, differs between them "
        f"and has no built-in handover to {new_world}: pass restore(handover=fn), fn(old_states, new_world) -> "
        "new_states (docs/state.md)")


def _equal(a: Any, b: Any) -> bool:
    try:
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype and \
                a.shape == b.shape and torch.equal(a, b)
        if type(a).__module__ == "numpy" or type(b).__module__ == "numpy":
            return type(a) is type(b) and bool((a == b).all()) and getattr(a, "shape", ()) == getattr(b, "shape", ())
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 - values that do not compare are not equal
        return False


def hand_over(old: list[Any], new_world: int, handover: Handover | None) -> list[Any]:
    """``old`` for ``new_world`` ranks: through ``handover`` (default :func:`default_handover`) when the
    sizes differ, checked to give one state per new rank."""
    if len(old) == new_world:
        return list(old)
    new = list((handover or default_handover)(list(old), new_world))
    if len(new) != new_world:
        raise InvalidArgumentError(f"the handover returned {len(new)} per-rank states for {new_world} ranks")
    return new


# -- the manager's part --------------------------------------------------------------------------------------
def dp_coords(rank: int, world: int, mesh: Any) -> tuple[int, int]:
    """``(data-parallel rank, data-parallel size)`` of ``rank``: its ``dp`` coordinate under a mesh with a
    ``dp`` axis, else its rank in the manager's group (every rank a data-parallel rank)."""
    if mesh is not None and "dp" in mesh.names:
        return mesh.coords(rank)["dp"], mesh.axis_size("dp")
    return rank, world


def attach(tree: dict[str, Any], value: Any, ctl: Collectives, mesh: Any) -> dict[str, Any]:
    """Every rank: ``tree`` carrying every data-parallel rank's ``value`` (spec/core.md §5.3 item 9).

    Each rank encodes its value; the nodes are allgathered on ``ctl`` (so a value one rank cannot store
    fails the save on every rank, before anything is staged). Ranks of one data-parallel rank (tensor or
    pipeline peers under a mesh) are represented by the lowest of them."""
    try:
        mine: dict[str, Any] = {"node": structure.encode_value(value), "error": None}
    except Exception as e:  # noqa: BLE001 - the other ranks must learn of it
        mine = {"node": None, "error": error_dict(e, ctl.rank if ctl.world > 1 else None)}
    got = ctl.allgather(mine)
    failed = [g["error"] for g in got if g["error"] is not None]
    if failed:
        raise error_from(failed[0])
    size = dp_coords(0, ctl.world, mesh)[1]
    nodes: list[Any] = [None] * size
    for r, g in enumerate(got):
        d = dp_coords(r, ctl.world, mesh)[0]
        if nodes[d] is None:
            nodes[d] = g["node"]
    return structure.with_ranks(tree, nodes)


def restored(tree: dict[str, Any], rank: int, world: int, mesh: Any, handover: Handover | None) -> Any:
    """This rank's per-rank state from a step's ``tree`` (None when the step has none), handed over when the
    step was saved by another number of data-parallel ranks."""
    nodes = structure.rank_nodes(tree)
    if nodes is None:
        return None
    d, size = dp_coords(rank, world, mesh)
    return hand_over([structure.decode_value(n) for n in nodes], size, handover)[d]
