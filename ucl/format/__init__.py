"""The format (spec/core.md): tensor names and dtypes, the structure tree, metadata documents as frozen
dataclasses, the shard file codec, the repository (steps and commit records) and the writer lock.

Everything above it (planning, reading, writing, tools) speaks in these terms; it reads and writes bytes
only through :mod:`ucl.io` stores.
"""
