"""Remote reads: a step on an S3-compatible server, read by ucl, tensorstore and zarr-python.

    ./dev bench remote [--size small|gpt2] [--reps 3] [--cases ...]

The server is moto's (the tests' loopback S3 server), run by this process on 127.0.0.1; it counts the
requests it answers and the bytes it sends. A GPT-2-like fp32 state (``_common.gpt_state``, weights
only: what a remote reader loads) is saved once to ``s3://<bucket>/ckpt`` with ``ucl.save``; every read
then runs in a fresh process, the cases interleaved (rotated between rounds), ``--reps`` rounds, medians.

Cases:
- ``ucl slice``: ``ucl.open(url)[embedding][3/8:4/8 of its rows]``, the open included;
- ``ucl load``: ``ucl.open(url).load(flat=True)``, every tensor, verified (checksums);
- ``tensorstore slice`` / ``load``: the same arrays of the same step as native Zarr v3 (zarr3 driver on
  the s3 kvstore), each array opened by its path (given, so tensorstore lists nothing); the load reads
  all arrays concurrently;
- ``zarr slice`` / ``load``: zarr-python's ``zarr.open_group`` on the step over fsspec (s3fs), then the
  slice, or every array;
- ``objects`` (the probe): every object of the step fetched whole with s3fs ``cat`` in one concurrent
  batch: what the data costs from this server without any format's reads around it.

Columns: wall seconds in the child (imports before the clock), requests the server answered (GET, HEAD,
and the rest: listings), bytes it sent, and the ratio of bytes sent to the bytes the case returns. The
server is Python in this process: its time per request (~1-3 ms here) is part of every figure, as a
real object store's latency would be.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _common as C  # noqa: E402

STEP = 0
SLICE_NAME = "transformer.wte.weight"
CASES = ["ucl slice", "tensorstore slice", "zarr slice", "ucl load", "tensorstore load", "zarr load", "objects"]
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


# == the server ====================================================================================
class Server:
    """moto's S3 on loopback, in a thread of this process, counting requests by method and bytes sent."""

    def __init__(self) -> None:
        import logging

        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.requests: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self._lock = threading.Lock()
        app = DomainDispatcherApplication(create_backend_app)

        def counting(environ: dict[str, Any], start_response: Any) -> Any:
            with self._lock:
                self.requests[environ["REQUEST_METHOD"]] += 1
            for chunk in app(environ, start_response):
                with self._lock:
                    self.sent += len(chunk)
                yield chunk

        self._server = make_server("127.0.0.1", 0, counting, True, request_handler=MotoRequestHandler)
        host, port = self._server.server_address[:2]
        self.endpoint = f"http://{host}:{port}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        """The variables that point boto3, s3fs, ucl and tensorstore at this server (and nowhere else)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, **CREDENTIALS,
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def counts(self) -> tuple[dict[str, int], int]:
        with self._lock:
            return dict(self.requests), self.sent

    def close(self) -> None:
        self._server.shutdown()


