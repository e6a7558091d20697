"""Delta steps (spec/delta.md): bit-exact differences between consecutive checkpoints.

Pure functions, no I/O: the writer and reader call them with chunks they have in memory and with
callbacks that read metadata and inner chunks.

- :func:`encode_chunk` / :func:`decode_chunk`: one inner chunk's payload (mode byte + zstd of the
  byte-plane shuffle of full values, XOR or wrapping difference of bit patterns).
- :func:`choose_encoding`: the writer's per-tensor choice of ``"xor"`` or ``"sub"``.
- :func:`resolve_chain`, :func:`resolve_array_chain`, :func:`reconstruct_inner`: chains of steps.
- :class:`DeltaRecord` (from ucl.format.records): the array's ``attributes.ucl.delta`` and its codec.
"""

from ucl.delta.chain import (
    DEFAULT_MAX_CHAIN,
    ArrayInfo,
    StepInfo,
    reconstruct_inner,
    resolve_array_chain,
    resolve_chain,
)
from ucl.delta.codec import (
    ENCODINGS,
    MODE_FULL,
    MODE_SUB,
    MODE_XOR,
    bit_view,
    decode_chunk,
    encode_chunk,
    encode_chunk_into,
    payload_bound,
    payload_mode,
)
from ucl.format.records import CODEC_NAME, DeltaRecord, GradientRecords, OptimizerFingerprint, parse_codec

__all__ = [
    "CODEC_NAME",
    "DEFAULT_MAX_CHAIN",
    "ENCODINGS",
    "MODE_FULL",
    "MODE_SUB",
    "MODE_XOR",
    "ArrayInfo",
    "DeltaRecord",
    "GradientRecords",
    "OptimizerFingerprint",
    "StepInfo",
    "bit_view",
    "choose_encoding",
    "decode_chunk",
    "encode_chunk",
    "encode_chunk_into",
    "parse_codec",
    "payload_bound",
    "payload_mode",
    "reconstruct_inner",
    "resolve_array_chain",
    "resolve_chain",
]
