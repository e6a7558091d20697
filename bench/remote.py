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
- ``DCP load``: ``torch.distributed.checkpoint.load`` of the same state, saved by DCP's fsspec writer,
  through its fsspec reader (one process, preallocated destination);
- ``objects`` (the probe): every object of the step fetched whole with s3fs ``cat`` in one concurrent
  batch: what the data costs from this server without any format's reads around it;
- ``ucl save``: a ``CheckpointManager`` on a new prefix opened, one save, closed (the state made before
  the clock); ``ucl.save``: the one-call reference writer (shards one after another) to a new prefix;
- ``DCP save``: ``torch.distributed.checkpoint.save`` through its fsspec writer (4 threads), one process;
- ``objects put`` (the probe): the step's objects (fetched before the clock: its GETs and the bytes they
  sent are in its counts) written whole with s3fs ``pipe`` in one concurrent batch.

Columns: wall seconds in the child (imports before the clock), requests the server answered by method,
the bytes the case reads or saves, the bytes on the wire (sent and received by the server, bodies only)
and their ratio, and the objects a save leaves. The server is Python in this process: its time per
request (a few ms here; a ranged GET copies the whole object first, ~50 ms for a 100 MB one) is part of
every figure, as a real object store's latency would be. ``--latency-ms N`` adds N ms before every
answer (requests in flight still overlap: the server answers each on a thread of its own), a stand-in
for a real store's first-byte latency (tens of ms on S3), which loopback lacks.
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
CASES = ["ucl slice", "tensorstore slice", "zarr slice", "ucl load", "tensorstore load", "zarr load", "DCP load",
         "objects", "ucl save", "ucl.save", "DCP save", "objects put"]
SAVES = ("ucl save", "ucl.save", "DCP save", "objects put")  # each to a prefix of its own, deleted after
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


# == the server ====================================================================================
class Server:
    """moto's S3 on loopback, in a thread of this process, counting requests by method and bytes sent."""

    def __init__(self, latency: float = 0.0) -> None:
        import logging

        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self.requests: collections.Counter[str] = collections.Counter()
        self.sent = self.received = 0
        self._lock = threading.Lock()
        app = DomainDispatcherApplication(create_backend_app)

        def counting(environ: dict[str, Any], start_response: Any) -> Any:
            if latency:
                time.sleep(latency)  # a request's first-byte latency (its own thread: requests still overlap)
            with self._lock:
                self.requests[environ["REQUEST_METHOD"]] += 1
                self.received += int(environ.get("CONTENT_LENGTH") or 0)
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

    def drop(self, bucket: str, prefix: str) -> tuple[int, int]:
        """Delete everything under ``prefix`` (a save case's output); the objects and bytes it held."""
        import boto3

        s3 = boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                          aws_secret_access_key="testing", region_name="us-east-1")
        objs = [o for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
                for o in page.get("Contents", [])]
        for i in range(0, len(objs), 1000):
            s3.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": o["Key"]} for o in objs[i:i + 1000]]})
        return len(objs), sum(o["Size"] for o in objs)

    def counts(self) -> tuple[dict[str, int], int, int]:
        """Requests by method, bytes sent and bytes received so far."""
        with self._lock:
            return dict(self.requests), self.sent, self.received

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


