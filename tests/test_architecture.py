"""The import contract of the package (docs/architecture.md): layers, no cycles, no private seams.

Parsed from the sources (no import of ucl): every ``import`` / ``from ... import`` between ucl modules,
at module level or inside functions (a function-level import cannot hide a cycle or an upward
dependency). Imports under ``if TYPE_CHECKING:`` are annotations only and are not counted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ucl"

# Lowest first. A module may import modules of its own layer's package and of lower layers; never a
# higher layer, never a sibling package of the same layer.
LAYERS: list[list[str]] = [
    ["ucl.errors", "ucl.options"],  # leaves
    ["ucl.io"],  # bytes: stores, the C binding, the one range reader (knows nothing of the format)
    ["ucl.format"],  # names, dtypes, structure tree, documents, shard file codec, repository, lock
    ["ucl.layout", "ucl.delta"],  # pure: the layout language | delta encodings, chains, gradient records
    ["ucl.plan"],  # pure: save plans, load plans, box copies
    ["ucl.read"],  # Checkpoint, lazy tensors, plain and chain reads, load
    ["ucl.write"],  # step writer, save, the manager (restore reads: write may import read)
    ["ucl.adapters"],  # zarr store, DCP storage writer/reader
    ["ucl.tools"],  # validate, gc, compact, diff, convert (imports DCP's via the adapter), CLI
    ["ucl.testing"],  # the shipped test kit: anything below
    ["ucl", "ucl.__main__"],  # the public API
]
C_EXTENSIONS = {"ucl._engine", "ucl._delta"}  # leaves, built from engine/


def _package(mod: str) -> str:
    """The layer entry a module belongs to (``ucl.read.chain`` -> ``ucl.read``)."""
    entries = sorted((e for layer in LAYERS for e in layer), key=len, reverse=True)
    return next(e for e in entries if mod == e or mod.startswith(e + "."))


def _rank(pkg: str) -> int:
    return next(i for i, layer in enumerate(LAYERS) if pkg in layer)


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    names: tuple[str, ...]
    line: int


def _edges(mods: dict[str, Path]) -> Iterator[Edge]:
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        pkg = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        skip: set[int] = set()
        for n in ast.walk(tree):  # imports under `if TYPE_CHECKING:`
            if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
                skip |= {id(x) for x in ast.walk(n)}
        for n in ast.walk(tree):
            if id(n) in skip:
                continue
            if isinstance(n, ast.Import):
                for a in n.names:
                    if a.name.split(".")[0] == "ucl" and a.name not in C_EXTENSIONS:
                        yield Edge(name, _owner(a.name, mods), (), n.lineno)
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    up = pkg.split(".")[: len(pkg.split(".")) - (n.level - 1)]
                    base = ".".join(up + ([n.module] if n.module else []))
                if base.split(".")[0] != "ucl":
                    continue
                for a in n.names:
                    full = f"{base}.{a.name}"
                    if full in C_EXTENSIONS:
                        continue
                    if full in mods:  # `from ucl.format import names`: the module itself
                        yield Edge(name, full, (), n.lineno)
                    else:
                        yield Edge(name, _owner(base, mods), (a.name,), n.lineno)


def _owner(mod: str, mods: dict[str, Path]) -> str:
    while mod not in mods and "." in mod:
        mod = mod.rsplit(".", 1)[0]
    return mod


MODS = _modules()
EDGES = [e for e in _edges(MODS) if e.src != e.dst]


def test_every_module_belongs_to_a_layer() -> None:
    for m in MODS:
        _package(m)  # StopIteration for a module outside the layers


def test_no_upward_or_sideways_imports() -> None:
    bad = []
    for e in EDGES:
        a, b = _package(e.src), _package(e.dst)
        if a != b and _rank(b) >= _rank(a):
            bad.append(f"{e.src}:{e.line} imports {e.dst} ({b} is not below {a})")
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {m: set() for m in MODS}
    for e in EDGES:
        graph[e.src].add(e.dst)
    # Tarjan's strongly connected components
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_names_across_packages() -> None:
    bad = [f"{e.src}:{e.line} imports {n} from {e.dst}" for e in EDGES for n in e.names
           if n.startswith("_") and not n.startswith("__") and _package(e.src) != _package(e.dst)]
    assert not bad, "\n".join(bad)


def test_the_contract_sees_real_edges() -> None:
    # the checks above would pass vacuously on a parser that finds nothing
    assert len(MODS) > 50 and len(EDGES) > 200
    assert any(e.src == "ucl.read.chain" and e.dst.startswith("ucl.delta") for e in EDGES)
    assert _rank("ucl.read") > _rank("ucl.plan") > _rank("ucl.format") > _rank("ucl.io")
