"""Composite steps (spec/delta.md §9): layer-wise pruned checkpoints, opt-in and marked approximate.

A composite step stores only the groups of tensors (a parameter with its optimizer state; by default
a layer's) that changed enough since their last stored version, and refers, for every other group, to
the step that carries its values (a ``stale`` array record with its age). The step is marked with the
``ucl.composite`` extension, so readers refuse it unless asked for ``approximate=True``.

Who does what:

- :class:`Prune` is the policy (``DeltaPolicy(base="previous", prune=Prune(...))``): the threshold on the
  relative update norm, an optional top-k, the staleness bound ``max_age`` and the grouping patterns.
- :func:`group_map` (the caller thread, once per save): each tensor's group, from the names and, when
  ``save(..., optimizer=)`` is given, which optimizer state belongs to which parameter (by storage
  identity, as gradient records find it: no pass over the data).
- :class:`Composer` (the persister thread): the values of every tensor as readers reconstruct them
  (its last stored version) and the step each group was last stored in; :meth:`Composer.select` decides
  a save's stale groups from the staged copy the persister already holds (the statistic is computed
  there, never on the training thread); :meth:`Composer.committed` advances after the commit.

The changed groups are stored as lossless deltas against their last stored version (``lossless=True``)
or full; the values a reader reconstructs for a stored group are exactly the staged ones, so a composite
step without stale groups is exact (and carries no extension).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ucl.errors import InvalidArgumentError
from ucl.format.records import Composite, StaleGroup

__all__ = ["DEFAULT_GROUPS", "CompositeJob", "Composer", "Prune", "group_map"]

#: The default grouping: a tensor inside a numbered layer (``layers.3.``, ``h.3.``, ``blocks.3.``,
#: ``layer.3.``, with ``.`` or ``/``) belongs to that layer; any other to its module (the name without
#: its last component).
DEFAULT_GROUPS: tuple[str, ...] = (r"^(.*?(?:^|[./])(?:layers|layer|h|blocks|block)[./]\d+)(?:[./]|$)",
                                   r"^(.*)[./][^./]+$")


@dataclass(frozen=True)
class Prune:
    """Which groups a composite step stores (spec/delta.md §9; opt-in, the step is approximate).

    Parameters
    ----------
    threshold : float
        A group whose relative update norm since its last stored version,
        ``sqrt(sum ||x - x_stored||^2 / sum ||x_stored||^2)`` over its floating-point tensors, is at most
        ``threshold`` is left stale (referred to, not stored). 0: every group that changed at all is
        stored, which is exactly a lossless delta step.
    top_k : int or None
        Also store at most ``top_k`` of the groups above the threshold (those with the largest update);
        the rest are stale. Bit-identical groups cost nothing and are always stored; groups due by
        ``max_age`` are stored beside the ``top_k``.
    max_age : int
        The staleness bound, in steps: a group is stored whenever its last stored version would be
        ``max_age`` steps old or older, so a reader never gets values ``max_age`` or more steps old
        (saving every step: every group is stored at least every ``max_age`` steps).
    groups : sequence of str
        Regular expressions (``re.search`` on the tensor name); a tensor's group is the first one that
        matches: its first capturing group, or the whole match. A tensor none matches is a group of its
        own. Optimizer state follows its parameter when ``save(..., optimizer=)`` names the optimizer.
    lossless : bool
        Store the changed groups as lossless deltas against their last stored version (default) or
        full.
    """

    threshold: float = 0.0
    top_k: int | None = None
    max_age: int = 8
    groups: tuple[str, ...] = DEFAULT_GROUPS
    lossless: bool = True

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidArgumentError(f"Prune: threshold must be a finite number >= 0, got {t!r}")
        object.__setattr__(self, "threshold", float(t))
        if self.top_k is not None and (not isinstance(self.top_k, int) or isinstance(self.top_k, bool)
                                       or self.top_k < 1):
            raise InvalidArgumentError(f"Prune: top_k must be a positive integer or None, got {self.top_k!r}")
        if not isinstance(self.max_age, int) or isinstance(self.max_age, bool) or self.max_age < 1:
            raise InvalidArgumentError(f"Prune: max_age must be a positive integer (steps), got "
                                       f"{self.max_age!r}")
        if isinstance(self.groups, str) or not all(isinstance(g, str) for g in self.groups):
            raise InvalidArgumentError(f"Prune: groups must be a sequence of regular expressions, got "
                                       f"{self.groups!r}")
        for g in self.groups:
            try:
                re.compile(g)
            except re.error as e:
                raise InvalidArgumentError(f"Prune: group pattern {g!r} is not a regular expression: "
                                           f"{e}") from None
        object.__setattr__(self, "groups", tuple(self.groups))
        if not isinstance(self.lossless, bool):
            raise InvalidArgumentError(f"Prune: lossless must be a bool, got {self.lossless!r}")

    def group_of(self, name: str) -> str:
        """The group of the tensor ``name`` by the patterns alone."""
        for pat in self.groups:
            m = re.search(pat, name)
            if m is not None:
                key = m.group(1) if m.re.groups else m.group(0)
                if key:
                    return key
        return name


def group_map(prune: Prune, names: Iterable[str],
              owners: Mapping[str, str] | None = None) -> dict[str, tuple[str, bool]]:
    """Every tensor's ``(group, measured)``: ``owners`` maps an optimizer state tensor to its parameter's
    name (whose group it joins); other tensors are grouped by ``prune.groups``. ``measured``: the tensor
    counts in the group's update statistic (the parameters, not their optimizer state, when ``owners``
    says which is which; else every tensor)."""
    owners = owners or {}
    return {n: (prune.group_of(owners.get(n, n)), n not in owners) for n in names}


def optimizer_owners(params: list[str], prefix: str | None, names: Iterable[str]) -> dict[str, str]:
    """``<prefix>/state/<i>/<key>`` -> ``params[i]``: the parameter each optimizer state tensor belongs to
    (``params`` and ``prefix`` from :func:`ucl.delta.gradients.locate`)."""
    if prefix is None:
        return {}
    head = prefix + "/state/"
    out = {}
    for n in names:
        if n.startswith(head):
            i = n[len(head):].split("/", 1)[0]
            if i.isdigit() and int(i) < len(params):
                out[n] = params[int(i)]
    return out


@dataclass
class CompositeJob:
    """The persister's decision for one composite save (world 1, one piece)."""

    parent: int  # the previous committed step (the chain goes through every composite step)
    bases: dict[str, int]  # every tensor -> the step its stored version is in (chunked / unchanged base)
    stale: dict[str, tuple[int, int]]  # stale tensors -> (base_step, age)
    stored_groups: set[str]  # the groups this step stores
    write_full: set[str]  # tensors written full (Prune.lossless=False: the changed groups'), not as deltas
    marker: Composite | None  # the step's ucl.composite extension (None: nothing stale, the step is exact)
    updates: dict[str, float] = field(default_factory=dict)  # group -> its relative update norm


