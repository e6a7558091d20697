"""Per-tensor change statistics between two steps (of one repository or of two), and a picture of them.

For each tensor both steps hold with the same shape and dtype:

- ``max_abs_diff``: max |b - a| over the elements whose bits differ (a NaN on either side counts as inf);
- ``rel_l2``: ||b - a||_2 / ||a||_2 (finite elements of ``a``; 0 when equal, inf when ``a`` is all zero);
- ``changed_fraction``: the fraction of elements whose bits differ;
- ``bitwise_equal``: no element differs in its bits (so ``-0.0`` vs ``0.0`` and NaN payloads count).

Tensors are compared block by block (about :data:`BLOCK_BYTES` of each side at a time), reading only
those blocks, so memory stays bounded whatever the tensor sizes.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ucl.read.checkpoint import Checkpoint
from ucl.read.checkpoint import open as open_step
from ucl.read.tensors import LazyTensor
from ucl.tools.progress import Progress

__all__ = ["DiffReport", "TensorDiff", "diff_steps", "plot"]

BLOCK_BYTES = 64 << 20
_UINT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass
class TensorDiff:
    """One tensor's comparison. ``status``: ``compared``, ``only_a``, ``only_b`` or ``incompatible``."""

    name: str
    status: str
    dtype: str | None = None
    shape: list[int] | None = None
    max_abs_diff: float | None = None
    rel_l2: float | None = None
    changed_fraction: float | None = None
    bitwise_equal: bool | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for k in ("max_abs_diff", "rel_l2", "changed_fraction"):
            if isinstance(d[k], float) and not math.isfinite(d[k]):
                d[k] = str(d[k])  # strict JSON has no inf/nan
        return d


@dataclass
class DiffReport:
    """What :func:`diff_steps` found."""

    a: dict[str, Any]
    b: dict[str, Any]
    tensors: list[TensorDiff] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """Every tensor is in both steps and bitwise equal."""
        return all(t.bitwise_equal for t in self.tensors)

    def summary(self) -> dict[str, int]:
        s = {"tensors": len(self.tensors), "equal": 0, "changed": 0, "only_a": 0, "only_b": 0, "incompatible": 0}
        for t in self.tensors:
            if t.status == "compared":
                s["equal" if t.bitwise_equal else "changed"] += 1
            else:
                s[t.status] += 1
        return s

    def to_dict(self) -> dict[str, Any]:
        return {"a": self.a, "b": self.b, "equal": self.equal, "summary": self.summary(),
                "tensors": [t.to_dict() for t in self.tensors]}


