"""``cases/extensions.json``: what a reader must ignore (core.md §9 Extensions and versioning).

Unknown extensions with ``must_understand: false`` in the repository, step and commit documents, and
optional Zarr fields (dimension names, an empty list of storage transformers). Extensions that must be
understood are refused: those cases are in commit.json and metadata.json.
"""

from __future__ import annotations

from pathlib import Path

from .fixture import Fx, tiny_state
from .suite import S_EXT, Cases


def build(root: Path, cases: Cases) -> None:
    fx = "valid/ignorable_extensions"
    f = Fx(root, fx)
    st = tiny_state(710)
    f.save(st, 1)
    ext = {"name": "example.future_feature", "configuration": {"x": 1}, "must_understand": False}
    f.edit_json("zarr.json", lambda d: d["attributes"]["ucl"].__setitem__("extensions", [ext]))
    f.edit_step_doc(1, lambda d: d["attributes"]["ucl"].__setitem__("extensions", [ext]))
    f.edit_commit(1, lambda d: d.__setitem__("extensions", [ext]))
    f.edit_array(1, "w", lambda d: d.update(dimension_names=["rows", None], storage_transformers=[]))
    cases.valid(
        "unknown extensions with must_understand false are ignored (repository, step, commit)",
        S_EXT,
        fx,
        "validate",
    )
    cases.valid("a step with ignorable extensions opens", S_EXT, fx, "open", step=1, keys=["s", "w"])
    cases.reads(S_EXT, fx, st)
