#!/usr/bin/env python3
"""Coverage-guided fuzzing of ucl's metadata parsers with atheris (libFuzzer), run by hand.

::

    .venv/bin/pip install atheris                                       # a wheel; no compiler needed
    .venv/bin/python tests/fuzz/atheris_metadata.py -runs=100000         # corpus: ./ucl-atheris-corpus
    .venv/bin/python tests/fuzz/atheris_metadata.py CORPUS_DIR -max_total_time=3600 -rss_limit_mb=2048

The first byte of an input chooses the parser (metadata.loads, ArrayMeta.from_dict, StepMeta.from_dict,
CommitRecord.from_bytes as is or with its checksum recomputed, names.from_key, parse_repo); the rest is
the document. Without a corpus folder on the command line, ./ucl-atheris-corpus is created and seeded
with the JSON documents of conformance/fixtures/valid. Any exception other than a UCLError is a crash:
libFuzzer stops and writes the input to
``crash-<sha1>``, which reproduces with ``atheris_metadata.py crash-<sha1>``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import atheris

# heavy dependencies first, uninstrumented; ucl's own modules instrumented
import jsonschema  # noqa: F401
import numpy  # noqa: F401
import torch  # noqa: F401

with atheris.instrument_imports(include=["ucl"]):
    from ucl.errors import UCLError
    from ucl.format import metadata, names
    from ucl.format.metadata import ArrayMeta, CommitRecord, StepMeta
    from ucl.io import native as _native

FIXTURES = Path(__file__).resolve().parents[2] / "conformance" / "fixtures" / "valid"
MODES = 7


def _reseal(body: bytes) -> bytes:
    try:
        doc = json.loads(body)
        if isinstance(doc, dict):
            rest = {k: v for k, v in doc.items() if k != "checksum"}
            return json.dumps({**rest, "checksum": _native.crc32c(metadata.canonical(rest))}).encode()
    except (ValueError, TypeError, RecursionError):
        pass
    return body


def test_one_input(data: bytes) -> None:
    if not data:
        return
    mode, body = data[0] % MODES, data[1:]
    try:
        if mode == 0:
            metadata.loads(body, "fuzz")
        elif mode == 1:
            meta = ArrayMeta.from_dict(metadata.loads(body, "fuzz"), "fuzz")
            assert ArrayMeta.from_dict(meta.to_dict(), "round trip") == meta
        elif mode == 2:
            StepMeta.from_dict(metadata.loads(body, "fuzz"), "fuzz")
        elif mode == 3:
            CommitRecord.from_bytes(body, "fuzz", None)
        elif mode == 4:
            CommitRecord.from_bytes(_reseal(body), "fuzz", None)
        elif mode == 5:
            key = body.decode("utf-8", "replace")
            assert names.to_key(names.from_key(key)) == key
        else:
            metadata.parse_repo(body)
    except UCLError:
        pass


def _seed_corpus() -> str:
    """./ucl-atheris-corpus: every JSON document of the valid fixtures, prefixed with the mode that parses it.
    libFuzzer adds what it finds there, so a later run starts where this one stopped."""
    out = "ucl-atheris-corpus"
    os.makedirs(out, exist_ok=True)
    n = 0
    for p in sorted(FIXTURES.rglob("*.json")):
        raw = p.read_bytes()
        rel = p.relative_to(FIXTURES).parts
        if rel[1] == "commits":
            modes = [3, 4]
        elif len(rel) == 2:
            modes = [6]
        elif len(rel) == 4:
            modes = [2]
        else:
            modes = [1]
        for m in [0, *modes]:
            Path(out, f"seed{n}").write_bytes(bytes([m]) + raw)
            n += 1
    for key in ["w", "a%20b/%C3%BC/..x", "%2E", "%5F_init__", "x/y/z"]:
        Path(out, f"seed{n}").write_bytes(b"\x05" + key.encode())
        n += 1
    return out


def main() -> None:
    argv = list(sys.argv)
    if not any(os.path.exists(a) for a in argv[1:] if not a.startswith("-")):
        argv.append(_seed_corpus())
    atheris.Setup(argv, test_one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
