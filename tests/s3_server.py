"""Pytest fixtures for a real S3 API: a moto server on 127.0.0.1 (never another interface).

Use from a test module with ``pytest_plugins = ["tests.s3_server"]`` (run pytest as
``python -m pytest`` from the repo root so ``tests`` is importable), then:

- ``s3_endpoint``: the server URL; sets AWS_ENDPOINT_URL and fake credentials (``testing``) and
  region ``us-east-1`` for the test, so ``appliance.storage.uri`` and plain boto3 both talk to it.
- ``s3_bucket``: the name of a fresh, empty bucket (unique per test).
- ``s3_client``: a boto3 S3 client for the server, for arranging and asserting.
- ``enforce_iam(endpoint)``: a context manager under which moto checks IAM permissions (real
  AccessDenied answers for IAM users created on the server).

One server serves the whole session (it starts in ~0.1 s); tests stay apart by bucket name.
"""

from __future__ import annotations

import logging
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

FAKE_KEY_ID = "testing"
FAKE_SECRET = "testing"
REGION = "us-east-1"


@pytest.fixture(scope="session")
def moto_server_url() -> Iterator[str]:
    """Start moto's threaded server on 127.0.0.1 on a free port for the session."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def s3_endpoint(moto_server_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The moto server URL, with the AWS environment pointed at it for this test."""
    for name in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_SECURITY_TOKEN",
        "AWS_ENDPOINT_URL_S3",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
        "AWS_ROLE_ARN",
    ):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_server_url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", FAKE_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance-metadata probing
    yield moto_server_url


def make_client(endpoint: str) -> Any:
    """A boto3 S3 client for ``endpoint`` with the fake credentials."""
    import boto3

    return boto3.session.Session().client(
        "s3",
        endpoint_url=endpoint,
        aws_access_key_id=FAKE_KEY_ID,
        aws_secret_access_key=FAKE_SECRET,
        region_name=REGION,
    )


@pytest.fixture
def s3_client(s3_endpoint: str) -> Any:
    """A boto3 S3 client talking to the moto server."""
    return make_client(s3_endpoint)


@pytest.fixture
def s3_bucket(s3_client: Any) -> str:
    """Name of a fresh, empty bucket on the moto server (``s3://<name>/...``)."""
    name = f"test-{uuid.uuid4().hex[:16]}"
    s3_client.create_bucket(Bucket=name)
    return name


def _reset_auth(endpoint: str, count: str) -> None:
    req = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth",
        data=count.encode(),
        method="POST",
        headers={"Content-Type": "text/plain"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


@contextmanager
def enforce_iam(endpoint: str) -> Iterator[None]:
    """Make moto authenticate and authorize every request (IAM policies, real signatures) until
    the block exits. Create IAM users, keys and policies before entering."""
    _reset_auth(endpoint, "0")
    try:
        yield
    finally:
        _reset_auth(endpoint, "inf")
