"""The runnable snippets of docs/zarr.md and docs/s3.md, executed in order, as a reader would paste them."""

from __future__ import annotations

import pytest

from .docs_pages import run_page


def test_zarr_page(tmp_path, monkeypatch) -> None:
    pytest.importorskip("tensorstore")
    monkeypatch.chdir(tmp_path)
    run_page("zarr.md")


@pytest.mark.s3
def test_s3_page(tmp_path, monkeypatch) -> None:
    pytest.importorskip("s3fs")
    from tests.io.stores import moto_server

    for k in moto_server.UNSET:
        monkeypatch.delenv(k, raising=False)
    for k, v in moto_server.s3_env().items():
        monkeypatch.setenv(k, v)
    client = moto_server.boto_client()
    if any(b["Name"] == "my-checkpoints" for b in client.list_buckets().get("Buckets", [])):
        for obj in client.list_objects_v2(Bucket="my-checkpoints").get("Contents", []):
            client.delete_object(Bucket="my-checkpoints", Key=obj["Key"])
    else:
        client.create_bucket(Bucket="my-checkpoints")  # the page says: the bucket must exist
    monkeypatch.chdir(tmp_path)
    run_page("s3.md")
