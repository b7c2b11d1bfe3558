"""appliance.storage.uri and appliance.storage.localize against local disk and a real S3 API (moto server on
127.0.0.1)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from appliance import errors
from appliance.errors import StorageError
from appliance.storage import localize as s3_cache
from appliance.storage import s3
from appliance.storage import uri as storage

pytest_plugins = ["tests.s3_server"]

MiB = 1024 * 1024


@pytest.fixture(params=["local", "s3"])
def base_uri(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A writable directory URI: a local temp dir or a prefix in a fresh moto bucket."""
    if request.param == "local":
        return str(tmp_path / "store")
    bucket = request.getfixturevalue("s3_bucket")
    return f"s3://{bucket}/store"


# ---------------------------------------------------------------------------------- URIs


def test_is_s3_and_join() -> None:
    assert storage.is_s3("s3://b/k")
    assert not storage.is_s3("/tmp/x")
    assert not storage.is_s3(Path("s3:/b"))
    assert (
        storage.join("s3://b/run/", "/ckpt/", "step-1", "a.bin") == "s3://b/run/ckpt/step-1/a.bin"
    )
    assert storage.join("s3://b", "x") == "s3://b/x"
    assert storage.join("/tmp/run", "ckpt", "a.bin") == os.path.join("/tmp/run", "ckpt", "a.bin")
    assert storage.split_s3("s3://bucket/a/b") == ("bucket", "a/b")
    assert storage.split_s3("s3://bucket") == ("bucket", "")
    with pytest.raises(StorageError, match="no bucket"):
        storage.split_s3("s3:///key")


def test_storage_error_pickles() -> None:
    err = StorageError("bucket 'x' does not exist", "s3://x/y", errors.NO_BUCKET)
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is StorageError
    assert str(back) == str(err)
    assert (back.uri, back.kind) == ("s3://x/y", errors.NO_BUCKET)


# ---------------------------------------------------------------------------------- round trips


def test_round_trip_list_size_delete(base_uri: str) -> None:
    files = {"a.txt": b"alpha", "sub/b.bin": bytes(range(256)) * 4, "sub/deeper/c": b""}
    for name, data in files.items():
        storage.write_bytes(storage.join(base_uri, name), data)

    for name, data in files.items():
        uri = storage.join(base_uri, name)
        assert storage.read_bytes(uri) == data
        assert storage.size(uri) == len(data)
        assert storage.exists(uri)
    assert storage.list_files(base_uri) == sorted(files)
    assert storage.list_files(storage.join(base_uri, "sub")) == ["b.bin", "deeper/c"]
    assert storage.exists(storage.join(base_uri, "sub"))  # a directory / prefix
    assert not storage.exists(storage.join(base_uri, "nope.txt"))
    assert not storage.exists(storage.join(base_uri, "su"))  # a name prefix is not a directory
    assert storage.list_files(storage.join(base_uri, "missing-dir")) == []

    storage.write_bytes(storage.join(base_uri, "a.txt"), b"replaced")
    assert storage.read_bytes(storage.join(base_uri, "a.txt")) == b"replaced"

    storage.delete(storage.join(base_uri, "a.txt"))
    storage.delete(storage.join(base_uri, "a.txt"))  # deleting twice is fine
    assert not storage.exists(storage.join(base_uri, "a.txt"))
    storage.delete_prefix(storage.join(base_uri, "sub"))
    assert storage.list_files(base_uri) == []
    storage.delete_prefix(storage.join(base_uri, "sub"))  # and so is a missing prefix


def test_upload_download_round_trip(base_uri: str, tmp_path: Path) -> None:
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(300_000))
    uri = storage.join(base_uri, "dir", "copy.bin")
    storage.upload_file(src, uri)
    dest = tmp_path / "out" / "copy.bin"
    storage.download_file(uri, dest)
    assert dest.read_bytes() == src.read_bytes()
    assert [p.name for p in dest.parent.iterdir()] == ["copy.bin"]  # no temp file left behind


