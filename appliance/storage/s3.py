"""S3 for storage/uri.py: the boto3 client and what its failures mean.

`s3_client()` is cached per endpoint and credentials (boto3 clients are thread-safe), retries
adaptively (`APPLIANCE_S3_MAX_ATTEMPTS`), and honours `AWS_ENDPOINT_URL_S3`/`AWS_ENDPOINT_URL`
(MinIO, moto). `transfer_config()` sets multipart sizes (`APPLIANCE_S3_MULTIPART_THRESHOLD`,
`APPLIANCE_S3_MULTIPART_CHUNKSIZE`). `s3_error()` turns a botocore failure into a StorageError
that names the URI, what went wrong and the fix. boto3 is imported on first use.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from appliance.errors import (
    ACCESS_DENIED,
    INVALID,
    NO_BUCKET,
    NO_CREDENTIALS,
    NOT_FOUND,
    OTHER,
    StorageError,
)

S3_SCHEME = "s3://"
DEFAULT_MAX_ATTEMPTS = 10
DEFAULT_MULTIPART_BYTES = 64 * 1024 * 1024


_client_lock = threading.Lock()
_clients: dict[tuple[str | None, ...], Any] = {}


def endpoint_url() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise StorageError(f"{name}={raw!r} is not an integer", None, INVALID) from None


def s3_client() -> Any:
    """A boto3 S3 client for the current environment (cached; boto3 clients are thread-safe).

    Retries: ``mode="adaptive"`` (exponential backoff plus client-side rate limiting on
    throttling and 5xx), ``APPLIANCE_S3_MAX_ATTEMPTS`` retries. The endpoint comes from
    ``AWS_ENDPOINT_URL_S3`` / ``AWS_ENDPOINT_URL`` when set, passed explicitly so that older
    botocore versions honour it too.
    """
    env = os.environ
    max_attempts = env_int("APPLIANCE_S3_MAX_ATTEMPTS", DEFAULT_MAX_ATTEMPTS)
    endpoint = endpoint_url()
    key = (
        endpoint,
        str(max_attempts),
        env.get("AWS_ACCESS_KEY_ID"),
        env.get("AWS_SECRET_ACCESS_KEY"),
        env.get("AWS_SESSION_TOKEN"),
        env.get("AWS_PROFILE"),
        env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
    )
    with _client_lock:
        client = _clients.get(key)
        if client is None:
            import boto3
            from botocore.config import Config

            config = Config(
                retries={"max_attempts": max_attempts, "mode": "adaptive"},
                connect_timeout=10,
                read_timeout=60,
            )
            # A fresh Session per client: the default session is not thread-safe to create.
            client = boto3.session.Session().client("s3", endpoint_url=endpoint, config=config)
            if len(_clients) >= 8:
                _clients.clear()
            _clients[key] = client
        return client


def transfer_config(
    multipart_threshold: int | None = None, multipart_chunksize: int | None = None
) -> Any:
    """``boto3.s3.transfer.TransferConfig`` for uploads/downloads: multipart at or above
    ``multipart_threshold`` bytes, parts of ``multipart_chunksize`` bytes (S3's minimum part is
    5 MiB), 8 parts in flight."""
    from boto3.s3.transfer import TransferConfig

    threshold = multipart_threshold or env_int(
        "APPLIANCE_S3_MULTIPART_THRESHOLD", DEFAULT_MULTIPART_BYTES
    )
    chunksize = multipart_chunksize or env_int(
        "APPLIANCE_S3_MULTIPART_CHUNKSIZE", max(threshold, 5 * 1024 * 1024)
    )
    return TransferConfig(
        multipart_threshold=threshold, multipart_chunksize=chunksize, max_concurrency=8
    )


def _botocore_error(exc: BaseException) -> BaseException:
    """The botocore error behind ``exc`` (boto3's transfer layer wraps them)."""
    from botocore.exceptions import BotoCoreError, ClientError

    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, (ClientError, BotoCoreError)):
            return seen
        seen = seen.__cause__ or seen.__context__
    return exc


def error_code(e: Any) -> str:
    """A botocore ClientError's S3 error code; where a service answers without one, HTTP 412 and
    409 (what conditional writes answer) stand for theirs, else ""."""
    code = str(e.response.get("Error", {}).get("Code", "") or "")
    status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return code or {412: "PreconditionFailed", 409: "ConditionalRequestConflict"}.get(status, "")


def _bucket_exists(bucket: str) -> bool | None:
    """True/False when S3 says so; None when it cannot tell (e.g. no permission)."""
    from botocore.exceptions import ClientError

    try:
        s3_client().head_bucket(Bucket=bucket)
        return True
    except ClientError as e:
        if error_code(e) in ("404", "NoSuchBucket", "NotFound"):
            return False
        return None
    except Exception:
        return None


def s3_error(exc: BaseException, uri: str, action: str) -> StorageError:
    """Turn a boto3/botocore failure into a StorageError that names the URI and the fix."""
    from botocore.exceptions import (
        ClientError,
        EndpointConnectionError,
        NoCredentialsError,
        PartialCredentialsError,
    )

    err = _botocore_error(exc)
    bucket, _, key = uri[len(S3_SCHEME) :].partition("/")
    if isinstance(err, (NoCredentialsError, PartialCredentialsError)):
        return StorageError(
            f"no AWS credentials found while {action} {uri}: set AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE, or run where an instance/IRSA role is "
            "attached",
            uri,
            NO_CREDENTIALS,
        )
    if isinstance(err, EndpointConnectionError):
        return StorageError(
            f"cannot reach the S3 endpoint while {action} {uri} ({err}): check the network "
            f"and AWS_ENDPOINT_URL (now {endpoint_url() or 'unset'})",
            uri,
            OTHER,
        )
    if not isinstance(err, ClientError):
        return StorageError(f"S3 failure while {action} {uri}: {err}", uri, OTHER)

    code = error_code(err)
    message = err.response.get("Error", {}).get("Message") or ""
    if code in ("NoSuchKey", "404", "NotFound") and _bucket_exists(bucket) is False:
        code = "NoSuchBucket"  # HEAD requests cannot say which one was missing
    if code == "NoSuchBucket":
        return StorageError(
            f"bucket '{bucket}' does not exist ({uri}): create it or fix the URI",
            uri,
            NO_BUCKET,
        )
    if code in ("NoSuchKey", "404", "NotFound"):
        return StorageError(
            f"no such object {uri} (while {action}): check the path, e.g. "
            f"`aws s3 ls {S3_SCHEME}{bucket}/{key.rsplit('/', 1)[0] + '/' if '/' in key else ''}`",
            uri,
            NOT_FOUND,
        )
    if code in ("AccessDenied", "403", "Forbidden", "AllAccessDisabled"):
        return StorageError(
            f"access denied while {action} {uri}: the credentials in use lack permission on "
            f"arn:aws:s3:::{bucket}/{key}; grant it (bucket policy or IAM role) or use other "
            "credentials (AWS_PROFILE / AWS_ACCESS_KEY_ID)",
            uri,
            ACCESS_DENIED,
        )
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
        return StorageError(
            f"S3 rejected the credentials while {action} {uri} ({code}): check "
            "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_SESSION_TOKEN or AWS_PROFILE",
            uri,
            NO_CREDENTIALS,
        )
    return StorageError(f"S3 error {code} while {action} {uri}: {message}", uri, OTHER)
