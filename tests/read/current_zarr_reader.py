"""Run by the Python 3.13 interpreter of .ci/current-zarr-env (zarr 3.4), not by pytest: reads ucl steps
with plain zarr-python and prints what it found, for tests/read/test_current_zarr.py to compare.

stdin: {"steps": [step directory, ...]}; stdout: {"zarr": version, "python": version,
"steps": {directory: {array path: [shape, dtype, sha256 of the C-order bytes]}}}. zarr finds ucl's
bfloat16/float8 through the entry points of the ucl installed beside it (no torch there).
"""

import hashlib
import json
import sys

import numpy as np
import zarr


def read_step(where: str) -> dict[str, list]:
    out = {}
    group = zarr.open_group(where, mode="r")
    for path, node in group.members(max_depth=None):
        if isinstance(node, zarr.Array):
            data = np.ascontiguousarray(node[...])
            dtype = node.metadata.data_type.to_json(zarr_format=3)
            out[path] = [list(node.shape), dtype, hashlib.sha256(data.tobytes()).hexdigest()]
    return out


def main() -> None:
    req = json.load(sys.stdin)
    steps = {s: read_step(s) for s in req["steps"]}
    json.dump({"zarr": zarr.__version__, "python": sys.version.split()[0], "steps": steps}, sys.stdout)


if __name__ == "__main__":
    main()
