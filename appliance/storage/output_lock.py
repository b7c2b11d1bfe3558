"""One `appliance train` at a time per --output: a second one into the same output (a rerun typed
while the first still trains, a --resume from another shell, a RayJob retried while its first
driver lives on) is refused instead of writing the same checkpoints.

- A local output: an exclusive flock on `LOCK_FILE` in it (`OutputLock`). The kernel releases
  it when the process ends, however it ends, so a crashed or killed run never leaves it locked.
- An s3:// output: a lease, the object `OUTPUT/LOCK_FILE` (`S3Lease`). S3 has no lock, but it
  has conditional writes: the lease is created only where none exists (`If-None-Match: *`), and
  its holder renews it every `RENEW_S` by rewriting it only while it is still the object it
  wrote (`If-Match`), so each renewal changes its ETag. A driver that finds a lease watches it:
  renewed within `STALE_S`, its holder is alive and this run is refused, naming it; not renewed,
  its holder is gone (killed, its node lost) and the lease is taken over, again only if it is
  still that object. No clocks are compared: only whether the object changed.

`output_lock(output)` gives the one that fits. Taking either is the first thing `train` does to
an output, before Ray starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError, ConfigError
from appliance.storage import uri as storage
from appliance.storage.s3 import error_code, s3_client, s3_error
from appliance.storage.safe_open import NotARegularFile, open_regular

logger = logging.getLogger(__name__)

#: in an --output while a run writes it (local: flocked; S3: the lease object)
LOCK_FILE = ".appliance.lock"


def holder_name() -> str:
    """Who holds a lock: the pid and the host (in a container the pid alone, often 1, says
    little)."""
    return f"{os.getpid()} on {socket.gethostname()}"


def output_lock(output: str, note: Callable[[str], None] | None = None) -> Any:
    """The lock for `output`, as a context manager: an flock for a local directory, a lease for
    an s3:// prefix. `note` is told when taking an S3 lease means waiting."""
    return S3Lease(output, note) if storage.is_s3(output) else OutputLock(output)


class LeaseLost(ApplianceError):
    """The run's S3 lease was taken over: it stops writing its output and exits 1."""


def _in_use(output: str, holder: str) -> ConfigError:
    return ConfigError(
        f"--output {output} is in use by another appliance train (pid {holder}): wait for it to "
        "end, stop it (Ctrl-C checkpoints it, then --resume continues it), or choose another "
        "--output"
    )