def test_text_lines_stream(base_uri: str) -> None:
    text = 'héllo wörld\r\n{"a": 1}\n\nlast line without newline'
    uri = storage.join(base_uri, "data.jsonl")
    storage.write_bytes(uri, text.encode())
    assert list(storage.open_text_lines(uri)) == [
        "héllo wörld",
        '{"a": 1}',
        "",
        "last line without newline",
    ]
    # Tiny chunks split the multi-byte characters across reads on S3.
    assert list(storage.open_text_lines(uri, chunk_bytes=3))[0] == "héllo wörld"


def test_missing_file_errors_name_the_uri(base_uri: str, tmp_path: Path) -> None:
    uri = storage.join(base_uri, "no", "such.bin")
    for call in (
        lambda: storage.read_bytes(uri),
        lambda: storage.size(uri),
        lambda: storage.download_file(uri, tmp_path / "x"),
        lambda: storage.open_text_lines(uri),
    ):
        with pytest.raises(StorageError) as info:
            call()
        assert info.value.kind == errors.NOT_FOUND
        assert uri in str(info.value)
        assert info.value.uri == uri
    assert not (tmp_path / "x").exists()


def test_local_write_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "f.bin"
    storage.write_bytes(str(target), b"old content")

    def fail_fsync(fd: int) -> None:
        raise OSError(5, "simulated I/O error")

    monkeypatch.setattr(os, "fsync", fail_fsync)
    with pytest.raises(StorageError, match="f.bin"):
        storage.write_bytes(str(target), b"new content that never lands")
    assert target.read_bytes() == b"old content"
    assert [p.name for p in tmp_path.iterdir()] == ["f.bin"]  # the temp file was removed


def test_local_list_of_a_file_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"x")
    with pytest.raises(StorageError, match="expected a directory"):
        storage.list_files(str(tmp_path / "f"))


# ---------------------------------------------------------------------------------- S3 specifics


