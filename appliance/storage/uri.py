"""One small interface for local paths and ``s3://bucket/prefix`` URIs.

Used for ``--model``, ``--data`` and ``--output``. Every function takes a URI string: either an
``s3://bucket/key`` or a local path (``~`` is expanded, a ``file://`` prefix is accepted). All
failures raise :class:`StorageError`, whose message names the URI and says what to do.

S3 goes through boto3 with the standard credential chain (env vars, ``AWS_PROFILE``, instance or
IRSA role), adaptive retries with backoff on throttling and 5xx, and ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) for S3-compatible stores such as MinIO or moto. Tunables, read from the
environment when a client or transfer is made:

- ``APPLIANCE_S3_MAX_ATTEMPTS`` (default 10): retries per request after the first attempt
  (botocore's ``max_attempts``).
- ``APPLIANCE_S3_MULTIPART_THRESHOLD`` / ``APPLIANCE_S3_MULTIPART_CHUNKSIZE`` (default 64 MiB):
  files at least this big are uploaded/downloaded in parts of this size, in parallel.
- ``APPLIANCE_S3_CACHE`` (default ``~/.cache/appliance/s3``): where ``localize.localize`` puts
  downloads.
"""

from __future__ import annotations

import codecs
import io
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import ACCESS_DENIED, INVALID, NOT_FOUND, OTHER, StorageError
from appliance.storage.s3 import S3_SCHEME, error_code, s3_client, s3_error, transfer_config

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# URIs


def is_s3(uri: str | os.PathLike[str]) -> bool:
    """True for ``s3://...`` URIs."""
    return str(uri).startswith(S3_SCHEME)