class OutputLock:
    """The lock of a local --output: an exclusive flock on `LOCK_FILE` in it.

    Taking it creates the output directory, so an --output whose path runs through a file is
    refused here, before Ray starts. Releasing it deletes the lock file, and the directory too
    when the lock created it and nothing else was written there."""

    def __init__(self, output: str):
        self.dir = Path(output).expanduser().resolve()
        self.path = self.dir / LOCK_FILE
        self.fd: int | None = None
        self.created = False

    def __enter__(self) -> OutputLock:
        self.created = not self.dir.exists()
        while self.fd is None:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                fd = open_regular(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except NotARegularFile as e:  # a planted symlink: its target is never touched
                raise ConfigError(f"--output {self.dir}: {e}") from None
            except OSError as e:
                raise ConfigError(
                    f"--output {self.dir}: cannot create the run's directory there "
                    f"({e.strerror}: {e.filename}); choose a directory path you can write to"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 256).decode(errors="replace").strip() or "unknown"
                os.close(fd)
                raise _in_use(str(self.dir), holder) from None
            if self._still_the_lock_file(fd):
                self.fd = fd
            else:  # its holder deleted it as we opened it: take the file now at that path
                os.close(fd)
        os.ftruncate(self.fd, 0)
        os.write(self.fd, holder_name().encode())
        return self

    def _still_the_lock_file(self, fd: int) -> bool:
        try:
            return os.lstat(self.path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            return False

    def __exit__(self, *exc) -> None:
        if self.fd is None:
            return
        self.path.unlink(missing_ok=True)  # while still held: see _still_the_lock_file
        if self.created and not any(self.dir.iterdir()):
            self.dir.rmdir()
        os.close(self.fd)  # releases the flock
        self.fd = None


class S3Lease:
    """The lock of an s3:// --output: a lease object its holder renews (the module says how).

    A lease left by a driver that died is taken over once it has gone `STALE_S` without a
    renewal, so the run that follows (`--resume`, a RayJob's retry) waits that long at most. A
    holder whose renewal finds the lease taken over by another driver (its own renewals were
    cut off for longer than that) logs an error: two drivers then write one output, which is
    what the lease is for, so the message says so."""

    # (the environment variables: for tests, which cannot wait minutes for a lease)
    RENEW_S = float(os.environ.get("APPLIANCE_LEASE_RENEW_S", 10.0))  # how often it is rewritten
    STALE_S = float(os.environ.get("APPLIANCE_LEASE_STALE_S", 45.0))  # no live holder past this
    POLL_S = 2.0  # how often a driver waiting on a lease looks at it again

    def __init__(self, output: str, note: Callable[[str], None] | None = None):
        self.output = output
        self.bucket, self.key = storage.split_s3(storage.join(output, LOCK_FILE))
        self.note = note or (lambda line: None)
        self.etag: str | None = None
        self.renewals = 0
        self.lost = False
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    # ------------------------------------------------------------ S3 calls

    def _failed(self, e: Exception, action: str) -> Exception:
        return s3_error(e, f"s3://{self.bucket}/{self.key}", action)

    def _put(self, **condition: str) -> str | None:
        """Write the lease under `condition` (IfNoneMatch / IfMatch); its new ETag, or None when
        the condition failed (another driver's lease is there, or it changed)."""
        from botocore.exceptions import ClientError

        body = f"{holder_name()}\nrenewal {self.renewals}\n".encode()
        try:
            reply = s3_client().put_object(Bucket=self.bucket, Key=self.key, Body=body, **condition)
        except ClientError as e:
            # the lease there is another's, or changed; a concurrent conditional write; If-Match
            # on a lease deleted meanwhile
            if error_code(e) in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey"):
                return None
            raise self._failed(e, "writing the run's lease") from e
        except Exception as e:
            raise self._failed(e, "writing the run's lease") from e
        return str(reply["ETag"])

    def _look(self) -> tuple[str, str] | None:
        """The lease there now: (its holder, its ETag); None when there is none."""
        from botocore.exceptions import ClientError

        try:
            reply = s3_client().get_object(Bucket=self.bucket, Key=self.key)
        except ClientError as e:
            if error_code(e) == "NoSuchKey":
                return None
            raise self._failed(e, "reading the run's lease") from e
        except Exception as e:
            raise self._failed(e, "reading the run's lease") from e
        body = reply["Body"].read().decode(errors="replace")
        return (body.splitlines() or ["unknown"])[0], str(reply["ETag"])

    # ------------------------------------------------------------ taking and keeping it

    def __enter__(self) -> S3Lease:
        while self.etag is None:
            self.etag = self._put(IfNoneMatch="*")
            if self.etag is not None:
                break
            found = self._look()
            if found is None:  # released as we looked: create it again
                continue
            holder, etag = found
            seen = self._watch(etag)
            if seen == "renewed":
                raise _in_use(self.output, holder)
            if seen == "released":
                continue
            self.etag = self._put(IfMatch=etag)  # only if still the lease that was not renewed
            if self.etag is None:  # another driver took it over first, or it came back to life
                raise _in_use(self.output, (self._look() or ("unknown", ""))[0])
            self.note(
                f"--output {self.output}: took over the lease of pid {holder}, not renewed for "
                f"{self.STALE_S:.0f} s: that run is gone"
            )
        self._renewer = threading.Thread(target=self._renew, name="appliance-lease", daemon=True)
        self._renewer.start()
        return self

    def _watch(self, etag: str) -> str:
        """Watch the lease whose ETag is `etag` for up to STALE_S: "renewed" (its holder is
        alive), "released" (gone: its run ended) or "stale" (unchanged: its holder is gone)."""
        self.note(
            f"--output {self.output} holds another appliance train's lease: waiting up to "
            f"{self.STALE_S:.0f} s to see whether that run is alive"
        )
        deadline = time.monotonic() + self.STALE_S
        while time.monotonic() < deadline:
            time.sleep(self.POLL_S)
            found = self._look()
            if found is None:
                return "released"
            if found[1] != etag:
                return "renewed"
        return "stale"

    def _renew(self) -> None:
        """The renewer thread: rewrite the lease every RENEW_S while this run holds it."""
        while not self._stop.wait(self.RENEW_S):
            self.renewals += 1
            try:
                etag = self._put(IfMatch=str(self.etag))
            except Exception as e:  # noqa: BLE001 - S3 unreachable for a moment: try again
                logger.warning("could not renew the lease on --output %s: %s", self.output, e)
                continue
            if etag is None:
                self.lost = True
                logger.error(
                    "the lease on --output %s was taken over by another appliance train: its "
                    "renewals were cut off for over %.0f s, and two runs now write that output",
                    self.output,
                    self.STALE_S,
                )
                return
            self.etag = etag

    def check(self) -> None:
        """LeaseLost once another driver has taken this run's lease over: the run must stop
        writing its output (the step loop, checkpoints and run.json call this first)."""
        if self.lost:
            raise LeaseLost(
                f"--output {self.output}: this run's lease was taken over by another appliance "
                f"train (its renewals were cut off for over {self.STALE_S:.0f} s), so this run "
                "stopped writing there: no checkpoint, run.json or adapter from it since; the "
                "run that took it over writes that output now"
            )

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
        if self.etag is None or self.lost:
            return
        with contextlib.suppress(Exception):  # the run's outcome matters more than its lease
            found = self._look()
            if found is not None and found[1] == self.etag:  # still ours: release it
                s3_client().delete_object(Bucket=self.bucket, Key=self.key)
        self.etag = None
