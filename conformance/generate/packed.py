"""``cases/packed.json``: step documents of format version 3, whose members are packed (spec/core.md §5.1
"Packed members", §9 item 6, §10.2 item 3).

``valid/layout_packed`` is a layout step as ucl's writer writes it at version 3 (``ucl.save_sharded`` with
``WriteOptions(format_version=3)``): its tree, layout, mesh, logical records and consolidated metadata in
``attributes.ucl.packed``, base64 of one Zstandard frame. A Level-0 reader expands it and then refuses the
layout step with ``unknown_extension`` (core.md §9 item 3), so its cases are Level 1.

The other fixtures start from the small plain step of most invalid fixtures (``tiny``), whose document is
packed here as a version 3 writer packs it (every member but ``format_version``, ``step``, ``kind`` and
``parent``): ``valid/packed_plain`` and ``valid/packed_content_depth_127``, which a Level-0 reader reads
bit-exactly, and one defect each of §5.1 items 1-4, the document resealed in the commit record so that the
packing is the first thing wrong. Frames the zstd library would not write (no declared content size, a
dictionary, a size that lies, data after the frame, a decompression bomb) are built here by hand from raw
and RLE blocks (RFC 8878 §3.1.1).
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from numcodecs import Zstd

import ucl
from ucl.format import metadata
from ucl.layout import parse_layout, parse_mesh
from ucl.options import WriteOptions
from ucl.testing.layout_reference import shard_local_state

from .fixture import Fx, json_depth, tiny
from .layouts import SMALL_RULES, small_state
from .suite import Cases

S_PACKED = "core.md §5.1"  # "Packed members": cite() narrows a defect's case to its numbered item
V3 = WriteOptions(format_version=3)
#: what a version 3 writer packs: every member of attributes.ucl but those retention and chains read
#: (format_version, step, kind, parent), and the consolidated metadata
PACKED_UCL = ("tree", "layout", "mesh", "extensions", "logical")
MAGIC = b"\x28\xb5\x2f\xfd"
MAX_BLOCK = 128 << 10  # RFC 8878 §3.1.1.2.3: Block_Maximum_Size
WINDOW_128K = 7 << 3  # a Window_Descriptor of 2^(10+7) bytes, one block's maximum


def zstd(content: bytes) -> bytes:
    """One frame as the zstd library writes it (numcodecs declares the content size)."""
    return bytes(Zstd(9).encode(content))


def block(data: bytes, last: bool, rle_size: int | None = None) -> bytes:
    """A raw block of ``data``, or an RLE block of ``rle_size`` copies of the byte ``data``."""
    kind, size = (0, len(data)) if rle_size is None else (1, rle_size)
    assert size <= MAX_BLOCK and (rle_size is None or len(data) == 1)
    return (int(last) | kind << 1 | size << 3).to_bytes(3, "little") + data


def raw_frame(content: bytes, declared: int | None, dictionary: int = 0) -> bytes:
    """A frame of raw blocks holding ``content``, with a window descriptor (not single-segment), whose
    header declares ``declared`` bytes (a 4-byte Frame_Content_Size; None: no size) and, when
    ``dictionary`` is not 0, names that dictionary (a 1-byte Dictionary_ID)."""
    fcs_flag = 0 if declared is None else 2
    fhd = fcs_flag << 6 | (1 if dictionary else 0)
    head = MAGIC + bytes([fhd, WINDOW_128K])
    if dictionary:
        head += bytes([dictionary])
    if declared is not None:
        head += declared.to_bytes(4, "little")
    parts = [content[i : i + MAX_BLOCK] for i in range(0, len(content), MAX_BLOCK)] or [b""]
    return head + b"".join(block(p, i == len(parts) - 1) for i, p in enumerate(parts))


def bomb_frame(content: bytes, size: int) -> bytes:
    """A frame of ``size`` bytes declared and held: ``content`` (a JSON object) with its closing brace
    moved ``size - len(content)`` spaces to the right (JSON whitespace, in RLE blocks of 128 KiB): a few
    KiB that expand to a valid JSON text of ``size`` bytes."""
    pad = size - len(content)
    blocks = [block(content[:-1], False)]
    while pad > 0:
        n = min(pad, MAX_BLOCK)
        blocks.append(block(b" ", False, rle_size=n))
        pad -= n
    blocks.append(block(content[-1:], True))
    return MAGIC + bytes([2 << 6, WINDOW_128K]) + size.to_bytes(4, "little") + b"".join(blocks)


def pack_doc(
    d: dict[str, Any],
    *,
    version: int = 3,
    content: Callable[[dict[str, Any]], Any] | None = None,
    text: Callable[[bytes], bytes] = lambda c: c,
    frame: Callable[[bytes], bytes] = zstd,
    encode: Callable[[bytes], Any] = lambda f: base64.b64encode(f).decode("ascii"),
) -> None:
    """Pack the step document ``d`` in place as a version 3 writer does; each stage may be replaced to
    plant one defect: ``content`` edits the packed object (its ``ucl`` and ``consolidated_metadata``)
    and may return another value to pack instead, ``text`` edits its JSON text, ``frame`` compresses,
    ``encode`` makes ``packed``'s value of the frame."""
    u = d["attributes"]["ucl"]
    inner: dict[str, Any] = {"ucl": {k: u.pop(k) for k in PACKED_UCL if k in u},
                             "consolidated_metadata": d.pop("consolidated_metadata")}
    u["format_version"] = version
    if content is not None:
        other = content(inner)
        inner = inner if other is None else other
    u["packed"] = encode(frame(text(metadata.dumps(inner))))