class Composer:
    """The persister's state for composite steps: the last stored version of every tensor.

    ``values`` holds, per tensor, exactly what a reader reconstructs for it at the newest committed step
    (one host copy of the state, kept up to date from the staged copies); ``stored_at`` the step each
    group was last stored in.
    """

    def __init__(self, prune: Prune) -> None:
        self.prune = prune
        self.values: dict[str, torch.Tensor] = {}
        self.stored_at: dict[str, int] = {}
        self.groups: dict[str, str] = {}
        self.measured: set[str] = set()  # the tensors of the update statistic
        self._norm2: dict[str, float] = {}  # ||values[n]||^2 of the measured floating tensors (cached)
        self._map: dict[str, tuple[str, bool]] = {}
        self.plan_key: int | None = None

    def reset(self, step: int, staged: Mapping[str, torch.Tensor], groups: Mapping[str, tuple[str, bool]],
              plan_key: int) -> None:
        """After a full step: every tensor stored at ``step``."""
        self.values = {n: t.detach().clone() for n, t in staged.items()}
        self._map = dict(groups)
        self.groups = {n: g for n, (g, _) in groups.items()}
        self.measured = {n for n, (_, m) in groups.items() if m}
        self.stored_at = dict.fromkeys(set(self.groups.values()), step)
        self.plan_key = plan_key
        self._norm2 = {n: _norm2(self.values[n]) for n in self.measured}

    def usable(self, staged: Mapping[str, torch.Tensor], groups: Mapping[str, tuple[str, bool]],
               plan_key: int) -> bool:
        """Whether the next save can be composite against this state (same plan, tensors and groups)."""
        return self.plan_key == plan_key and staged.keys() == self.values.keys() and dict(groups) == self._map

    def select(self, step: int, parent: int, staged: Mapping[str, torch.Tensor]) -> CompositeJob:
        """Which groups step ``step`` stores; the statistic from ``staged`` (the persister's copy)."""
        p = self.prune
        members: dict[str, list[str]] = {}
        for n, g in self.groups.items():
            members.setdefault(g, []).append(n)
        updates: dict[str, float] = {}
        identical: set[str] = set()
        for g, ns in members.items():
            measured = [n for n in ns if n in self.measured] or ns
            u, zero = _update((staged[n], self.values[n], self._norm2.get(n)) for n in measured)
            # bit-identical (stored as unchanged, free and exact): only looked at when the measured
            # tensors did not change, so a changing group costs one pass over its parameters
            same = zero and all(torch.equal(_bits(staged[n]), _bits(self.values[n]))
                                for n in ns if n not in measured)
            updates[g] = u
            if same:
                identical.add(g)
        stored = set(identical)
        candidates = []
        for g, u in updates.items():
            if g in identical:
                continue
            if step - self.stored_at[g] >= p.max_age or not math.isfinite(u):
                stored.add(g)  # due by max_age, or a statistic that cannot be compared
            elif u > p.threshold or p.threshold == 0.0:  # (0: even an update of norm 0, e.g. -0.0 for 0.0)
                candidates.append(g)
        candidates.sort(key=lambda g: (-updates[g], g))
        stored |= set(candidates if p.top_k is None else candidates[: p.top_k])
        stale_groups = sorted(set(members) - stored)
        stale: dict[str, tuple[int, int]] = {}
        marker = None
        if stale_groups:
            out = []
            for g in stale_groups:
                b = self.stored_at[g]
                out.append(StaleGroup(group=g, base_step=b, age=step - b, update=updates[g],
                                      tensors=tuple(members[g])))
                stale.update({n: (b, step - b) for n in members[g]})
            marker = Composite(stale=tuple(out), groups=len(members), threshold=p.threshold, top_k=p.top_k,
                               max_age=p.max_age)
        bases = {n: self.stored_at[g] for n, g in self.groups.items()}
        write_full = set() if p.lossless else {n for n, g in self.groups.items() if g in stored - identical}
        return CompositeJob(parent=parent, bases=bases, stale=stale, stored_groups=stored,
                            write_full=write_full, marker=marker, updates=updates)

    def committed(self, step: int, job: CompositeJob, staged: Mapping[str, torch.Tensor]) -> None:
        """After composite step ``step`` committed: its stored groups' last stored version is ``staged``."""
        for n, g in self.groups.items():
            if g in job.stored_groups:
                self.values[n].copy_(staged[n])
                if n in self.measured:
                    self._norm2[n] = _norm2(self.values[n])
        for g in job.stored_groups:
            self.stored_at[g] = step


