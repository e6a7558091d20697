"""The ``ucl`` command: inspect, validate, compare, maintain and convert checkpoints.

Every command takes ``--json`` (one JSON document on stdout) and exits 0 on success (a valid repository),
1 on failure (an invalid repository, an error, with ``{"error": {...}}`` under ``--json``) and 2 on a
usage error (argparse's message on stderr). Long operations draw a progress bar on stderr when it is a
terminal.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ucl.errors import ApproximateWarning, UCLError

EPILOG = """\
exit status: 0 success (valid), 1 failure (invalid, or an error), 2 usage error.
every command takes --json for one JSON document on stdout."""


def _print(obj: Any, as_json: bool, text: str) -> None:
    print(json.dumps(obj, indent=1) if as_json else text)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


# -- argument types --------------------------------------------------------------------------------
def _step(text: str) -> int:
    if not re.fullmatch(r"0|[1-9][0-9]{0,18}", text) or int(text) >= 1 << 63:
        raise argparse.ArgumentTypeError(f"invalid step {text!r} (an integer >= 0)")
    return int(text)


def _size(text: str) -> int:
    from ucl.tools.convert import parse_size

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not v >= 0 or math.isinf(v):
        raise argparse.ArgumentTypeError(f"invalid duration {text!r} (seconds >= 0)")
    return v


def _side(text: str) -> tuple[str | None, int | None]:
    """``PATH``, ``PATH@STEP`` or ``@STEP`` -> (path or None, step or None).

    What follows the last ``@`` must be a step, unless it holds a ``/`` or the whole text is an existing
    local path (a directory named ``run@2``): ``ckpt@abc`` is an invalid step, not a repository."""
    import os

    path, at, step = text.rpartition("@")
    if not at:
        return text, None
    if re.fullmatch(r"0|[1-9][0-9]{0,18}", step) and int(step) < 1 << 63:
        return (path or None), int(step)
    if "/" in step or os.path.exists(text):
        return text, None
    raise argparse.ArgumentTypeError(f"invalid step {step!r} in {text!r}: write PATH@STEP or @STEP with STEP an "
                                     "integer >= 0")


# -- commands --------------------------------------------------------------------------------------
def cmd_validate(a: argparse.Namespace) -> int:
    from ucl.tools import progress
    from ucl.tools.validate import validate_repo

    # the command draws its bar on a terminal whatever the size (the library call only above 256 MiB)
    report = validate_repo(a.path, a.step, checksums=not a.no_checksums, progress=progress.enabled())
    if a.json:
        print(json.dumps(report.to_dict(), indent=1))
    else:
        for p in report.problems:
            where = " ".join(x for x in [f"step {p.step}" if p.step is not None else "",
                                         f"tensor {p.tensor!r}" if p.tensor else "",
                                         f"file {p.file}" if p.file else ""] if x)
            print(f"INVALID [{p.code}] {p.message}" + (f"  ({where})" if where else ""))
        verdict = "valid" if report.ok else f"invalid: {len(report.problems)} problem(s)"
        print(f"{report.path}: {len(report.steps)} step(s), {report.files_checked} shard(s), "
              f"{report.bytes_checked / 1e6:.1f} MB checked: {verdict}")
    return 0 if report.ok else 1


def cmd_ls(a: argparse.Namespace) -> int:
    from ucl.format.repository import Repository

    repo = Repository.open(a.path)
    rows: list[dict[str, Any]] = []
    for s in repo.steps():
        try:
            r = repo.commit_record(s)
            row = {"step": s, "kind": r.kind, "parent": r.parent, "bytes": r.nbytes, "time": r.time}
            if r.kind == "delta":  # a composite step (spec/delta.md §9) is approximate: say so
                comp = repo.step_meta(s, r).composite
                if comp is not None:
                    row["approximate"] = {"stale_groups": len(comp.stale), "groups": comp.groups,
                                          "max_age": max(g.age for g in comp.stale)}
            rows.append(row)
        except UCLError as e:
            rows.append({"step": s, "error": e.code})

    def note(r: dict[str, Any]) -> str:
        ap = r.get("approximate")
        return "" if ap is None else (f"  approximate: {ap['stale_groups']}/{ap['groups']} groups stale, "
                                      f"up to {ap['max_age']} step{'s' if ap['max_age'] != 1 else ''} old")
    text = "\n".join(f"{r['step']:>10}  {r.get('kind', '?'):5}  {r.get('bytes', 0) / 1e6:10.1f} MB  "
                     f"{r.get('time', r.get('error'))}{note(r)}" for r in rows) or "(no committed steps)"
    _print(rows, a.json, f"{'step':>10}  kind   {'size':>13}  time\n{text}")
    return 0


def _chain(repo: Any, step: int, parent: int | None) -> list[int]:
    """The step and the parents its delta chain needs, newest first, down to the full base."""
    chain = [step]
    while parent is not None and len(chain) < 1 << 16 and parent not in chain:
        chain.append(parent)
        try:
            parent = repo.commit_record(parent).parent
        except UCLError:
            break
    return chain


def cmd_info(a: argparse.Namespace) -> int:
    from ucl.read.checkpoint import open as open_step

    with warnings.catch_warnings():  # info describes a composite step (below), it does not load it
        warnings.simplefilter("ignore", ApproximateWarning)
        ckpt = open_step(a.path, a.step, approximate=True)
    with ckpt:
        tensors: list[dict[str, Any]] = [{"name": n, "dtype": m.dtype, "shape": list(m.shape),
                                          "chunk_shape": list(m.chunk_shape), "shards": math.prod(m.grid),
                                          "bytes": m.nbytes, "delta": m.delta is not None, "logical": m.logical}
                                         for n, m in ckpt.meta.arrays.items()]
        comp = ckpt.composite
        stale = comp.tensors() if comp is not None else {}
        for t in tensors:
            if t["name"] in stale:
                t["stale"] = {"base_step": stale[t["name"]].base_step, "age": stale[t["name"]].age}
        source = next((e.get("configuration", {}) for e in ckpt.meta.extensions if e.get("name") == "ucl.source"), None)
        info: dict[str, Any] = {"step": ckpt.step, "kind": ckpt.kind, "parent": ckpt.meta.parent,
                "chain": _chain(ckpt.repo, ckpt.step, ckpt.meta.parent), "layout": ckpt.meta.layout,
                "mesh": ckpt.meta.mesh, "bytes": ckpt.record.nbytes, "time": ckpt.record.time,
                "source": None if source is None else {"format": source.get("format"),
                                                       "files": sorted(set(source.get("weight_map", {}).values()))},
                "tensors": tensors}
        rec = ckpt.records
        if rec is not None:  # spec/delta.md §8: the parameters and optimizer state are replayed
            replayed = sorted(n for n in ckpt if n not in ckpt.meta.arrays)
            info["gradient_records"] = {"base_step": rec.base_step, "optimizer": rec.fingerprint.optimizer,
                                        "implementation": rec.fingerprint.implementation,
                                        "torch_version": rec.fingerprint.torch_version,
                                        "parameters": len(rec.parameters), "replayed": replayed}
        if comp is not None:
            info["approximate"] = {"groups": comp.groups, "threshold": comp.threshold, "top_k": comp.top_k,
                                   "max_age": comp.max_age, "stale": [g.to_dict() for g in comp.stale]}
        lines = [f"step {ckpt.step} ({ckpt.kind}), {len(tensors)} tensors, {ckpt.record.nbytes / 1e6:.1f} MB, "
                 f"committed {ckpt.record.time}"]
        if comp is not None:
            lines.append(f"APPROXIMATE (composite step, spec/delta.md §9): {len(comp.stale)} of "
                         f"{comp.groups} "
                         "groups hold older steps' values; ucl.open/ucl.load need approximate=True")
            lines.append(f"  policy: threshold {comp.threshold:g}, top_k {comp.top_k}, "
                         f"max_age {comp.max_age} steps")
            lines += [f"  stale {g.group}: step {g.base_step}'s values, {g.age} "
                      f"step{'s' if g.age != 1 else ''} old (relative update {g.update:.3g})"
                      for g in comp.stale]
        if ckpt.kind == "delta":
            lines.append("chain: " + " -> ".join(map(str, info["chain"])) + " (full base last)")
        if rec is not None:
            g = info["gradient_records"]
            lines.append(f"gradient records: {g['parameters']} parameters and their optimizer state ({len(replayed)} "
                         f"tensors) replayed from step {rec.base_step} with {g['optimizer']} ({g['implementation']}, "
                         f"torch {g['torch_version']}); stored: the gradients")
        lines.append("layout: " + ("none (saved by one process)" if ckpt.meta.layout is None
                                   else json.dumps(ckpt.meta.layout, separators=(",", ":"))[:400]))
        if ckpt.meta.mesh is not None:
            lines.append("mesh: " + json.dumps(ckpt.meta.mesh, separators=(",", ":")))
        if info["source"] is not None:
            lines.append(f"source: {info['source']['format']} ({len(info['source']['files'])} file(s))")
        lines += [f"  {t['name']:60} {t['dtype']:14} {str(t['shape']):18} {t['shards']:>4} shard(s)"
                  + (f"  stale: step {t['stale']['base_step']}'s values ({t['stale']['age']} old)"
                     if "stale" in t else "  delta" if t["delta"] else "") for t in tensors]
        _print(info, a.json, "\n".join(lines))
    return 0


def _fmt(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{v * 100:.2f}%"
    if v == 0:
        return "0"
    return f"{v:.3e}" if math.isfinite(v) else str(v)


def cmd_diff(a: argparse.Namespace) -> int:
    from ucl.tools.diff import diff_steps

    (pa, sa), (pb, sb) = a.a, a.b
    if pa is None:
        a.parser.error(f"A must name a repository, got '@{sa}'")
    report = diff_steps(pa, pb or pa, sa, sb)
    if a.plot:
        from ucl.tools.diff import plot

        try:
            plot(report, a.plot)
        except ImportError:
            msg = "--plot needs matplotlib, which is not installed (pip install matplotlib)"
            if a.json:
                print(json.dumps({"error": {"code": "missing_dependency", "message": msg, "tensor": None,
                                            "file": None}}))
            else:
                print(f"ucl diff: error: {msg}", file=sys.stderr)
            return 1
    if a.json:
        print(json.dumps({**report.to_dict(), "plot": a.plot}, indent=1))
        return 0
    s = report.summary()
    lines = [f"a: {report.a['path']} step {report.a['step']}", f"b: {report.b['path']} step {report.b['step']}",
             f"{'tensor':48} {'max |b-a|':>10} {'rel L2':>10} {'changed':>9}  equal"]
    for t in report.tensors:
        if t.status == "compared":
            lines.append(f"{t.name:48} {_fmt(t.max_abs_diff):>10} {_fmt(t.rel_l2):>10} "
                         f"{_fmt(t.changed_fraction, True):>9}  {'yes' if t.bitwise_equal else 'no'}")
        else:
            what = {"only_a": "only in a", "only_b": "only in b", "incompatible": f"incompatible ({t.note})"}[t.status]
            lines.append(f"{t.name:48} {what}")
    lines.append(f"{s['tensors']} tensor(s): {s['equal']} bitwise equal, {s['changed']} changed"
                 + "".join(f", {s[k]} {k.replace('_', ' in ')}" for k in ("only_a", "only_b") if s[k])
                 + (f", {s['incompatible']} incompatible" if s["incompatible"] else ""))
    if a.plot:
        lines.append(f"plot written to {a.plot}")
    print("\n".join(lines))
    return 0


def cmd_gc(a: argparse.Namespace) -> int:
    from ucl.tools.gc import gc

    report = gc(a.path, dry_run=a.dry_run, grace=a.grace)
    if a.json:
        print(json.dumps(report.to_dict(), indent=1))
        return 0
    verb = "would delete" if a.dry_run else "deleted"
    lines = [f"{verb} {k}" for k in report.deleted]
    lines += [f"kept {k['key']}: {k['reason']}" for k in report.kept]
    lines.append(f"{report.path}: {verb} {len(report.deleted)} file(s), {_mb(report.bytes)}")
    print("\n".join(lines))
    return 0


def cmd_compact(a: argparse.Namespace) -> int:
    from ucl.tools.compact import compact

    r = compact(a.path, a.step, compression=a.compression, force=a.force)
    _print(r.to_dict(), a.json, r.message)
    return 0


def cmd_import(a: argparse.Namespace) -> int:
    from ucl.tools.convert import KEEP_FILES_BYTES, import_checkpoint

    r = import_checkpoint(a.src, a.dst, a.step, compression=a.compression)
    text = f"imported {a.src} ({r.source}, {r.tensors} tensors, {_mb(r.bytes)}) as step {r.step} of {a.dst}"
    if r.kept_files:
        text += f"\nkept {len(r.kept_files)} other file(s) for export: " + ", ".join(r.kept_files)
    if r.skipped_files:
        text += (f"\nnote: {len(r.skipped_files)} file(s) not kept, past the {KEEP_FILES_BYTES >> 20} MiB kept of a "
                 "directory's other files: " + ", ".join(r.skipped_files))
    _print({**r.to_dict(), "src": a.src, "dst": a.dst}, a.json, text)
    return 0


def cmd_export(a: argparse.Namespace) -> int:
    import os

    from ucl.tools.convert import export_safetensors

    prefixes = [p for arg in a.tensors for p in arg.split(",") if p] if a.tensors is not None else None
    if a.tensors is not None and not prefixes:
        a.parser.error("argument --tensors: expected name prefixes, e.g. --tensors model/")
    if a.config is not None and a.to is None:
        a.parser.error("argument --config: a config.json goes with --to hf")
    r = export_safetensors(a.path, a.dst, a.step, tensors=prefixes, strip_prefix=a.strip_prefix,
                           max_shard_size=a.max_shard_size, view={"hf": "hf-llama"}.get(a.to), config=a.config)
    text = f"exported {r.tensors} tensors ({_mb(r.bytes)}) to {len(r.files)} file(s)"
    text += f", index {r.index}" if r.index else f": {r.files[0]}" if r.files else ""
    if r.restored_files:
        text += f"\nrestored {len(r.restored_files)} file(s) of the imported directory: " + ", ".join(
            os.path.basename(f) for f in r.restored_files)
    if r.removed:
        text += f"\nremoved {len(r.removed)} file(s) of a previous export: " + ", ".join(
            os.path.basename(f) for f in r.removed)
    if r.skipped_values:
        text += (f"\nnote: safetensors holds tensors only; {len(r.skipped_values)} other value(s) left out: "
                 + ", ".join(r.skipped_values[:10]) + (" ..." if len(r.skipped_values) > 10 else ""))
    _print(r.to_dict(), a.json, text)
    return 0


# -- the parser ------------------------------------------------------------------------------------
COMMANDS: list[tuple[str, str, str]] = [
    ("ls", "list committed steps with kind, size and time", "ucl ls ckpt\n  ucl ls s3://bucket/run1 --json"),
    ("info", "a step's tensors, dtypes, shapes, shards, layout and delta chain",
     "ucl info ckpt              # the newest step\n  ucl info ckpt --step 100 --json"),
    ("validate", "check a repository against the spec (exit 0 valid, 1 invalid)",
     "ucl validate ckpt\n  ucl validate ckpt --step 100 --no-checksums"),
    ("diff", "per-tensor change statistics between two steps (of one repository or two)",
     "ucl diff ckpt@100 ckpt@200\n  ucl diff ckpt@100 @200 --plot change.png   # @STEP: same repository as A\n"
     "  ucl diff run1 run2 --json                   # newest step of each"),
    ("gc", "delete files of uncommitted steps and files no commit record references",
     "ucl gc ckpt --dry-run\n  ucl gc ckpt --grace 0      # also very recent leftovers"),
    ("compact", "rewrite a delta step as a full step with the same number",
     "ucl compact ckpt --step 100"),
    ("import", "write a safetensors / torch.save / DCP checkpoint as a new step",
     "ucl import model.safetensors ckpt\n  ucl import hf_model_dir/ ckpt --step 0   # sharded, with "
     "model.safetensors.index.json\n  ucl import model.pt ckpt\n  ucl import dcp_checkpoint_dir/ ckpt"),
    ("export", "write a step (or a subtree) as safetensors: one file or a directory",
     "ucl export ckpt out/model.safetensors\n  ucl export ckpt out/ --step 100 --max-shard-size 2GB\n"
     "  ucl export ckpt hf_out/ --tensors model/ --strip-prefix model/   # {'model': ..., 'optim': ...} -> HF\n"
     "  ucl export megatron_ckpt hf_llama/ --to hf   # a Megatron-core GPT/LLaMA step -> LlamaForCausalLM"),
]


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="ucl", formatter_class=fmt, usage="%(prog)s [-h] [--version] COMMAND ...",
        description="Universal Checkpoint Language: inspect, validate, compare, maintain and convert checkpoints.",
        epilog="examples:\n  ucl ls ckpt\n  ucl validate ckpt\n  ucl diff ckpt@100 @200\n"
        "  ucl import hf_model/ ckpt\n\n"
        + EPILOG)
    p.add_argument("--version", action="version", version=f"ucl {_version()}")
    # the commands once: this list (argparse's own, per-choice help, is left out: it would repeat it)
    sub = p.add_subparsers(title="commands", description="\n".join(f"{n:9} {h}" for n, h, _ in COMMANDS),
                           dest="command", required=True, metavar="COMMAND", help=argparse.SUPPRESS, prog="ucl")
    parsers = {}
    for name, help_, examples in COMMANDS:
        sp = sub.add_parser(name, description=help_[0].upper() + help_[1:] + ".",
                            epilog=f"examples:\n  {examples}\n\n{EPILOG}", formatter_class=fmt)
        parsers[name] = sp

    def path(sp: argparse.ArgumentParser, what: str = "repository directory or URL (file://, s3://, ...)") -> None:
        sp.add_argument("path", metavar="PATH", help=what)

    def step(sp: argparse.ArgumentParser, what: str, required: bool = False) -> None:
        sp.add_argument("--step", type=_step, metavar="N", help=what, required=required)

    path(parsers["ls"])
    path(parsers["info"])
    step(parsers["info"], "the step (default: the newest committed step)")
    v = parsers["validate"]
    path(v)
    step(v, "only this step (and the steps its delta chain needs)")
    v.add_argument("--no-checksums", action="store_true", help="skip reading data (structure and sizes only)")
    d = parsers["diff"]
    d.add_argument("a", metavar="A", type=_side, help="PATH[@STEP]: the reference (default step: the newest)")
    d.add_argument("b", metavar="B", type=_side, help="PATH[@STEP], or @STEP for another step of A's repository")
    d.add_argument("--plot", metavar="FILE.png", help="draw relative change per layer and tensor (needs matplotlib)")
    g = parsers["gc"]
    path(g)
    g.add_argument("--dry-run", action="store_true", help="only report what would be deleted")
    g.add_argument("--grace", type=_seconds, default=3600.0, metavar="SECONDS",
                   help="keep uncommitted files younger than this, which a save may be writing (default 3600)")
    c = parsers["compact"]
    path(c)
    step(c, "the delta step to rewrite as a full one", required=True)
    c.add_argument("--compression", choices=["zstd"], help="compress the full step's chunks")
    c.add_argument("--force", action="store_true", help="rewrite the step even if it is already full")
    i = parsers["import"]
    i.add_argument("src", metavar="SRC", help="a .safetensors file or directory (with or without an index), a "
                   "torch.save file, or a DCP checkpoint directory")
    i.add_argument("dst", metavar="DST", help="the repository to write into (created if needed)")
    step(i, "the step to write (default: after the newest; 0 in a new repository)")
    i.add_argument("--compression", choices=["zstd"], help="compress chunks")
    e = parsers["export"]
    path(e)
    e.add_argument("dst", metavar="DST", help="NAME.safetensors (exactly that one file), or a directory "
                   "(model.safetensors or shards with an index; a previous export's shards are removed)")
    step(e, "the step (default: the newest committed step)")
    e.add_argument("--tensors", action="append", metavar="PREFIX",
                   help="export only tensors whose names begin with PREFIX (repeatable, or a comma list), e.g. model/")
    e.add_argument("--strip-prefix", metavar="PREFIX",
                   help="remove PREFIX from the front of every exported name, e.g. model/")
    e.add_argument("--to", choices=["hf"], help="hf: a Megatron-core GPT/LLaMA step as a Hugging Face "
                   "LlamaForCausalLM directory (the hf-llama view: q/k/v and gate/up split; config.json written)")
    e.add_argument("--config", metavar="CONFIG_JSON", help="with --to hf: the model's config.json to write "
                   "(default: one made from the step's shapes, with Megatron-core's default norm epsilon and "
                   "rotary base)")
    e.add_argument("--max-shard-size", type=_size, metavar="SIZE",
                   help="in a directory, split into files of at most SIZE (5GB, 500MiB, ...) with an index; "
                   "default: the imported source's files, else 5GB. A NAME.safetensors export larger than SIZE fails")
    for name, sp in parsers.items():
        sp.add_argument("--json", action="store_true", help="one JSON document on stdout")
        sp.set_defaults(func=globals()[f"cmd_{name}"], parser=sp)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``ucl`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit status."""
    if list(sys.argv[1:] if argv is None else argv) == ["--version"]:  # instant: no parser, no engine
        print(f"ucl {_version()}")
        return 0
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
        try:
            return int(a.func(a))
        except UCLError as e:
            err: dict[str, Any] = e.to_dict()
        except OSError as e:  # the source or destination of a conversion, a full disk
            err = {"code": "os_error", "message": f"{type(e).__name__}: {e}", "tensor": None,
                   "file": getattr(e, "filename", None)}
    except SystemExit as e:  # argparse: --help, --version (0) and usage errors (2)
        return 0 if e.code in (0, None) else 2
    if getattr(a, "json", False):
        print(json.dumps({"error": err}))
    else:
        print(f"ucl {a.command}: error [{err['code']}]: {err['message']}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())


def _version() -> str:
    """The installed version, from the package metadata: nothing of the engine (torch) is imported."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("ucl")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"