def expanded(d: dict[str, Any]) -> dict[str, Any]:
    """The document a reader sees once ``d`` is expanded (§5.1), for the generator's own checks."""
    u = d["attributes"]["ucl"]
    inner = json.loads(bytes(Zstd().decode(base64.b64decode(u.pop("packed")))))
    u.update(inner["ucl"])
    d["consolidated_metadata"] = inner["consolidated_metadata"]
    return d


def nested(levels: int) -> Any:
    node: Any = 0
    for _ in range(levels):
        node = [node]
    return node


def deep_extension(total: int) -> Callable[[dict[str, Any]], None]:
    """Content ``total`` levels deep (§3.4 item 2, the content's object at 1): an extension a reader may
    ignore (``must_understand: false``) whose configuration holds nested lists."""

    def edit(inner: dict[str, Any]) -> None:
        # content 1, ucl 2, extensions 3, the extension 4, configuration 5, its "v" 5 + k
        ext = {"name": "example.deep", "configuration": {"v": nested(total - 5)}, "must_understand": False}
        inner["ucl"]["extensions"] = [ext]
        assert json_depth(inner) == total

    return edit


def build(root: Path, cases: Cases) -> None:
    _layout(root, cases)
    _plain(root, cases)
    _defects(root, cases)


def _layout(root: Path, cases: Cases) -> None:
    fx = "valid/layout_packed"
    f = Fx(root, fx)
    full = small_state()
    text = "ucl-layout 1\nmesh dp=2 tp=2\n" + "".join(SMALL_RULES.values())
    layout, mesh = parse_layout(text), parse_mesh("dp=2 tp=2")
    states: list[dict[str, Any]] = [dict(shard_local_state(full, layout, mesh, r)) for r in range(mesh.size)]
    for r, s in enumerate(states):  # g: a partial sum over tp, contribution k at tp = k
        s["g"] = full["g"] * 0.5 if r % 2 == 0 else full["g"] - full["g"] * 0.5
        s["iteration"] = 7
    ucl.save_sharded(states, f.path, 1, layout=layout, mesh=mesh, options=V3)
    f.fix_time(1)
    doc = f.read_json("steps/1/zarr.json")
    u = doc["attributes"]["ucl"]
    assert u["format_version"] == 3 and set(u) == {"format_version", "step", "kind", "parent", "packed"}, u
    assert "consolidated_metadata" not in doc
    inner = expanded(doc)["attributes"]["ucl"]
    assert inner["layout"] is not None and "logical" in inner, "the writer packs the step's layout and records"

    what = "a layout step of format version 3 as ucl's writer writes it (4 ranks, dp=2 tp=2)"
    cases.valid(f"{what}: its tree, layout, mesh, logical records and consolidated metadata packed "
                "(attributes.ucl.packed) validates", S_PACKED, fx, "validate", level=1)
    cases.valid(f"{what}: it opens with the logical tensors", S_PACKED, fx, "open", keys=sorted(full),
                level=1)
    cases.reads(
        S_PACKED,
        fx,
        full,
        level=1,
        boxes={"w": [[[4, 9], [0, 2]]], "opt/a/m": [[[1, 3], [1, 4]]]},
        what=lambda n: ": its logical record read from the packed members",
    )


