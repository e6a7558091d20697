"""``cases/names.json``: tensor names and the keys they are stored under (core.md §5.2 Tensor names).

A valid step whose names need every escape (space, UTF-8, '.', '..', '__', '%', backslash), then invalid
keys, one rule broken each: non-canonical and needless escapes, unescaped bytes, '.' and empty segments,
the '__' prefix Zarr v3 reserves, escapes that are not UTF-8 or decode to control characters, too many or
too long segments, and an array whose name disagrees with its key.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ucl.format import structure

from .fixture import Fx, random_tensor, rename_key, tiny
from .suite import S_NAMES, Cases


def tensor(i: int, shape: tuple[int, ...] = (2, 2)) -> torch.Tensor:
    """The i-th tensor of valid/names."""
    return random_tensor(shape, torch.float32, 300 + i)


def build(root: Path, cases: Cases) -> None:
    fx = "valid/names"
    nested = {
        "a b": {"ü": {"..x": tensor(0)}},
        ".": tensor(1),
        "..": tensor(2),
        "__init__": tensor(3),
        "%41": tensor(4),
        "x.y-z_0": tensor(5),
        "emoji😀": tensor(6),
        "model": {"layers": [{"weight": tensor(7), "bias": tensor(8, (2,))}, {"weight": tensor(9)}]},
        "optim": {
            "state": {0: {"exp_avg": tensor(10), "step": tensor(11, ())}},
            "param_groups": [
                {
                    "lr": 0.001,
                    "betas": (0.9, 0.999),
                    "name": "adam",
                    "nesterov": False,
                    "foreach": None,
                    "eps": float("inf"),
                    "weird": float("nan"),
                }
            ],
        },
        "s" * 255: tensor(12, (1,)),
        "back\\slash": tensor(13),
        "sp ace": {" in": {"deep": tensor(14)}},
    }
    Fx(root, fx).save(nested, 5)
    flat, _ = structure.flatten(nested)
    cases.valid(
        "names with escapes (space, UTF-8, '.', '..', '__', '%', backslash) validate",
        S_NAMES,
        fx,
        "validate",
    )
    cases.valid("every flattened name is listed, unescaped", S_NAMES, fx, "open", step=5, keys=sorted(flat))
    cases.reads(S_NAMES, fx, flat)

    # invalid keys: an array's consolidated entry moved to a key that breaks one rule
    fx = "invalid/names/non_canonical_escape"
    f = Fx(root, fx)
    f.save({"ü": random_tensor((2,), torch.float32, 1300)}, 1)
    rename_key(f, "%C3%BC", "%c3%bc")
    cases.invalid("a key escaped with lowercase hex", S_NAMES, fx, "invalid_name")
    cases.error(
        "a step with a non-canonical key does not open",
        S_NAMES,
        fx,
        "open",
        "invalid_name",
        {"step": 1},
    )

    fx = "invalid/names/needless_escape"
    f, st = tiny(root, fx)
    rename_key(f, "w", "%77")
    cases.invalid("a key that escapes a safe byte ('%77' for 'w')", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/unescaped_space"
    f, st = tiny(root, fx)
    rename_key(f, "w", "a b")
    cases.invalid("a key with an unescaped space", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/dot_segment"
    f, st = tiny(root, fx)
    rename_key(f, "w", "x/./w")
    cases.invalid("a key with a '.' segment", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/reserved_prefix"
    f, st = tiny(root, fx)
    rename_key(f, "w", "__w")
    cases.invalid("a key starting with '__' (reserved by Zarr v3)", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/empty_segment"
    f, st = tiny(root, fx)
    rename_key(f, "w", "a//w")
    cases.invalid("a key with an empty segment", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/invalid_utf8"
    f, st = tiny(root, fx)
    rename_key(f, "w", "%FF%FE")
    cases.invalid("a key whose escapes are not UTF-8", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/control_character"
    f, st = tiny(root, fx)
    rename_key(f, "w", "a%01b")
    cases.invalid("a key that decodes to a control character", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/too_many_segments"
    f, st = tiny(root, fx)
    rename_key(f, "w", "/".join(["d"] * 33))
    cases.invalid("a key of 33 segments", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/segment_too_long"
    f, st = tiny(root, fx)
    rename_key(f, "w", "x" * 256)
    cases.invalid("a segment of 256 bytes", S_NAMES, fx, "invalid_name")

    fx = "invalid/names/name_key_mismatch"
    f, st = tiny(root, fx)
    f.edit_array(1, "w", lambda d: d["attributes"]["ucl"].__setitem__("name", "v"))
    cases.invalid("an array at key 'w' whose name is 'v'", S_NAMES, fx, "inconsistent_metadata")
    cases.error(
        "a step whose array names disagree with their keys does not open",
        S_NAMES,
        fx,
        "open",
        "inconsistent_metadata",
        {"step": 1},
    )
