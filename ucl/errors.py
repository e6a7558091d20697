"""The error hierarchy. Every error ucl raises is a :class:`UCLError` with a stable ``code``.

Codes are part of the spec (spec/core.md, "Error codes"): the conformance suite compares codes, never
message text. Where callers expect a builtin, the leaf inherits it too (``CheckpointNotFoundError`` is a
``FileNotFoundError``). Messages say what was expected, what was found, and for which tensor or file.
"""

from __future__ import annotations


class UCLError(Exception):
    """Base of every ucl error."""

    code = "ucl_error"

    def __init__(self, message: str, *, tensor: str | None = None, file: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.tensor = tensor
        self.file = file

    def __str__(self) -> str:  # OSError/KeyError parents would print errno tuples or quotes instead
        return self.message

    def to_dict(self) -> dict[str, str | None]:
        return {"code": self.code, "message": self.message, "tensor": self.tensor, "file": self.file}


# -- not there ------------------------------------------------------------------------------------
class CheckpointNotFoundError(UCLError, FileNotFoundError):
    """The repository, or the requested step, does not exist (no valid commit record)."""

    code = "not_found"


class StepNotCommittedError(CheckpointNotFoundError):
    """A step's files exist but its commit record does not: the step was never committed."""

    code = "not_committed"


class TensorNotFoundError(UCLError, KeyError):
    """The step has no tensor of that name."""

    code = "tensor_not_found"


# -- metadata that is not valid -------------------------------------------------------------------
class FormatError(UCLError, ValueError):
    """Metadata that does not follow the spec."""

    code = "format_error"


class SchemaError(FormatError):
    """A metadata document is not valid JSON or does not match its JSON Schema."""

    code = "schema_violation"


class UnsupportedVersionError(FormatError):
    """The format version is newer than this implementation reads."""

    code = "unsupported_version"


class UnknownExtensionError(FormatError):
    """An extension, codec or field this implementation does not know, marked must_understand."""

    code = "unknown_extension"


class ApproximateStepError(UnknownExtensionError):
    """A composite step (spec/delta.md §9) opened without ``approximate=True``: some of its groups hold an
    older step's values, so it is not the state at its step. The code is ``unknown_extension``, as for a
    gradient-record step that cannot be replayed exactly."""


class ApproximateWarning(UserWarning):
    """A composite step was opened with ``approximate=True``: the warning names its stale groups."""


class InvalidNameError(FormatError):
    """A tensor name or storage key that is not allowed (empty, control characters, escapes the step)."""

    code = "invalid_name"


class UnsupportedDTypeError(FormatError):
    """A data type outside the spec's list, or one torch cannot hold."""

    code = "unsupported_dtype"


class LimitExceededError(FormatError):
    """A value beyond the spec's limits (shape of 2^63 elements, JSON too large or too deep)."""

    code = "limit_exceeded"


class InconsistentMetadataError(FormatError):
    """Documents that disagree (commit record vs array metadata, chunk grid vs shape)."""

    code = "inconsistent_metadata"


# -- bytes that are not what was committed --------------------------------------------------------
class IntegrityError(UCLError):
    """Stored bytes differ from what the commit record and checksums say."""

    code = "integrity_error"


class ChecksumError(IntegrityError):
    """A crc32c does not match (an inner chunk, a shard index, a file, a commit record)."""

    code = "checksum_mismatch"


class MissingShardError(IntegrityError):
    """A shard file listed in the commit record is absent."""

    code = "missing_shard"


class ShardSizeError(IntegrityError):
    """A shard file's size differs from the commit record (truncated or extended)."""

    code = "size_mismatch"


class CorruptShardIndexError(IntegrityError):
    """A shard index entry points outside its file, overlaps another, or has an impossible length."""

    code = "corrupt_shard_index"


class PayloadError(IntegrityError, FormatError):
    """A payload whose crc32c verifies but that does not decode to exactly its inner chunk (spec/delta.md
    §5.4): no mode byte, an unknown or mismatched mode, frames that are not what §5.2 allows, that do not
    decode, or whose content does not add up to the chunk. ``integrity_error`` (spec/core.md §10), as a
    compressed inner chunk that does not decompress; still a ``FormatError`` for callers that catch that."""

    code = "integrity_error"


class CorruptCommitRecordError(IntegrityError):
    """A commit record exists but is unreadable or fails its own checksum."""

    code = "corrupt_commit_record"


# -- layouts and deltas (spec/layout.md, spec/delta.md) -------------------------------------------
class LayoutError(UCLError, ValueError):
    """A layout that is invalid or does not fit the tensors or the mesh."""

    code = "layout_error"


class DeltaChainError(FormatError):
    """A delta chain that cannot be resolved: missing or uncommitted parent, cycle, mismatched base."""

    code = "broken_chain"


# -- writing --------------------------------------------------------------------------------------
class WriteError(UCLError, OSError):
    """Writing a step failed (I/O error, full disk, a failed rank); the step is not committed."""

    code = "write_failed"


class StepExistsError(UCLError, FileExistsError):
    """A committed step with this number exists; committed steps never change."""

    code = "step_exists"


class WriterLockedError(UCLError):
    """Another writer holds the repository's write lock."""

    code = "writer_locked"


class InvalidArgumentError(UCLError, ValueError):
    """An argument a caller passed is not valid (a state dict value that is not a tensor, a bad step)."""

    code = "invalid_argument"


class NotAFileError(IntegrityError):
    """Where a document or shard should be there is something that is not a regular file: a directory,
    a FIFO, a device node or a socket. Never opened for reading (a FIFO would block, a device never end)."""

    code = "not_a_file"


class StepRemovedError(CheckpointNotFoundError):
    """The step was deleted (retention, ``ucl gc``, ``ucl compact``) while it was being read: its commit
    record is gone or was replaced, so its missing files are not corruption."""

    code = "step_removed"


class PendingCompactionError(UCLError):
    """An interrupted compaction of this step is pending (its journal exists): writing the step now would
    race the journal's roll-forward. Finish it with ``ucl compact <repo> <step>``."""

    code = "compaction_pending"


ALL_CODES: dict[str, type[UCLError]] = {
    cls.code: cls
    for cls in [
        UCLError, CheckpointNotFoundError, StepNotCommittedError, TensorNotFoundError, FormatError,
        SchemaError, UnsupportedVersionError, UnknownExtensionError, InvalidNameError,
        UnsupportedDTypeError, LimitExceededError, InconsistentMetadataError, IntegrityError,
        ChecksumError, MissingShardError, ShardSizeError, CorruptShardIndexError,
        CorruptCommitRecordError, LayoutError, DeltaChainError, WriteError, StepExistsError,
        WriterLockedError, InvalidArgumentError, NotAFileError, StepRemovedError, PendingCompactionError,
    ]
}


# -- layout failures (spec/layout.md §10); appended, each a LayoutError with its own code -----------
class LayoutSyntaxError(LayoutError):
    """Layout text that does not follow the grammar (spec/layout.md §3)."""

    code = "layout_syntax"


class InvalidLayoutError(LayoutError):
    """A layout inconsistent in itself: an axis used twice, transforms out of order, a bad value or field."""

    code = "invalid_layout"


class MeshMismatchError(LayoutError):
    """A mesh that does not fit: wrong world size, an axis the layout names is missing, or not the declared mesh."""

    code = "mesh_mismatch"


class UnmatchedPatternError(LayoutError):
    """A rule or renumber pattern, or a flat member, that matches no tensor."""

    code = "pattern_unmatched"


class OverlappingRulesError(LayoutError):
    """A tensor that more than one rule matches."""

    code = "rules_overlap"


class LayoutShapeError(LayoutError):
    """A tensor that does not fit its rule: a shape not dividing as declared, a layer outside its stage."""

    code = "layout_shape_mismatch"


ALL_CODES.update({cls.code: cls for cls in [LayoutSyntaxError, InvalidLayoutError, MeshMismatchError,
                                             UnmatchedPatternError, OverlappingRulesError, LayoutShapeError]})