def _plain(root: Path, cases: Cases) -> None:
    fx = "valid/packed_plain"
    f, st = tiny(root, fx)
    f.edit_step_doc(1, pack_doc)
    cases.valid("a plain step (no layout) whose document is of version 3, its tree and consolidated metadata "
                "packed: valid", S_PACKED, fx, "validate")
    cases.valid("it opens", S_PACKED, fx, "open", keys=sorted(st))
    cases.reads(S_PACKED, fx, st, what=lambda _: " from a packed step document")

    # the content's depth limit is 127 (its members are one level deeper in the document): 127 is valid
    fx = "valid/packed_content_depth_127"
    f, st = tiny(root, fx)
    f.edit_step_doc(1, lambda d: pack_doc(d, content=deep_extension(127)))
    assert json_depth(expanded(f.read_json("steps/1/zarr.json"))) == 128
    cases.valid("packed content 127 levels deep (an ignorable extension's configuration; 128 once "
                "expanded): valid", "core.md §5.1 item 3", fx, "validate")
    cases.reads("core.md §5.1 item 3", fx, {"w": st["w"]}, what=lambda _: " next to 127-level packed content")


def _defects(root: Path, cases: Cases) -> None:
    def defect(name: str, what: str, code: str, **pack: Any) -> None:
        fx = f"invalid/metadata/packed_{name}"
        f, _ = tiny(root, fx)
        f.edit_step_doc(1, lambda d: pack_doc(d, **pack))
        cases.invalid(what, S_PACKED, fx, code)
        cases.error(f"{what}: the step does not open", S_PACKED, fx, "open", code, {"step": 1})

    # item 1: packed is a string of padded base64 of a Zstandard frame, its header sound
    defect("not_a_string", "attributes.ucl.packed is an object, not a string", "schema_violation",
           encode=lambda f: {"b64": base64.b64encode(f).decode()})
    defect("not_base64", "attributes.ucl.packed is not base64 ('*' is outside its alphabet)", "schema_violation",
           encode=lambda f: "*" + base64.b64encode(f).decode()[1:])

    def unpadded(f: bytes) -> str:
        t = base64.b64encode(f).decode()
        if not t.endswith("="):  # a frame whose length is a multiple of 3 needs no padding: lengthen it
            t = base64.b64encode(f + b"\0").decode()
        return t.rstrip("=")

    defect("base64_unpadded", "attributes.ucl.packed is base64 without its padding", "schema_violation",
           encode=unpadded)
    defect("not_a_zstd_frame", "attributes.ucl.packed is base64 of the JSON text itself, not of a Zstandard "
           "frame", "schema_violation", frame=lambda c: c)
    defect("frame_without_content_size", "a Zstandard frame whose header does not declare its content size "
           "(Frame_Content_Size absent)", "schema_violation", frame=lambda c: raw_frame(c, None))
    defect("frame_with_dictionary", "a Zstandard frame whose header names a dictionary (Dictionary_ID 1)",
           "schema_violation", frame=lambda c: raw_frame(c, len(c), dictionary=1))
    defect("declares_1_byte", "a Zstandard frame that declares (and holds) 1 byte: under 2, the size of the "
           "shortest JSON object", "schema_violation", frame=lambda c: raw_frame(b"1", 1))

    fx = "hostile/packed_declares_over_256_mib"
    f, st = tiny(root, fx)
    f.edit_step_doc(1, lambda d: pack_doc(d, frame=lambda c: bomb_frame(c, (256 << 20) + 1)))
    assert len(f.read("steps/1/zarr.json")) < 16 << 10
    what = ("a Zstandard frame of a few KiB that declares, and expands to, 256 MiB + 1 bytes of valid JSON "
            "(the packed members, then spaces): refused from its header, before anything is decompressed")
    cases.invalid(what, S_PACKED, fx, "limit_exceeded")
    cases.error("a step whose packed members would expand past 256 MiB does not open", S_PACKED, fx, "open",
                "limit_exceeded", {"step": 1})

    # item 2: the frame decompresses to exactly its declared size, and nothing follows it
    defect("declares_more_than_content", "a Zstandard frame that declares one byte more than it holds",
           "schema_violation", frame=lambda c: raw_frame(c, len(c) + 1))
    defect("data_after_frame", "one zero byte after the Zstandard frame", "schema_violation",
           frame=lambda c: zstd(c) + b"\0")
    skippable = b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"ucl!"  # RFC 8878 §3.1.2
    defect("skippable_frame_after_frame", "a skippable frame (RFC 8878 §3.1.2) after the Zstandard frame: "
           "packed is exactly one frame", "schema_violation", frame=lambda c: zstd(c) + skippable)

    # item 3: the content is a document of its own for §3.4, 127 levels deep at most
    defect("content_not_json", "packed content that is not JSON (an unterminated object)", "schema_violation",
           text=lambda c: c[:-1])
    defect("content_depth_128", "packed content 128 levels deep (129 once expanded), one past its limit of 127",
           "limit_exceeded", content=deep_extension(128))

    # item 4: an object of at most ucl (an object) and consolidated_metadata, no member given twice
    defect("content_not_an_object", "packed content that is a JSON array of the packed object",
           "schema_violation", content=lambda inner: [inner])
    defect("content_other_member", "packed content with a member other than ucl and consolidated_metadata",
           "schema_violation", content=lambda inner: inner.__setitem__("attributes", {}))

    # a member both packed and in place: the tree (in attributes.ucl) and consolidated_metadata (top level)
    for fx, what, path in (
            ("packed_member_also_unpacked", "the tree both packed and in attributes.ucl (the same tree twice)",
             ("attributes", "ucl", "tree")),
            ("packed_consolidated_metadata_twice",
             "consolidated_metadata both packed and in the document (the same twice)", ("consolidated_metadata",))):

        def twice(d: dict[str, Any], path: tuple[str, ...] = path) -> None:
            *up, name = path
            value = _at(d, up)[name]
            pack_doc(d)
            _at(d, up)[name] = value

        fx = f"invalid/metadata/{fx}"
        f, _ = tiny(root, fx)
        f.edit_step_doc(1, twice)
        cases.invalid(what, S_PACKED, fx, "schema_violation")
        cases.error(f"{what}: the step does not open", S_PACKED, fx, "open", "schema_violation", {"step": 1})

    # packed in a document of version 1 or 2 (the schema has it false): every member left in place, packed
    # holds none (as an expansion would find them), so packed's presence is the only defect
    for version in (1, 2):
        fx = f"invalid/metadata/packed_in_version_{version}"
        f, _ = tiny(root, fx)

        def empty_packed(d: dict[str, Any], v: int = version) -> None:
            d["attributes"]["ucl"]["format_version"] = v  # a plain step's document is the same in 1 and 2
            d["attributes"]["ucl"]["packed"] = base64.b64encode(zstd(b'{"ucl":{}}')).decode("ascii")

        f.edit_step_doc(1, empty_packed)
        what = f"a step document of format version {version} with attributes.ucl.packed (of no member)"
        cases.invalid(what, S_PACKED, fx, "schema_violation")
        cases.error(f"{what}: the step does not open", S_PACKED, fx, "open", "schema_violation", {"step": 1})


def _at(d: dict[str, Any], path: list[str]) -> dict[str, Any]:
    for k in path:
        d = d[k]
    return d