def _norm2(t: torch.Tensor) -> float:
    """``||t||^2`` of a floating-point tensor (0 for others: they are not measured)."""
    if not t.is_floating_point():
        return 0.0
    return float(torch.linalg.vector_norm(t, dtype=torch.float32).item()) ** 2


def _update(triples: Iterable[tuple[torch.Tensor, torch.Tensor, float | None]]) -> tuple[float, bool]:
    """``(relative update norm, bit-identical)`` of a group's (current, stored, ||stored||^2) tensors.

    The norm is over the group's floating-point tensors: ``sqrt(sum ||cur - old||^2 / sum ||old||^2)``,
    one pass over each (the difference; bits are compared only where it is exactly zero or not finite).
    A group with a changed tensor of another type (integers, bool, complex) has an infinite update, so
    that it is always stored."""
    num = den = 0.0
    same = True
    other_changed = False
    for cur, old, norm2 in triples:
        if cur.is_floating_point():
            den += _norm2(old) if norm2 is None else norm2
            d = cur - old if cur.dtype == torch.float32 or cur.dtype == torch.float64 else \
                cur.to(torch.float32) - old.to(torch.float32)
            n2 = float(torch.linalg.vector_norm(d).item()) ** 2
            if n2 > 0 and math.isfinite(n2):
                num += n2
                same = False
                continue
            if torch.equal(_bits(cur), _bits(old)):
                continue
            same = False
            num += n2 if math.isfinite(n2) else math.inf
        elif not torch.equal(_bits(cur), _bits(old)):
            same, other_changed = False, True
    if same:
        return 0.0, True
    if other_changed or not math.isfinite(num):
        return math.inf, False
    if den == 0.0:
        return (math.inf if num > 0 else 0.0), False
    return math.sqrt(num / den), False


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes (NaN payloads, signed zeros compared as bits)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else t


def parse_policy_args(prune: Any) -> Prune | None:
    """``DeltaPolicy(prune=...)``'s value checked: a :class:`Prune` or None."""
    if prune is None or isinstance(prune, Prune):
        return prune
    raise InvalidArgumentError(f"DeltaPolicy: prune must be a ucl.write.prune.Prune or None, got {prune!r}")