def child(case: str, man: dict[str, Any], target: str) -> dict[str, Any]:
    """One read (or save, to the prefix ``target``), timed; checked against the manifest."""
    import warnings

    import numpy as np
    import s3fs
    import tensorstore as ts
    import torch
    import torch.distributed.checkpoint as dcp
    import zarr

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")  # DCP in one process

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
    elif case == "DCP load":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        out = {n: torch.empty(v["shape"]) for n, v in man["tensors"].items()}
        t0 = time.perf_counter()  # the destination allocated before the clock, as a training process has it
        dcp.load(out, storage_reader=FsspecReader(f"s3://{man['bucket']}/dcp", **storage_options()))
    elif case in SAVES:
        dest = f"s3://{man['bucket']}/{target}"
        fs = s3fs.S3FileSystem(**storage_options())
        if case == "objects put":
            keys = fs.find(f"{man['bucket']}/{man['prefix']}/steps/{STEP}")
            blobs = {k.replace(f"/{man['prefix']}/", f"/{target}/", 1): v for k, v in fs.cat(keys).items()}
            t0 = time.perf_counter()
            fs.pipe(blobs)
        else:
            state = C.gpt_state(man["size"])
            t0 = time.perf_counter()
            if case == "ucl save":
                with ucl.CheckpointManager(dest) as mgr:
                    mgr.save(STEP, state).result()
            elif case == "ucl.save":
                ucl.save(state, dest, step=STEP)
            else:
                from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

                dcp.save(state, storage_writer=FsspecWriter(dest, thread_count=4, **storage_options()))
        return {"seconds": time.perf_counter() - t0, "returned": man["nbytes"]}
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
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    dcp.save(state, storage_writer=FsspecWriter(f"s3://{bucket}/dcp", thread_count=4, **storage_options()))
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
    ap.add_argument("--latency-ms", type=float, default=0.0,
                    help="answer every request this much later (a real store's latency; loopback has none)")
    ap.add_argument("--child", nargs=3, metavar=("CASE", "MANIFEST", "TARGET"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        with open(a.child[1]) as fh:
            man = json.load(fh)
        print(json.dumps(child(a.child[0], man, a.child[2])))
        return
    cases = a.cases.split(",")
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; known: {CASES}")
    C.compile_package()
    server = Server(a.latency_ms / 1000)
    saved_env = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())  # the children inherit it
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in cases}
    try:
        man = write_step(a.size, server)
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as fh:
            json.dump(man, fh)
        for rep in range(a.reps):
            for case in cases[rep % len(cases):] + cases[: rep % len(cases)]:
                target = f"save-{rep}-{CASES.index(case)}"
                before, sent0, received0 = server.counts()
                r = C.run_child([__file__, "--child", case, fh.name, target])
                after, sent1, received1 = server.counts()
                if case in SAVES:
                    r["objects"], r["stored"] = server.drop(man["bucket"], target)
                r["requests"] = {k: after.get(k, 0) - before.get(k, 0) for k in after}
                r["sent"], r["received"] = sent1 - sent0, received1 - received0
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
        n = {m: C.median([r["requests"].get(m, 0) for r in rs]) for m in ("GET", "HEAD", "PUT", "POST")}
        other = C.median([sum(v for k, v in r["requests"].items() if k not in n) for r in rs])
        moved = C.median([r["sent"] + r["received"] for r in rs])
        returned = rs[0]["returned"]
        secs = [r["seconds"] for r in rs]
        objects = f"{C.median([r['objects'] for r in rs]):.0f}" if case in SAVES else "-"
        table.append([case, f"{C.median(secs):.3f} s", f"{min(secs):.3f}-{max(secs):.3f}",
                      *(f"{n[m]:.0f}" for m in n), f"{other:.0f}", C.fmt_bytes(returned), C.fmt_bytes(moved),
                      f"{moved / returned:.2f}x", objects])
    print(f"\nremote reads and saves, a loopback S3 server (moto), size={a.size}: {len(man['tensors'])} tensors, "
          f"{C.fmt_bytes(man['nbytes'])} fp32 (saved by ucl.save in {man['saved_s']:.1f} s); slice: "
          f"{SLICE_NAME}[{man['slice']['start']}:{man['slice']['stop']}]; median of {a.reps}, fresh process "
          f"per case; {C.machine_line()}")
    lat = f" --latency-ms {a.latency_ms:g}" if a.latency_ms else ""
    print(f"command: ./dev bench remote --size {a.size} --reps {a.reps}{lat}\n")
    print(C.markdown_table(["case", "seconds", "range", "GET", "HEAD", "PUT", "POST", "other requests",
                            "bytes read or saved", "bytes on the wire", "wire / bytes", "objects written"],
                           table))


if __name__ == "__main__":
    main()
