"""S3 throttling and server errors are retried with backoff: a real moto server behind a proxy on
127.0.0.1 that answers some requests with 503 SlowDown / 500 InternalError, as S3 does under load.

The proxy forwards everything else to moto unchanged, so what succeeds is the real S3 protocol.
"""

from __future__ import annotations

import http.client
import threading
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from appliance.errors import StorageError
from appliance.storage import uri as storage

pytest_plugins = ["tests.s3_server"]

SLOW_DOWN = (
    503,
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>",
)
INTERNAL = (
    500,
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
    b"<Message>We encountered an internal error. Please try again.</Message></Error>",
)


class FlakyProxy:
    """An HTTP proxy to `upstream` that fails a request when `fail(method, path, n)` returns an
    error (n: how many times this method+path was seen before). Counts what it did."""

    def __init__(self, upstream: str, fail: Callable[[str, str, int], tuple | None]):
        self.upstream = urllib.parse.urlsplit(upstream)
        self.fail = fail
        self.seen: Counter[tuple[str, str]] = Counter()
        self.injected = 0
        self.forwarded = 0
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:  # quiet
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        chunk = self.rfile.read(size)
                        self.rfile.readline()  # CRLF after each chunk
                        if size == 0:
                            break
                        chunks.append(chunk)
                    return b"".join(chunks)
                return self.rfile.read(int(self.headers.get("Content-Length") or 0))

            def _handle(self) -> None:
                body = self._body()
                path = urllib.parse.urlsplit(self.path).path
                with proxy._lock:
                    n = proxy.seen[(self.command, path)]
                    proxy.seen[(self.command, path)] += 1
                    error = proxy.fail(self.command, path, n)
                    if error is not None:
                        proxy.injected += 1
                    else:
                        proxy.forwarded += 1
                if error is not None:
                    status, payload = error
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                up = http.client.HTTPConnection(
                    proxy.upstream.hostname, proxy.upstream.port, timeout=30
                )
                headers = {
                    k: v
                    for k, v in self.headers.items()
                    if k.lower() not in ("transfer-encoding", "connection", "content-length")
                }
                headers["Content-Length"] = str(len(body))
                up.request(self.command, self.path, body=body, headers=headers)
                resp = up.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                up.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def flaky(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[Callable[[str, str, int], tuple | None]], FlakyProxy]]:
    """Point AWS_ENDPOINT_URL at a FlakyProxy in front of the moto server."""
    proxies: list[FlakyProxy] = []

    def start(fail: Callable[[str, str, int], tuple | None]) -> FlakyProxy:
        proxy = FlakyProxy(s3_endpoint, fail)
        proxies.append(proxy)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.url)
        return proxy

    yield start
    for p in proxies:
        p.close()


def test_throttled_and_failing_requests_are_retried_until_they_succeed(
    flaky, s3_bucket: str, tmp_path: Path
) -> None:
    # every object request fails twice (503 SlowDown, then 500) before the real answer
    def fail(method: str, path: str, n: int) -> tuple | None:
        if path.startswith(f"/{s3_bucket}/data/") and n < 2:
            return SLOW_DOWN if n == 0 else INTERNAL
        return None

    proxy = flaky(fail)
    uri = f"s3://{s3_bucket}/data/shard-0.jsonl"
    payload = b'{"text": "the cat sat"}\n' * 1000
    storage.write_bytes(uri, payload)
    assert storage.read_bytes(uri) == payload
    local = tmp_path / "copy.jsonl"
    storage.download_file(uri, local)
    assert local.read_bytes() == payload
    # every request was failed twice first, and each still reached moto in the end
    assert proxy.injected >= 2 * 2
    assert proxy.forwarded >= 2


def test_a_server_that_keeps_failing_ends_in_an_error_naming_the_uri(
    flaky, s3_bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APPLIANCE_S3_MAX_ATTEMPTS", "2")  # 2 retries: 3 attempts in all
    proxy = flaky(lambda method, path, n: INTERNAL if "/always-down/" in path else None)
    uri = f"s3://{s3_bucket}/always-down/adapter_model.safetensors"
    with pytest.raises(StorageError, match="InternalError") as err:
        storage.write_bytes(uri, b"weights")
    assert uri in str(err.value)
    assert proxy.seen[("PUT", f"/{s3_bucket}/always-down/adapter_model.safetensors")] == 3