# == the children: one read each ===================================================================
def storage_options() -> dict[str, Any]:
    return {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "key": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"], "client_kwargs": {"region_name": "us-east-1"}}


def ts_spec(man: dict[str, Any], key: str) -> dict[str, Any]:
    return {"driver": "zarr3", "kvstore": {"driver": "s3", "bucket": man["bucket"],
                                           "path": f"{man['prefix']}/steps/{STEP}/{key}/",
                                           "endpoint": os.environ["AWS_ENDPOINT_URL"],
                                           "aws_region": "us-east-1"}}


def child(case: str, man: dict[str, Any]) -> dict[str, Any]:
    import numpy as np
    import s3fs
    import tensorstore as ts
    import torch
    import zarr

    import ucl

    url = f"s3://{man['bucket']}/{man['prefix']}"
    s = man["slice"]
    name, a, b = s["name"], s["start"], s["stop"]
    t0 = time.perf_counter()
    if case == "ucl slice":
        with ucl.open(url) as ck:
            out: Any = {name: ck[name][a:b]}
    elif case == "ucl load":
        with ucl.open(url) as ck:
            out = ck.load(flat=True)
    elif case == "tensorstore slice":
        arr = ts.open(ts_spec(man, man["tensors"][name]["key"]), read=True).result()
        out = {name: torch.from_numpy(arr[a:b].read().result())}
    elif case == "tensorstore load":
        opens = {n: ts.open(ts_spec(man, v["key"]), read=True) for n, v in man["tensors"].items()}
        reads = {n: f.result().read() for n, f in opens.items()}
        out = {n: torch.from_numpy(f.result()) for n, f in reads.items()}
    elif case.startswith("zarr"):
        store = zarr.storage.FsspecStore.from_url(f"{url}/steps/{STEP}", storage_options=storage_options(),
                                                  read_only=True)
        group = zarr.open_group(store, mode="r")
        if case == "zarr slice":
            out = {name: torch.from_numpy(np.asarray(group[man["tensors"][name]["key"]][a:b]))}
        else:
            out = {n: torch.from_numpy(np.asarray(group[v["key"]][...])) for n, v in man["tensors"].items()}
    elif case == "objects":
        fs = s3fs.S3FileSystem(**storage_options())
        keys = fs.find(f"{man['bucket']}/{man['prefix']}/steps/{STEP}")
        out = {k: torch.frombuffer(bytearray(v), dtype=torch.uint8) for k, v in fs.cat(keys).items() if v}
    else:
        raise ValueError(f"unknown case {case!r}")
    seconds = time.perf_counter() - t0
    returned = sum(t.numel() * t.element_size() for t in out.values())
    if case != "objects":
        want = man["slice"]["fingerprint"] if case.endswith("slice") else man["fingerprint"]
        got = fingerprint(out)
        if abs(got - want) > 1e-6 * max(1.0, abs(want)):
            raise RuntimeError(f"{case}: the tensors read differ from those saved ({got} != {want})")
    return {"seconds": seconds, "returned": returned}


def fingerprint(tensors: dict[str, Any]) -> float:
    """A cheap content check: a strided sum over every tensor (catches zeros, shifts, missing tensors)."""
    import torch

    return float(sum(t.reshape(-1)[::997].to(torch.float64).sum().item() for t in tensors.values()))


# == the parent ====================================================================================
def write_step(size: str, server: Server) -> dict[str, Any]:
    import boto3
    import torch

    import ucl
    from ucl.format import names

    bucket = "ucl-bench-remote"
    boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=bucket)
    state = C.gpt_state(size)
    t0 = time.perf_counter()
    ucl.save(state, f"s3://{bucket}/ckpt", step=STEP)
    saved = time.perf_counter() - t0
    rows = state[SLICE_NAME].shape[0]
    a, b = 3 * rows // 8, 4 * rows // 8
    return {
        "bucket": bucket, "prefix": "ckpt", "size": size, "saved_s": saved,
        "nbytes": C.state_nbytes(state), "fingerprint": fingerprint(state),
        "tensors": {n: {"shape": list(t.shape), "key": names.to_key(n)} for n, t in state.items()},
        "slice": {"name": SLICE_NAME, "start": a, "stop": b,
                  "fingerprint": fingerprint({SLICE_NAME: state[SLICE_NAME][a:b]}),
                  "nbytes": state[SLICE_NAME][a:b].numel() * torch.float32.itemsize},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="small", choices=sorted(C.SIZES))
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--child", nargs=2, metavar=("CASE", "MANIFEST"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        with open(a.child[1]) as fh:
            man = json.load(fh)
        print(json.dumps(child(a.child[0], man)))
        return
    cases = a.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {CASES}")
    C.compile_package()
    server = Server()
    saved_env = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())  # the children inherit it
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in cases}
    try:
        man = write_step(a.size, server)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(man, fh)
        for rep in range(a.reps):
            for case in cases[rep % len(cases):] + cases[: rep % len(cases)]:
                before, sent0 = server.counts()
                r = C.run_child([__file__, "--child", case, fh.name])
                after, sent1 = server.counts()
                r["requests"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                r["sent"] = sent1 - sent0
                runs[case].append(r)
                print(f"  {rep} {case}: {json.dumps(r)}", file=sys.stderr)
    finally:
        os.unlink(fh.name)
        server.close()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    table = []
    for case in cases:
        rs = runs[case]
        get = C.median([r["requests"].get("GET", 0) for r in rs])
        head = C.median([r["requests"].get("HEAD", 0) for r in rs])
        other = C.median([sum(v for k, v in r["requests"].items() if k not in ("GET", "HEAD")) for r in rs])
        sent = C.median([r["sent"] for r in rs])
        returned = rs[0]["returned"]
        secs = [r["seconds"] for r in rs]
        table.append([case, f"{C.median(secs):.3f} s", f"{min(secs):.3f}-{max(secs):.3f}", f"{get:.0f}",
                      f"{head:.0f}", f"{other:.0f}", C.fmt_bytes(sent), C.fmt_bytes(returned),
                      f"{sent / returned:.2f}x"])
    print(f"\nremote reads from a loopback S3 server (moto), size={a.size}: {len(man['tensors'])} tensors, "
          f"{C.fmt_bytes(man['nbytes'])} fp32 (saved by ucl.save in {man['saved_s']:.1f} s); slice: "
          f"{SLICE_NAME}[{man['slice']['start']}:{man['slice']['stop']}]; median of {a.reps}, fresh process "
          f"per read; {C.machine_line()}")
    print(f"command: ./dev bench remote --size {a.size} --reps {a.reps}\n")
    print(C.markdown_table(["case", "seconds", "range", "GET", "HEAD", "other requests", "bytes sent",
                            "bytes returned", "sent / returned"], table))


if __name__ == "__main__":
    main()
