"""A real S3-compatible server on loopback for the tests: moto's server, started in this process.

One server per test process, started on first use on 127.0.0.1 at a free port and stopped at exit;
tests isolate themselves by bucket. ``s3_env`` gives the AWS_* variables that point standard clients
(boto3, s3fs, ucl) at it, and keeps them away from any real AWS configuration on the machine.
"""

from __future__ import annotations

import atexit
import logging
import threading
import uuid

_lock = threading.Lock()
_server: object = None
_endpoint: str | None = None


def endpoint() -> str:
    """The server's URL (``http://127.0.0.1:<port>``), starting it if needed."""
    global _server, _endpoint
    with _lock:
        if _endpoint is None:
            from moto.server import ThreadedMotoServer

            logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no line per request
            server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
            server.start()
            host, port = server.get_host_and_port()
            _server, _endpoint = server, f"http://{host}:{port}"
            atexit.register(server.stop)
        return _endpoint


def s3_env() -> dict[str, str]:
    """AWS_* variables for the loopback server (credentials are moto's dummies)."""
    return {
        "AWS_ENDPOINT_URL": endpoint(),
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": "/nonexistent/ucl-test-aws-config",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent/ucl-test-aws-credentials",
    }


UNSET = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3", "AWS_REGION")


def storage_options() -> dict[str, object]:
    """The same configuration as fsspec storage_options, for clients given no environment."""
    return {
        "endpoint_url": endpoint(),
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }


def new_bucket(prefix: str = "ucl") -> str:
    """Create a bucket with a fresh name (through boto3, not the code under test) and return it."""
    import boto3

    name = f"{prefix}-{uuid.uuid4().hex[:12]}"
    boto3.client(
        "s3",
        endpoint_url=endpoint(),
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    ).create_bucket(Bucket=name)
    return name


def boto_client():  # noqa: ANN201
    import boto3

    return boto3.client(
        "s3",
        endpoint_url=endpoint(),
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
        region_name="us-east-1",
    )