def _bits(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    size = flat.element_size()
    if size == 16:
        return flat.view(torch.int64).reshape(-1, 2)
    return flat.view(_UINT[size]).reshape(-1, 1)


def compare(a: LazyTensor, b: LazyTensor, block_bytes: int = BLOCK_BYTES, progress: Progress | None = None
            ) -> TensorDiff:
    """Statistics of ``b`` against ``a`` (same shape and dtype), read in blocks of rows."""
    shape = tuple(a.meta.shape)
    out = TensorDiff(a.name, "compared", a.meta.dtype, list(shape))
    n = math.prod(shape)
    changed, max_abs, ss_diff, ss_a = 0, 0.0, 0.0, 0.0
    rows = shape[0] if shape else 1
    row_bytes = max(1, math.prod(shape[1:]) * a.meta.itemsize) if shape else a.meta.itemsize
    step = max(1, block_bytes // row_bytes)
    wide = torch.complex128 if a.dtype.is_complex else torch.float64
    for r in range(0, rows if n else 0, step):
        k = min(step, rows - r)
        start, size = ((r,) + (0,) * (len(shape) - 1), (k, *shape[1:])) if shape else ((), ())
        xa, xb = a.read_box(start, size), b.read_box(start, size)
        diff_mask = (_bits(xa) != _bits(xb)).any(dim=1)
        changed += int(diff_mask.sum())
        fa = xa.reshape(-1).to(wide)
        finite = torch.isfinite(fa.abs())
        ss_a += float((fa.abs()[finite] ** 2).sum())
        if diff_mask.any():
            d = (xb.reshape(-1)[diff_mask].to(wide) - fa[diff_mask]).abs().nan_to_num(nan=math.inf)
            max_abs = max(max_abs, float(d.max()))
            ss_diff += float((d**2).sum())
        if progress is not None:
            progress.update(2 * xa.numel() * xa.element_size())
    out.changed_fraction = changed / n if n else 0.0
    out.bitwise_equal = changed == 0
    out.max_abs_diff = max_abs
    if ss_diff == 0:
        out.rel_l2 = 0.0
    elif ss_a == 0 or math.isinf(ss_diff):
        out.rel_l2 = math.inf
    else:
        out.rel_l2 = math.sqrt(ss_diff) / math.sqrt(ss_a)
    return out


def diff_steps(a_path: Any, b_path: Any, a_step: int | None = None, b_step: int | None = None, *,
               storage_options: dict[str, Any] | None = None, block_bytes: int = BLOCK_BYTES,
               progress: bool | None = None) -> DiffReport:
    """Compare every tensor of step ``a_step`` of ``a_path`` with the same-named tensor of ``b_step`` of ``b_path``.

    Parameters
    ----------
    a_path, b_path
        Repositories (the same one to compare two of its steps).
    a_step, b_step
        Steps; None means the newest committed step of that repository.
    block_bytes
        Bytes of each side read at a time.
    progress
        Draw a progress bar on stderr: None (default) when stderr is a terminal.

    Returns
    -------
    DiffReport
        Tensors in ``a``'s order, then those only in ``b``.
    """
    with open_step(a_path, a_step, storage_options=storage_options) as ca, \
            open_step(b_path, b_step, storage_options=storage_options) as cb:
        report = DiffReport(_side(ca), _side(cb))
        total = 2 * sum(m.nbytes for n, m in ca.meta.arrays.items() if n in cb.meta.arrays)
        with Progress(total, "diff", enabled=progress) as bar:
            for name in ca.meta.arrays:  # stored arrays (a layout step's keys() are its logical tensors)
                ma = ca.meta.arrays[name]
                if name not in cb.meta.arrays:
                    report.tensors.append(TensorDiff(name, "only_a", ma.dtype, list(ma.shape)))
                    continue
                mb = cb.meta.arrays[name]
                if (ma.shape, ma.dtype) != (mb.shape, mb.dtype):
                    report.tensors.append(TensorDiff(name, "incompatible", ma.dtype, list(ma.shape),
                                                     note=f"b is {mb.dtype} {list(mb.shape)}"))
                    continue
                report.tensors.append(compare(ca.array(name), cb.array(name), block_bytes, bar))
            for name in cb.meta.arrays:
                if name not in ca.meta.arrays:
                    mb = cb.meta.arrays[name]
                    report.tensors.append(TensorDiff(name, "only_b", mb.dtype, list(mb.shape)))
    return report


def _side(c: Checkpoint) -> dict[str, Any]:
    return {"path": c.repo.url, "step": c.step}


# -- the picture -----------------------------------------------------------------------------------
_LAYER = re.compile(r"(?:^|(?<=[./]))(\d+)(?=[./]|$)")
_OPT_STATE = re.compile(r"^(?P<opt>(?:.*/)?)state/(?P<index>0|[1-9][0-9]*)/(?P<key>[^/]+)$")
_COUNTERS = frozenset({"step"})  # optimizer state entries that count steps, not tensors that change


def layer_of(name: str) -> tuple[int, str] | None:
    """(layer number, name with it replaced by ``*``) for names like ``model/layers.3.attn.w``; else None."""
    m = _LAYER.search(name)
    if m is None:
        return None
    return int(m.group(1)), name[: m.start(1)] + "*" + name[m.end(1) :]


def _parameter_names(tensors: list[TensorDiff], states: dict[str, dict[int, TensorDiff]]) -> dict[tuple[str, int], str]:
    """The parameter each optimizer's state index belongs to, ``{(optimizer prefix, index): name}``.

    ``opt.state_dict()`` numbers parameters 0, 1, ... in the order the optimizer was given them, which for
    ``Optimizer(model.parameters())`` is the model state dict's order without its buffers. An index is
    matched to the next model tensor (in the step's order) whose shape is its state's shape; an optimizer
    whose indices do not all match gets no names (its indices are then labelled as indices, never as
    layers)."""
    out: dict[tuple[str, int], str] = {}
    for opt, by_index in states.items():
        params = [t for t in tensors if _OPT_STATE.match(t.name) is None and not t.name.startswith(opt)]
        j, found = 0, {}
        for index in sorted(by_index):
            shape = by_index[index].shape
            while j < len(params) and params[j].shape != shape:
                j += 1
            if j == len(params):
                break
            found[(opt, index)] = params[j].name
            j += 1
        else:
            out.update(found)
    return out


def plot_groups(report: DiffReport) -> tuple[dict[str, dict[int, float]], dict[str, float]]:
    """What :func:`plot` draws: ``(layered, flat)``, relative L2 changes by row label.

    ``layered[label][layer]`` for tensors whose parameter name holds a layer number (the label has ``*``
    for it); ``flat[label]`` for the others. An optimizer's state (``<opt>/state/<i>/<key>``, as
    ``opt.state_dict()`` saves it) is grouped under its parameter, ``"<parameter> · <key>"``, so that its
    index is never taken for a layer; step counters (``state/<i>/step``) and 0-d integer tensors are left
    out. Labels drop a first name segment every parameter shares (``model/``). Rows are in the step's
    order, each parameter's optimizer state after it.
    """
    compared = [t for t in report.tensors if t.status == "compared" and t.rel_l2 is not None]
    states: dict[str, dict[int, TensorDiff]] = {}
    for t in compared:
        m = _OPT_STATE.match(t.name)
        if m is not None and m["key"] not in _COUNTERS and t.shape:
            states.setdefault(m["opt"], {}).setdefault(int(m["index"]), t)
    owner = _parameter_names(compared, states)
    params = [t.name for t in compared if _OPT_STATE.match(t.name) is None]
    heads = {n.split("/", 1)[0] for n in params if "/" in n}
    strip = f"{heads.pop()}/" if len(heads) == 1 and all("/" in n for n in params) else ""
    order = {n: i for i, n in enumerate(params)}
    rows: list[tuple[tuple[int, int, str], str, float]] = []  # (sort key, parameter label, value)
    for t in compared:
        value = t.rel_l2 if t.rel_l2 is not None and math.isfinite(t.rel_l2) else float("nan")
        m = _OPT_STATE.match(t.name)
        if m is None:
            if not t.shape and t.dtype is not None and not t.dtype.startswith(("float", "bfloat", "complex")):
                continue  # a counter
            rows.append(((order[t.name], 0, ""), t.name.removeprefix(strip), value))
            continue
        if m["key"] in _COUNTERS or not t.shape:
            continue
        param = owner.get((m["opt"], int(m["index"])))
        if param is None:  # no parameter name: the index, labelled so, never a layer
            rows.append(((len(order), int(m["index"]), m["key"]),
                         f"{m['opt']}param {m['index']} · {m['key']}", value))
        else:
            rows.append(((order[param], 1, m["key"]), f"{param.removeprefix(strip)} · {m['key']}", value))
    rows.sort(key=lambda r: r[0])
    layered: dict[str, dict[int, float]] = {}
    flat: dict[str, float] = {}
    for key, label, value in rows:
        lk = layer_of(label) if key[0] < len(order) else None
        if lk is None:
            flat[label] = value
        else:
            layered.setdefault(lk[1], {})[lk[0]] = value
    if len(layered) and len({k for v in layered.values() for k in v}) < 2:  # one layer: no map to draw
        for kind, per in layered.items():
            for layer, v in per.items():
                flat[kind.replace("*", str(layer), 1)] = v
        layered = {}
    return layered, flat


def plot(report: DiffReport, path: str) -> None:
    """Draw the relative L2 change per parameter and layer to ``path`` (PNG, or any format matplotlib writes).

    Tensors with a layer number in their name form a heat map (rows: the parameter's name with ``*`` for
    the layer, each followed by its optimizer state; columns: layers); the others a bar chart. Rows and
    labels are :func:`plot_groups`'s (optimizer state under its parameter, step counters left out). The
    colour and bar scales are log10; a tensor that did not change is drawn below the smallest change
    (and marked ``=`` in the map).

    Raises
    ------
    ImportError
        When matplotlib is not installed.
    """
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    layered, flat = plot_groups(report)
    panels = int(bool(layered)) + int(bool(flat)) or 1
    fig = Figure(figsize=(11, 3 + 0.28 * (len(layered) + len(flat))), layout="constrained")
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    positives = [v for per in layered.values() for v in per.values() if v > 0] + [v for v in flat.values() if v > 0]
    floor = min(positives) if positives else 1e-12
    title = (f"relative L2 change  {report.a['path']}@{report.a['step']} -> "
             f"{report.b['path']}@{report.b['step']}")
    i = 0
    if layered:
        import numpy as np

        layers = sorted({k for v in layered.values() for k in v})
        kinds = list(layered)  # the step's order, each parameter's optimizer state after it
        grid = np.full((len(kinds), len(layers)), np.nan)
        for r, kind in enumerate(kinds):
            for c, layer in enumerate(layers):
                cell = layered[kind].get(layer)
                if cell is not None:
                    grid[r, c] = max(cell, floor / 10)  # bitwise-equal tensors: below the smallest change
        ax = axes[i]
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap="viridis",
                       norm=LogNorm(vmin=floor / 10, vmax=max(positives or [1.0])))
        ax.set_xticks(range(len(layers)), [str(x) for x in layers], fontsize=7)
        ax.set_yticks(range(len(kinds)), kinds, fontsize=7)
        ax.set_xlabel("layer")
        if grid.size <= 600:  # mark bitwise-equal tensors, which the log scale cannot show as 0
            for r, kind in enumerate(kinds):
                for c, layer in enumerate(layers):
                    if layered[kind].get(layer) == 0:
                        ax.text(c, r, "=", ha="center", va="center", color="white", fontsize=8)
        fig.colorbar(im, ax=ax, label="||b - a|| / ||a||")
        ax.set_title(title, fontsize=9)
        i += 1
    if flat or not layered:
        ax = axes[i]
        labels = list(flat)
        ax.barh(range(len(labels)), [max(v, floor / 10) if v == v else 0 for v in flat.values()], color="tab:blue")
        ax.set_yticks(range(len(labels)), labels, fontsize=7)
        ax.set_xscale("log")
        ax.invert_yaxis()
        ax.set_xlabel("||b - a|| / ||a||")
        if not layered:
            ax.set_title(title, fontsize=9)
    fig.savefig(path, dpi=110)
