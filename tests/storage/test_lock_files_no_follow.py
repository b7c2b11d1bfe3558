"""Lock and marker files are opened without following links and must be regular files (issue
44, item 3): a symlink planted at OUTPUT/.appliance.lock destroyed its target."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from appliance.errors import ConfigError, StorageError
from appliance.metrics import endpoint
from appliance.storage.localize import _prefix_lock
from appliance.storage.output_lock import LOCK_FILE, OutputLock
from appliance.storage.safe_open import NotARegularFile, open_regular


@pytest.fixture
def precious(tmp_path) -> Path:
    target = tmp_path / "precious.txt"
    target.write_text("the user's work")
    return target


def test_a_symlinked_output_lock_is_refused_and_its_target_untouched(tmp_path, precious):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(precious)
    with pytest.raises(ConfigError) as e:
        with OutputLock(str(out)):
            pass
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert f"{out / LOCK_FILE} is a symbolic link" in message and "remove it" in message
    assert precious.read_text() == "the user's work"
    assert (out / LOCK_FILE).is_symlink()  # not removed either: the user decides


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_an_output_lock_that_is_not_a_regular_file_is_refused(tmp_path, kind):
    out = tmp_path / "out"
    out.mkdir()
    if kind == "fifo":
        os.mkfifo(out / LOCK_FILE)
    else:
        (out / LOCK_FILE).mkdir()
    with pytest.raises(ConfigError, match=f"{LOCK_FILE} is (not a regular file|a directory)"):
        with OutputLock(str(out)):
            pass


def test_a_symlinked_s3_cache_lock_is_refused_and_its_target_untouched(tmp_path, precious):
    index = tmp_path / "cache" / "index.json"
    index.parent.mkdir()
    (index.parent / f".{index.name}.lock").symlink_to(precious)
    with pytest.raises(StorageError, match="is a symbolic link"):
        with _prefix_lock(index):
            pass
    assert precious.read_text() == "the user's work"


def test_a_metrics_port_lock_planted_as_a_symlink_is_not_followed(tmp_path, precious):
    port = 65000 + os.getpid() % 500
    planted = Path(tempfile.gettempdir()) / f"appliance-metrics-port-{port}.lock"
    planted.unlink(missing_ok=True)
    planted.symlink_to(precious)
    try:
        assert endpoint._claim(port) is False  # the port is passed over, the link not followed
    finally:
        planted.unlink()
    assert precious.read_text() == "the user's work"


def test_open_regular_opens_and_creates_a_regular_file(tmp_path):
    fd = open_regular(tmp_path / "m", os.O_RDWR | os.O_CREAT)
    try:
        os.write(fd, b"ok")
    finally:
        os.close(fd)
    assert (tmp_path / "m").read_bytes() == b"ok"
    (tmp_path / "link").symlink_to(tmp_path / "m")
    with pytest.raises(NotARegularFile):
        open_regular(tmp_path / "link", os.O_RDONLY)
