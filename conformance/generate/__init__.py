"""The generator of the conformance fixtures and case files (run it as ``python -m conformance.generate``).

One module per case file: ``<feature>.py`` builds the fixtures of ``cases/<feature>.json`` and declares
their cases next to them; ``fixture.py`` holds the repository writer and editor (``Fx``), ``suite.py``
the cases (``Suite``, ``Cases``) and the spec sections they cite, ``__main__.py`` the command line.

Valid fixtures are written by ucl's reference writer (``ucl.save``, ``StepWriter``). Invalid and hostile
fixtures are copies of small valid repositories, then damaged. Two kinds of damage:

- *integrity* damage (bit flips, truncations, deletions) leaves the commit record as it was, as a disk
  or a buggy copy would;
- *semantic* and *hostile* damage (lying metadata) is **resealed**: every size, crc32c and checksum that
  covers the damaged bytes is recomputed, so that only the lie itself is left for a reader to catch.

Generation is deterministic (fixed data seeds, a fixed commit time), so ``--check`` shows whether the
committed fixtures still are what this generator and the current writer produce. A difference is not a
failure of the suite: committed fixtures are the compatibility record and are changed only on purpose.

Each fixture's cases are declared next to it, with expected data as the sha256 of the little-endian
bytes of the *original* tensors (never of what a reader returned).
"""