def split_s3(uri: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` -> ``("bucket", "a/b")``; the key may be empty."""
    if not is_s3(uri):
        raise StorageError(f"not an s3:// URI: {uri!r}", uri, INVALID)
    bucket, _, key = uri[len(S3_SCHEME) :].partition("/")
    if not bucket:
        raise StorageError(f"no bucket in {uri!r}: write it as s3://BUCKET/PREFIX", uri, INVALID)
    return bucket, key


def join(uri: str | os.PathLike[str], *parts: str) -> str:
    """Join path parts onto a URI: ``join("s3://b/run", "ckpt", "x")`` -> ``"s3://b/run/ckpt/x"``.

    S3 parts are joined with ``/`` (redundant slashes dropped); local ones with ``os.path.join``.
    """
    uri = str(uri)
    if not is_s3(uri):
        return os.path.join(uri, *parts)
    out = uri.rstrip("/")
    for part in parts:
        part = part.strip("/")
        if part:
            out = f"{out}/{part}"
    return out


def to_local(uri: str | os.PathLike[str]) -> Path:
    s = str(uri)
    if s.startswith("file://"):
        s = s[len("file://") :]
    return Path(s).expanduser()


def _local_error(exc: OSError, uri: str, action: str) -> StorageError:
    if isinstance(exc, FileNotFoundError):
        return StorageError(
            f"no such file or directory: {uri} (while {action}): check the path", uri, NOT_FOUND
        )
    if isinstance(exc, PermissionError):
        return StorageError(
            f"permission denied while {action} {uri}: fix the file permissions or choose "
            "another path",
            uri,
            ACCESS_DENIED,
        )
    if isinstance(exc, IsADirectoryError):
        return StorageError(f"{uri} is a directory, expected a file", uri, INVALID)
    return StorageError(f"failed {action} {uri}: {exc}", uri, OTHER)


# --------------------------------------------------------------------------------------------
# Operations


@dataclass(frozen=True)
class ObjectInfo:
    """One file under a prefix: ``name`` relative to it (``/``-separated), ``size`` in bytes,
    ``etag`` (S3 ETag without quotes; empty for local files)."""

    name: str
    size: int
    etag: str = ""


def _s3_prefix(key: str) -> str:
    return key.rstrip("/") + "/" if key.strip("/") else ""


def _s3_list(uri: str) -> list[ObjectInfo]:
    bucket, key = split_s3(uri)
    prefix = _s3_prefix(key)
    out: list[ObjectInfo] = []
    try:
        paginator = s3_client().get_paginator("list_objects_v2")
        for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
            for obj in page.get("Contents", []):
                name = obj["Key"][len(prefix) :]
                if name and not name.endswith("/"):  # skip console "folder" markers
                    out.append(ObjectInfo(name, int(obj["Size"]), obj["ETag"].strip('"')))
    except Exception as e:
        raise s3_error(e, uri, "listing") from e
    return sorted(out, key=lambda o: o.name)


def list_objects(uri_prefix: str) -> list[ObjectInfo]:
    """Every file under a directory/prefix, recursively, sorted by relative name, with sizes.

    A missing local directory or an empty S3 prefix gives ``[]``; a missing bucket raises.
    """
    if is_s3(uri_prefix):
        return _s3_list(uri_prefix)
    root = to_local(uri_prefix)
    if not root.exists():
        return []
    if not root.is_dir():
        raise StorageError(f"{uri_prefix} is a file, expected a directory", uri_prefix, INVALID)
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for fname in files:
            p = Path(dirpath, fname)
            try:
                out.append(ObjectInfo(p.relative_to(root).as_posix(), p.stat().st_size))
            except FileNotFoundError:  # removed while walking
                continue
    return sorted(out, key=lambda o: o.name)


def list_files(uri_prefix: str) -> list[str]:
    """Relative names (``/``-separated) of every file under a directory/prefix, sorted."""
    return [o.name for o in list_objects(uri_prefix)]


def exists(uri: str) -> bool:
    """Whether a file exists, or a directory/prefix with at least one file under it (S3).

    A missing bucket raises StorageError rather than answering False: it is a configuration
    error, not an absent file.
    """
    if not is_s3(uri):
        return to_local(uri).exists()
    from botocore.exceptions import ClientError

    bucket, key = split_s3(uri)
    if key and not key.endswith("/"):
        try:
            s3_client().head_object(Bucket=bucket, Key=key)
            return True
        except ClientError as e:
            if error_code(e) not in ("404", "NoSuchKey"):
                raise s3_error(e, uri, "checking") from e
        except Exception as e:
            raise s3_error(e, uri, "checking") from e
    try:
        resp = s3_client().list_objects_v2(Bucket=bucket, Prefix=_s3_prefix(key), MaxKeys=1)
    except Exception as e:
        raise s3_error(e, uri, "checking") from e
    return bool(resp.get("KeyCount") or resp.get("Contents"))


def read_bytes(uri: str) -> bytes:
    """The whole content of one file."""
    if not is_s3(uri):
        try:
            return to_local(uri).read_bytes()
        except OSError as e:
            raise _local_error(e, uri, "reading") from e
    bucket, key = split_s3(uri)
    try:
        return s3_client().get_object(Bucket=bucket, Key=key)["Body"].read()
    except Exception as e:
        raise s3_error(e, uri, "reading") from e


_umask_lock = threading.Lock()


def file_mode() -> int:
    """The mode `open()` would give a new file: 0o666 less the process umask (read by setting it
    and putting it back, the only way; the lock keeps two threads from racing on it)."""
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
    return 0o666 & ~mask


def atomic_local_write(path: Path, write: Any, uri: str) -> None:
    """Write via ``write(fileobj)`` to a temp file next to ``path``, fsync, then rename over it."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, file_mode())  # mkstemp makes 0600; the file is the user's, like any other
    except OSError as e:
        raise _local_error(e, uri, "writing") from e
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise _local_error(e, uri, "writing") from e
        raise


def write_bytes(uri: str, data: bytes) -> None:
    """Write one file. Local writes are atomic (temp file in the same dir, then ``os.replace``);
    S3 PUTs are atomic by nature (large payloads go multipart)."""
    if not is_s3(uri):
        atomic_local_write(to_local(uri), lambda f: f.write(data), uri)
        return
    bucket, key = split_s3(uri)
    try:
        s3_client().upload_fileobj(io.BytesIO(data), bucket, key, Config=transfer_config())
    except Exception as e:
        raise s3_error(e, uri, "writing") from e


def write_chunks(uri: str, chunks: Iterable[bytes | memoryview]) -> None:
    """Write one file from `chunks` (byte strings or flat byte memoryviews), each written as it
    comes, so the whole file is never in memory: atomic as ``write_bytes`` (S3: a multipart
    upload reads the chunks a part at a time)."""
    if not is_s3(uri):

        def write(f: Any) -> None:
            for chunk in chunks:
                f.write(chunk)

        atomic_local_write(to_local(uri), write, uri)
        return
    bucket, key = split_s3(uri)
    try:
        s3_client().upload_fileobj(ChunkReader(chunks), bucket, key, Config=transfer_config())
    except Exception as e:
        raise s3_error(e, uri, "writing") from e


class ChunkReader(io.RawIOBase):
    """A read-only file over an iterable of byte chunks (what boto3's upload reads from). A
    read returns all it asks for until the end: a multipart upload's parts but the last must
    be full (S3 refuses parts under 5 MiB)."""

    def __init__(self, chunks: Iterable[bytes | memoryview]):
        self._chunks = iter(chunks)
        self._view = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        out, n = memoryview(b).cast("B"), 0
        while n < len(out):
            if not self._view:
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._view = memoryview(chunk).cast("B")
                continue
            k = min(len(out) - n, len(self._view))
            out[n : n + k] = self._view[:k]
            self._view = self._view[k:]
            n += k
        return n


def upload_file(
    local_path: str | os.PathLike[str],
    uri: str,
    *,
    multipart_threshold: int | None = None,
    multipart_chunksize: int | None = None,
) -> None:
    """Copy a local file to ``uri`` (S3: multipart at or above the threshold; local: atomic
    copy)."""
    src = Path(local_path)
    if not src.is_file():
        raise StorageError(f"cannot upload {src}: no such file", str(src), NOT_FOUND)
    if not is_s3(uri):

        def copy(f: Any) -> None:
            with open(src, "rb") as s:
                shutil.copyfileobj(s, f, 16 * 1024 * 1024)

        atomic_local_write(to_local(uri), copy, uri)
        return
    bucket, key = split_s3(uri)
    config = transfer_config(multipart_threshold, multipart_chunksize)
    try:
        s3_client().upload_file(str(src), bucket, key, Config=config)
    except Exception as e:
        raise s3_error(e, uri, "uploading to") from e


def download_file(
    uri: str,
    local_path: str | os.PathLike[str],
    *,
    multipart_threshold: int | None = None,
    multipart_chunksize: int | None = None,
) -> None:
    """Copy one file from ``uri`` to ``local_path``; the destination appears complete or not at
    all (downloaded to a temp file next to it, then renamed)."""
    dest = Path(local_path).expanduser()
    if not is_s3(uri):
        src = to_local(uri)
        if not src.is_file():
            raise StorageError(f"no such file: {uri}: check the path", uri, NOT_FOUND)

        def copy(f: Any) -> None:
            with open(src, "rb") as s:
                shutil.copyfileobj(s, f, 16 * 1024 * 1024)

        atomic_local_write(dest, copy, str(dest))
        return
    bucket, key = split_s3(uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.", suffix=".part")
    os.fchmod(fd, file_mode())
    os.close(fd)
    config = transfer_config(multipart_threshold, multipart_chunksize)
    try:
        s3_client().download_file(bucket, key, tmp, Config=config)
        os.replace(tmp, dest)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, Exception):
            raise s3_error(e, uri, "downloading") from e
        raise


def delete(uri: str) -> None:
    """Delete one file; deleting a missing file is not an error."""
    if not is_s3(uri):
        try:
            to_local(uri).unlink(missing_ok=True)
        except OSError as e:
            raise _local_error(e, uri, "deleting") from e
        return
    bucket, key = split_s3(uri)
    try:
        s3_client().delete_object(Bucket=bucket, Key=key)
    except Exception as e:
        raise s3_error(e, uri, "deleting") from e


def delete_prefix(uri: str) -> None:
    """Delete a directory/prefix and everything under it; a missing one is not an error."""
    if not is_s3(uri):
        path = to_local(uri)
        try:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)
        except OSError as e:
            raise _local_error(e, uri, "deleting") from e
        return
    bucket, key = split_s3(uri)
    if not key.strip("/"):
        raise StorageError(
            f"refusing to delete a whole bucket ({uri}): give a prefix", uri, INVALID
        )
    prefix = _s3_prefix(key)
    keys = [prefix + o.name for o in _s3_list(uri)]
    client = s3_client()
    try:
        for i in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
            batch = [{"Key": k} for k in keys[i : i + 1000]]
            resp = client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
            errors = resp.get("Errors") or []
            if errors:
                first = errors[0]
                raise StorageError(
                    f"could not delete {len(errors)} objects under {uri}, e.g. "
                    f"s3://{bucket}/{first.get('Key')}: {first.get('Code')} {first.get('Message')}",
                    uri,
                    ACCESS_DENIED if first.get("Code") == "AccessDenied" else OTHER,
                )
    except StorageError:
        raise
    except Exception as e:
        raise s3_error(e, uri, "deleting") from e


def size(uri: str) -> int:
    """Size of one file in bytes."""
    if not is_s3(uri):
        try:
            path = to_local(uri)
            if path.is_dir():
                raise IsADirectoryError(str(path))
            return path.stat().st_size
        except OSError as e:
            raise _local_error(e, uri, "reading the size of") from e
    bucket, key = split_s3(uri)
    try:
        return int(s3_client().head_object(Bucket=bucket, Key=key)["ContentLength"])
    except Exception as e:
        raise s3_error(e, uri, "reading the size of") from e


def open_text_lines(uri: str, encoding: str = "utf-8", chunk_bytes: int = 1 << 20) -> Iterator[str]:
    """Stream a text file line by line (without line endings), never holding it all in memory.

    Opening happens now, so a missing file raises StorageError here rather than at the first
    ``next()``.
    """
    if not is_s3(uri):
        try:
            f = open(to_local(uri), encoding=encoding, newline=None)
        except OSError as e:
            raise _local_error(e, uri, "opening") from e
        return _local_lines(f, uri)
    bucket, key = split_s3(uri)
    try:
        body = s3_client().get_object(Bucket=bucket, Key=key)["Body"]
    except Exception as e:
        raise s3_error(e, uri, "opening") from e
    return _s3_lines(body, uri, encoding, chunk_bytes)


def _local_lines(f: io.TextIOWrapper, uri: str) -> Iterator[str]:
    with f:
        try:
            for line in f:
                yield line.rstrip("\n")
        except OSError as e:
            raise _local_error(e, uri, "reading") from e


def _s3_lines(body: Any, uri: str, encoding: str, chunk_bytes: int) -> Iterator[str]:
    decoder = codecs.getincrementaldecoder(encoding)()
    pending = ""
    try:
        for chunk in body.iter_chunks(chunk_bytes):
            pending += decoder.decode(chunk)
            lines = pending.split("\n")
            pending = lines.pop()
            for line in lines:
                yield line.removesuffix("\r")
        pending += decoder.decode(b"", final=True)
    except Exception as e:
        raise s3_error(e, uri, "reading") from e
    finally:
        body.close()
    if pending:
        yield pending.removesuffix("\r")
