"""Fixtures for storage tests: the loopback S3 server (tests/io/stores/moto_server.py)."""

from __future__ import annotations

import pytest

from tests.io.stores import moto_server


@pytest.fixture
def s3_env(monkeypatch) -> dict[str, str]:
    """The AWS_* environment pointing standard clients at the loopback server."""
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    env = moto_server.s3_env()
    for k in moto_server.UNSET:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture
def bucket(s3_env) -> str:
    """A fresh, empty bucket on the loopback server."""
    return moto_server.new_bucket()