def test_client_uses_endpoint_and_adaptive_retries(
    s3_endpoint: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APPLIANCE_S3_MAX_ATTEMPTS", "7")
    client = s3.s3_client()
    assert client.meta.endpoint_url == s3_endpoint
    # botocore's max_attempts counts retries: 7 retries = 8 attempts in all.
    assert client.meta.config.retries == {"mode": "adaptive", "total_max_attempts": 8}


def test_multipart_upload_really_happens(s3_bucket: str, s3_client: Any, tmp_path: Path) -> None:
    src = tmp_path / "big.bin"
    src.write_bytes(os.urandom(11 * MiB))
    uri = f"s3://{s3_bucket}/model/big.bin"
    storage.upload_file(src, uri, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    etag = s3_client.head_object(Bucket=s3_bucket, Key="model/big.bin")["ETag"].strip('"')
    assert etag.endswith("-3"), etag  # 5 + 5 + 1 MiB parts

    storage.upload_file(src, f"s3://{s3_bucket}/model/single.bin")  # default 64 MiB threshold
    etag = s3_client.head_object(Bucket=s3_bucket, Key="model/single.bin")["ETag"]
    assert "-" not in etag

    dest = tmp_path / "back.bin"
    storage.download_file(uri, dest, multipart_threshold=5 * MiB, multipart_chunksize=5 * MiB)
    assert dest.read_bytes() == src.read_bytes()


def test_chunks_upload_in_full_parts_and_write_locally(
    s3_bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """write_chunks: chunks of any size make 5 MiB parts but the last (S3 refuses smaller)."""
    monkeypatch.setenv("APPLIANCE_S3_MULTIPART_THRESHOLD", str(5 * MiB))
    data = os.urandom(11 * MiB)
    step = 3 * MiB + 1

    def chunks():
        return (memoryview(data)[i : i + step] for i in range(0, len(data), step))

    storage.write_chunks(f"s3://{s3_bucket}/model/streamed.bin", chunks())
    head = s3_client.head_object(Bucket=s3_bucket, Key="model/streamed.bin")
    assert head["ETag"].strip('"').endswith("-3") and head["ContentLength"] == len(data)
    assert storage.read_bytes(f"s3://{s3_bucket}/model/streamed.bin") == data
    storage.write_chunks(str(tmp_path / "streamed.bin"), chunks())
    assert (tmp_path / "streamed.bin").read_bytes() == data


def test_missing_bucket_errors(s3_endpoint: str, tmp_path: Path) -> None:
    uri = "s3://no-such-bucket-appliance/run/file.bin"
    src = tmp_path / "f"
    src.write_bytes(b"x")
    calls = {
        "read_bytes": lambda: storage.read_bytes(uri),
        "write_bytes": lambda: storage.write_bytes(uri, b"x"),
        "upload_file": lambda: storage.upload_file(src, uri),
        "download_file": lambda: storage.download_file(uri, tmp_path / "d"),
        "size": lambda: storage.size(uri),
        "exists": lambda: storage.exists(uri),
        "list_files": lambda: storage.list_files("s3://no-such-bucket-appliance/run"),
        "localize": lambda: s3_cache.localize(uri, cache_dir=tmp_path / "cache"),
    }
    for what, call in calls.items():
        with pytest.raises(StorageError) as info:
            call()
        msg = str(info.value)
        assert info.value.kind == errors.NO_BUCKET, (what, msg)
        assert (
            "bucket 'no-such-bucket-appliance' does not exist (s3://no-such-bucket-appliance" in msg
        )
        assert "create it or fix the URI" in msg


def test_access_denied_names_the_uri(
    s3_endpoint: str, s3_bucket: str, s3_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real IAM denial from moto: a user allowed only to list the bucket."""
    import boto3

    from tests.s3_server import enforce_iam

    s3_client.put_object(Bucket=s3_bucket, Key="secret.bin", Body=b"x")
    iam = boto3.client("iam", endpoint_url=s3_endpoint)
    user = f"reader-{s3_bucket}"
    iam.create_user(UserName=user)
    policy = {
        "Version": "2012-10-17",
        "Statement": [{"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "*"}],
    }
    iam.put_user_policy(UserName=user, PolicyName="list-only", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName=user)["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])

    uri = f"s3://{s3_bucket}/secret.bin"
    with enforce_iam(s3_endpoint):
        assert storage.list_files(f"s3://{s3_bucket}") == ["secret.bin"]  # allowed
        for call in (
            lambda: storage.read_bytes(uri),
            lambda: storage.write_bytes(uri, b"y"),
            lambda: storage.size(uri),
        ):
            with pytest.raises(StorageError) as info:
                call()
            assert info.value.kind == errors.ACCESS_DENIED
            assert "access denied while" in str(info.value)
            assert uri in str(info.value)

        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOTAREALKEY00000")
        with pytest.raises(StorageError, match="rejected the credentials") as info:
            storage.read_bytes(uri)
        assert info.value.kind == errors.NO_CREDENTIALS


def test_no_credentials(s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    with pytest.raises(StorageError, match="no AWS credentials found") as info:
        storage.read_bytes("s3://some-bucket/k")
    assert info.value.kind == errors.NO_CREDENTIALS
    assert "s3://some-bucket/k" in str(info.value)


# ---------------------------------------------------------------------------------- localize


def test_localize_local_path_unchanged(tmp_path: Path) -> None:
    assert s3_cache.localize(str(tmp_path)) == tmp_path
    with pytest.raises(StorageError, match="no such file or directory") as info:
        s3_cache.localize(str(tmp_path / "missing"))
    assert str(tmp_path / "missing") in str(info.value)


@pytest.fixture
def model_prefix(s3_bucket: str, s3_client: Any) -> str:
    """A small 'model directory' in S3."""
    for key, body in {
        "models/tiny/config.json": b'{"hidden_size": 8}',
        "models/tiny/model-00001.safetensors": b"A" * 1000,
        "models/tiny/tok/tokenizer.json": b"{}",
        "models/tiny-other/x": b"not part of the model",
    }.items():
        s3_client.put_object(Bucket=s3_bucket, Key=key, Body=body)
    return f"s3://{s3_bucket}/models/tiny"


def test_localize_downloads_then_skips_unchanged(
    model_prefix: str,
    s3_bucket: str,
    s3_client: Any,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = tmp_path / "cache"
    path = s3_cache.localize(model_prefix, cache_dir=cache)
    assert path == cache / s3_bucket / "models" / "tiny"
    got = sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())
    assert got == ["config.json", "model-00001.safetensors", "tok/tokenizer.json"]
    assert (path / "model-00001.safetensors").read_bytes() == b"A" * 1000

    fetched: list[str] = []
    real_download = storage.download_file

    def recording_download(uri: str, local_path: object, **kw: object) -> None:
        fetched.append(uri)
        real_download(uri, local_path, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(s3_cache, "download_file", recording_download)
    assert s3_cache.localize(model_prefix, cache_dir=cache) == path
    assert fetched == []  # everything already there with the same size and ETag

    # Same size, new content: the ETag differs, so exactly that file is fetched again.
    s3_client.put_object(
        Bucket=s3_bucket, Key="models/tiny/model-00001.safetensors", Body=b"B" * 1000
    )
    s3_client.delete_object(Bucket=s3_bucket, Key="models/tiny/tok/tokenizer.json")
    s3_cache.localize(model_prefix, cache_dir=cache)
    assert fetched == [f"{model_prefix}/model-00001.safetensors"]
    assert (path / "model-00001.safetensors").read_bytes() == b"B" * 1000
    assert not (path / "tok" / "tokenizer.json").exists()  # gone from S3, gone here

    # A local file damaged to another size is fetched again too.
    (path / "config.json").write_bytes(b"{")
    fetched.clear()
    s3_cache.localize(model_prefix, cache_dir=cache)
    assert fetched == [f"{model_prefix}/config.json"]
    assert (path / "config.json").read_bytes() == b'{"hidden_size": 8}'


def test_two_callers_localizing_one_prefix_at_once_fetch_each_file_once(
    model_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Tokenizer workers, or a trainer per GPU, on one node localize the same prefix at once
    into a cold cache: one downloads, the other waits for it (a lock beside the prefix's index)
    and finds the files there, instead of downloading the model a second time."""
    import threading
    import time

    cache, fetched, real_download = tmp_path / "cache", [], storage.download_file

    def slow_download(uri: str, local_path: object, **kw: object) -> None:
        fetched.append(uri)
        time.sleep(0.3)  # a download takes a while: the other caller arrives meanwhile
        real_download(uri, local_path, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(s3_cache, "download_file", slow_download)
    paths: list[Path] = []
    callers = [
        threading.Thread(target=lambda: paths.append(s3_cache.localize(model_prefix, cache)))
        for _ in range(2)
    ]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    names = ["config.json", "model-00001.safetensors", "tok/tokenizer.json"]
    assert sorted(fetched) == [f"{model_prefix}/{n}" for n in names]  # each once
    assert len(paths) == 2 and paths[0] == paths[1]
    assert (paths[0] / "model-00001.safetensors").read_bytes() == b"A" * 1000


def test_localize_single_file_and_default_cache(
    s3_bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s3_client.put_object(Bucket=s3_bucket, Key="data/train.jsonl", Body=b'{"text": "hi"}\n')
    monkeypatch.delenv("APPLIANCE_S3_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    path = s3_cache.localize(f"s3://{s3_bucket}/data/train.jsonl")
    assert path == tmp_path / ".cache" / "appliance" / "s3" / s3_bucket / "data" / "train.jsonl"
    assert path.read_bytes() == b'{"text": "hi"}\n'

    with pytest.raises(StorageError, match="nothing at") as info:
        s3_cache.localize(f"s3://{s3_bucket}/data/missing.jsonl", cache_dir=tmp_path / "c")
    assert info.value.kind == errors.NOT_FOUND
    assert f"s3://{s3_bucket}/data/missing.jsonl" in str(info.value)


def test_a_cache_that_cannot_be_written_is_named_with_the_variable_to_set(
    s3_bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`docker run --user` with another uid: HOME is `/`, where ~/.cache cannot be made. (A
    HOME under a file fails the same way for root, which ignores permissions.)"""
    s3_client.put_object(Bucket=s3_bucket, Key="data/train.jsonl", Body=b'{"text": "hi"}\n')
    monkeypatch.delenv("APPLIANCE_S3_CACHE", raising=False)
    (tmp_path / "home").write_text("a file, not a directory")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    uri = f"s3://{s3_bucket}/data/train.jsonl"
    with pytest.raises(StorageError) as info:
        s3_cache.localize(uri)
    assert str(info.value) == (
        f"cannot download {uri}: the S3 cache {tmp_path}/home/.cache/appliance/s3 is not "
        "writable (Not a directory); set APPLIANCE_S3_CACHE to a writable directory (in a "
        "container, a mounted volume: the downloads are then kept between runs)"
    )
    monkeypatch.setenv("APPLIANCE_S3_CACHE", str(tmp_path / "cache"))
    assert s3_cache.localize(uri).read_bytes() == b'{"text": "hi"}\n'


def test_a_read_only_cache_that_holds_everything_is_only_read(
    s3_bucket: str, s3_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache filled once and mounted read-only (the S3 cache of an image or a shared volume)
    serves what it holds; only a download into it is refused, naming the cache. (Root ignores
    file modes, so a read-only mount is stood in for by file creation failing with EROFS.)"""
    import errno

    s3_client.put_object(Bucket=s3_bucket, Key="data/train.jsonl", Body=b'{"text": "hi"}\n')
    uri, cache = f"s3://{s3_bucket}/data/train.jsonl", tmp_path / "cache"
    path = s3_cache.localize(uri, cache_dir=cache)

    def read_only(*args: Any, **kw: Any) -> Any:
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(s3_cache.tempfile, "TemporaryFile", read_only)
    assert s3_cache.localize(uri, cache_dir=cache) == path  # all there: nothing to write
    s3_client.put_object(Bucket=s3_bucket, Key="data/train.jsonl", Body=b'{"text": "new"}\n')
    with pytest.raises(StorageError, match="is not writable \\(Read-only file system\\)"):
        s3_cache.localize(uri, cache_dir=cache)
    assert path.read_bytes() == b'{"text": "hi"}\n'  # what was there is kept


def test_localize_checks_free_space(
    model_prefix: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    total = len(b'{"hidden_size": 8}') + 1000 + len(b"{}")
    real = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda p: type(real)(real.total, real.total - 100, 100)
    )
    cache = tmp_path / "cache"
    with pytest.raises(StorageError) as info:
        s3_cache.localize(model_prefix, cache_dir=cache)
    msg = str(info.value)
    assert info.value.kind == errors.NO_SPACE
    assert model_prefix in msg
    assert f"need {total} bytes" in msg
    assert "100 bytes" in msg and "free" in msg
    assert not any(p.is_file() for p in cache.rglob("*"))  # nothing was downloaded


def test_a_model_or_an_adapter_from_s3_fetches_only_the_files_that_are_read(
    s3_bucket: str, s3_client: Any, tmp_path: Path
) -> None:
    """A model directory as the Hub holds Llama 2 and 3 (every weight also as .bin, Meta's own
    checkpoint under original/) is fetched as its safetensors and the files beside them; a run's
    output as its adapter, record and card, without the checkpoints."""
    cache = tmp_path / "cache"

    def put(prefix: str, names: list[str]) -> str:
        for name in names:
            s3_client.put_object(Bucket=s3_bucket, Key=f"{prefix}/{name}", Body=name.encode())
        return f"s3://{s3_bucket}/{prefix}"

    def files(path: Path) -> list[str]:
        return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())

    read = ["LICENSE", "config.json", "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors", "model.safetensors.index.json", "tokenizer.json"]  # fmt: skip
    skipped = ["pytorch_model-00001-of-00002.bin", "pytorch_model.bin.index.json",
               "original/consolidated.00.pth", "original/params.json"]  # fmt: skip
    assert files(s3_cache.localize_model(put("models/llama", read + skipped), cache)) == read
    # weights in .bin alone are fetched: the error that says how to convert them needs them
    old = put("models/old", ["config.json", "pytorch_model.bin", "original/x.pth"])
    assert files(s3_cache.localize_model(old, cache)) == ["config.json", "pytorch_model.bin"]
    local = tmp_path / "local-model"
    local.mkdir()
    assert s3_cache.localize_model(str(local)) == local
    with pytest.raises(StorageError, match=r"^nothing at s3://\S+/models/none: no object"):
        s3_cache.localize_model(f"s3://{s3_bucket}/models/none", cache)

    adapter = ["README.md", "adapter_config.json", "adapter_model.safetensors", "run.json"]
    checkpoint = ["checkpoints/latest", "checkpoints/step-000002/trainer_state.pt", "notes.txt"]
    run = put("runs/a", adapter + checkpoint)
    assert files(s3_cache.localize_adapter(run, cache)) == adapter
    # a checkpoint: its adapter, config, driver state and manifest, not its trainer state
    step = put("runs/a/checkpoints/step-000002", adapter[1:3] + ["config.json", "manifest.json",
               "driver_state.json", "trainer_state.pt"])  # fmt: skip
    assert files(s3_cache.localize_adapter(step, cache)) == adapter[1:3] + [
        "config.json", "driver_state.json", "manifest.json"
    ]  # fmt: skip
    unfinished = put("runs/b", ["run.json", *checkpoint])
    with pytest.raises(StorageError) as e:
        s3_cache.localize_adapter(unfinished, cache)
    assert str(e.value) == (
        f"no adapter_config.json under {unfinished}/: pass a directory written by appliance "
        "train (or PEFT)"
    )  # (its run.json is not one: nothing more to say)
    # a run's output before its run completed: its latest complete checkpoint is named
    s3_client.put_object(Bucket=s3_bucket, Key="runs/c/run.json", Body=b'{"status": "interrupted"}')
    put("runs/c", ["checkpoints/step-000002/manifest.json", "checkpoints/step-000004/x"])
    with pytest.raises(StorageError) as e:
        s3_cache.localize_adapter(f"s3://{s3_bucket}/runs/c", cache)
    assert str(e.value) == (
        f"s3://{s3_bucket}/runs/c holds an appliance run (interrupted) whose adapter is written "
        f"when it completes; pass its latest checkpoint, --adapter s3://{s3_bucket}/runs/c/"
        f"checkpoints/step-000002, or finish the run (appliance train --output "
        f"s3://{s3_bucket}/runs/c --resume)"
    )
    # ... and locally, where `checkpoints/latest` (the marker file) stands for what it names
    out = tmp_path / "run"
    (out / "checkpoints" / "step-000003").mkdir(parents=True)
    (out / "run.json").write_text('{"status": "failed"}')
    with pytest.raises(StorageError, match=r"run \(failed\) .*it has no checkpoint yet either"):
        s3_cache.localize_adapter(str(out))
    (out / "checkpoints" / "step-000003" / "adapter_config.json").write_text("{}")
    (out / "checkpoints" / "latest").write_text("step-000003\n")
    named = s3_cache.localize_adapter(str(out / "checkpoints" / "latest"))
    assert named == out / "checkpoints" / "step-000003"
    # the names s3_cache keeps to itself (it stays light) are those the modules use
    from appliance.adapter.model_card import CARD
    from appliance.models.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS
    from appliance.run.record import RUN_FILE
    from appliance.storage.checkpoints import CONFIG_FILE, DRIVER_STATE, MANIFEST

    assert set(s3_cache.ADAPTER_FILES) == {
        ADAPTER_CONFIG, ADAPTER_WEIGHTS, RUN_FILE, CONFIG_FILE, DRIVER_STATE, MANIFEST, CARD
    }  # fmt: skip
    assert s3_cache.ADAPTER_FILES[0] == ADAPTER_CONFIG


def test_an_adapter_flag_on_a_full_finetunes_output_says_to_give_it_as_the_model(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    record = {"config": {"finetuning_type": "full"}, "status": "complete"}
    (out / "run.json").write_text(json.dumps(record))
    (out / "config.json").write_text("{}")
    with pytest.raises(StorageError, match="full fine-tune .* appliance eval --model .*run --data"):
        s3_cache.localize_adapter(str(out))
