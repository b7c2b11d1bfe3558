"""The lease that keeps two `appliance train` runs from writing one s3:// --output, on a real S3
API (a moto server on 127.0.0.1, which honours If-None-Match and If-Match as S3 does). The local
flock is tested in test_cli_errors."""

from __future__ import annotations

import logging
import threading
import time

import pytest
from click.testing import CliRunner

from appliance.cli.main import main
from appliance.errors import ConfigError, StorageError
from appliance.storage.output_lock import LOCK_FILE, S3Lease, holder_name, output_lock
from tests.helpers_model import make_model

pytest_plugins = ["tests.s3_server"]


class QuickLease(S3Lease):
    """The lease with its times cut to fractions of a second (the same rules)."""

    RENEW_S = 0.2
    STALE_S = 1.5
    POLL_S = 0.1


def lease_object(s3_client, bucket: str) -> tuple[str, str] | None:
    """The lease in `bucket`/o: (its body, its ETag), or None."""
    try:
        got = s3_client.get_object(Bucket=bucket, Key=f"o/{LOCK_FILE}")
    except s3_client.exceptions.NoSuchKey:
        return None
    return got["Body"].read().decode(), got["ETag"]


def wait_for(predicate, seconds: float = 10.0) -> bool:
    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def test_a_lease_is_taken_renewed_and_released(s3_bucket, s3_client):
    out = f"s3://{s3_bucket}/o"
    assert isinstance(output_lock(out), S3Lease)
    with QuickLease(out) as lease:
        body, etag = lease_object(s3_client, s3_bucket)
        assert body == f"{holder_name()}\nrenewal 0\n"
        assert wait_for(lambda: lease_object(s3_client, s3_bucket)[1] != etag)  # renewed
        assert lease_object(s3_client, s3_bucket)[0].endswith(f"renewal {lease.renewals}\n")
    assert lease_object(s3_client, s3_bucket) is None  # released
    with QuickLease(out):  # and taken again at once: no wait, no note
        pass


def test_a_second_run_is_refused_while_the_first_renews_its_lease(s3_bucket, s3_client):
    out = f"s3://{s3_bucket}/o"
    notes: list[str] = []
    with QuickLease(out) as first:
        with pytest.raises(ConfigError) as e:
            QuickLease(out, notes.append).__enter__()
        assert str(e.value) == (
            f"--output {out} is in use by another appliance train (pid {holder_name()}): wait "
            "for it to end, stop it (Ctrl-C checkpoints it, then --resume continues it), or "
            "choose another --output"
        )
        assert notes == [
            f"--output {out} holds another appliance train's lease: waiting up to 2 s to see "
            "whether that run is alive"
        ]
        assert not first.lost
        assert wait_for(lambda: lease_object(s3_client, s3_bucket)[1] == first.etag)
    assert lease_object(s3_client, s3_bucket) is None


def test_the_lease_of_a_run_that_died_is_taken_over(s3_bucket, s3_client):
    """A driver killed outright (kill -9, its node lost) leaves its lease, never renewed."""
    out = f"s3://{s3_bucket}/o"
    s3_client.put_object(Bucket=s3_bucket, Key=f"o/{LOCK_FILE}", Body=b"7 on gone\nrenewal 3\n")
    notes: list[str] = []
    with QuickLease(out, notes.append):
        assert lease_object(s3_client, s3_bucket)[0].startswith(f"{holder_name()}\n")
    assert notes[-1] == f"--output {out}: took over the lease of pid 7 on gone, not renewed for 2 s: that run is gone"  # fmt: skip


def test_a_lease_released_while_waiting_is_taken_without_a_takeover(s3_bucket, s3_client):
    out = f"s3://{s3_bucket}/o"
    key = f"o/{LOCK_FILE}"
    s3_client.put_object(Bucket=s3_bucket, Key=key, Body=b"7 on ending\nrenewal 0\n")

    class PatientLease(QuickLease):
        STALE_S = 30.0  # (the release comes long before)

    notes: list[str] = []
    threading.Timer(0.5, lambda: s3_client.delete_object(Bucket=s3_bucket, Key=key)).start()
    with PatientLease(out, notes.append):
        assert lease_object(s3_client, s3_bucket)[0].startswith(f"{holder_name()}\n")
    assert len(notes) == 1 and "waiting up to 30 s" in notes[0]  # and no "took over"


def test_a_holder_whose_lease_was_taken_over_says_so_and_leaves_it(s3_bucket, s3_client, caplog):
    """Its renewals were cut off past STALE_S and another run took the lease: the holder's
    next renewal finds another object there, logs that two runs write the output, and does
    not delete the other run's lease at its end."""
    out = f"s3://{s3_bucket}/o"
    key = f"o/{LOCK_FILE}"
    with caplog.at_level(logging.ERROR, logger="appliance.storage.output_lock"):
        with QuickLease(out) as lease:
            s3_client.put_object(Bucket=s3_bucket, Key=key, Body=b"8 on other\nrenewal 0\n")
            assert wait_for(lambda: lease.lost)
    assert f"the lease on --output {out} was taken over by another appliance train" in caplog.text
    assert lease_object(s3_client, s3_bucket)[0] == "8 on other\nrenewal 0\n"


def test_a_missing_bucket_is_named_not_waited_on(s3_endpoint):
    with pytest.raises(StorageError, match=r"no-such-bucket-for-leases"):
        QuickLease("s3://no-such-bucket-for-leases/o").__enter__()


def test_train_into_an_s3_output_another_run_holds_is_refused_before_ray(
    s3_bucket, s3_client, tmp_path, monkeypatch
):
    """The whole command: one error line naming the holder, and nothing of a run written (the
    lease is taken before Ray starts and before run.json)."""
    model = make_model(tmp_path / "model", "llama-mha")
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "a b c"}\n')
    out = f"s3://{s3_bucket}/o"
    monkeypatch.setattr(S3Lease, "STALE_S", 1.0)  # the command's lease; the holder renews
    monkeypatch.setattr(S3Lease, "POLL_S", 0.1)  # every 0.2 s (QuickLease)
    with QuickLease(out):
        result = CliRunner().invoke(
            main, ["train", "--model", str(model), "--data", str(data), "--output", out]
        )
        keys = [o["Key"] for o in s3_client.list_objects_v2(Bucket=s3_bucket)["Contents"]]
    assert result.exit_code == 1, result.output
    error = f"error: --output {out} is in use by another appliance train (pid {holder_name()})"
    assert error in result.output
    assert "starting Ray" not in result.output and "Traceback" not in result.output
    assert keys == [f"o/{LOCK_FILE}"]
