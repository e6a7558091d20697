"""The one-match fast paths of the open (a key's name, a commit record's file paths) decide exactly what
the segment-by-segment checks they short-cut decide: the same name, or an error of the same code."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ucl.errors import InvalidNameError, UCLError
from ucl.format import metadata, names

# keys and paths built from the characters the rules are about
ALPHABET = st.sampled_from(["a", "B", "0", ".", "..", "_", "__", "-", "/", "//", "\\", "\x00", "%2E", "%5F", "é",
                            "x" * 200, "\x7f"])
KEYS = st.lists(ALPHABET, min_size=0, max_size=40).map("".join)


def _segment_by_segment(key: str) -> str:
    """names.from_key as it was before the fast path: every segment checked on its own."""
    segments = key.split("/")
    if not key:
        raise InvalidNameError("empty")
    if all(names._PLAIN_SEGMENT.fullmatch(s) and s not in (".", "..") and not s.startswith("__") for s in segments):
        return names.check_name(key)
    raise LookupError("escaped")  # not plain: both take the same slow path below the fast one


@settings(max_examples=3000, deadline=None)
@given(KEYS)
def test_a_plain_key_is_its_name_exactly_when_the_segment_checks_say_so(key: str) -> None:
    try:
        want: object = _segment_by_segment(key)
    except UCLError as e:
        want = e.code
    except LookupError:
        want = None
    try:
        got: object = names._from_key_checked(key)
    except UCLError as e:
        got = e.code
    if want is None:  # an escaped key: the fast path must not have taken it as plain
        assert not (names._PLAIN_KEY.fullmatch(key) and not names._SPECIAL_SEGMENT.search(key))
    else:
        assert got == want


@pytest.mark.parametrize("key", ["a/b", "model/layers.0/w", "a" * 255, "/".join(["s"] * 32)])
def test_plain_keys_take_the_fast_path(key: str) -> None:
    assert names._PLAIN_KEY.fullmatch(key) and not names._SPECIAL_SEGMENT.search(key)
    assert names._from_key_checked(key) == key


@pytest.mark.parametrize("key", ["a" * 256, "/".join(["s"] * 33), "a/../b", "a/./b", "__x", "a/__b", "a//b", "/a",
                                 "a/", ".", ".."])
def test_keys_at_and_past_the_limits_are_refused(key: str) -> None:
    with pytest.raises(UCLError) as e:
        names._from_key_checked(key)
    assert e.value.code == "invalid_name"


@settings(max_examples=3000, deadline=None)
@given(KEYS)
def test_a_record_path_is_outside_its_step_exactly_when_a_segment_is(path: str) -> None:
    by_segment = any(seg in ("", ".", "..") or "\\" in seg or "\x00" in seg for seg in path.split("/"))
    assert bool(metadata._OUTSIDE.search(path)) == by_segment
