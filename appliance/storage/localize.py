"""Local copies of ``s3://`` models, adapters and datasets: ``localize`` (a local path is taken as
it is), ``localize_model`` and ``localize_adapter``, which fetch only the files that are read, and
``localize_data`` for ``--data`` and ``--eval-data``, which may be glob patterns.

Downloads go to ``<cache root>/<bucket>/<key>`` (``APPLIANCE_S3_CACHE``, default
``~/.cache/appliance/s3``), with an index of the size and ETag each file was fetched with, so a
rerun fetches only what changed. Every failure is a ``StorageError`` naming the URI and what to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from appliance.errors import (
    INVALID,
    NO_SPACE,
    NOT_FOUND,
    ApplianceError,
    StorageError,
    appliance_command,
)
from appliance.storage import names
from appliance.storage.checkpoints import LATEST_MARKER, RUN_FILE, list_checkpoints
from appliance.storage.globs import brace_hint, glob_match, has_glob, split_glob
from appliance.storage.s3 import S3_SCHEME, s3_client, s3_error
from appliance.storage.safe_open import NotARegularFile, open_regular
from appliance.storage.uri import (
    ObjectInfo,
    atomic_local_write,
    download_file,
    exists,
    is_s3,
    join,
    list_objects,
    read_bytes,
    split_s3,
    to_local,
)

logger = logging.getLogger(__name__)

DEFAULT_CACHE_ROOT = Path("~/.cache/appliance/s3")
# weights in the formats other than safetensors, which a model directory may hold beside them
OTHER_WEIGHT_FILES = ("*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.ckpt", "*.h5", "*.msgpack",
                      "*.gguf")  # fmt: skip
# an adapter directory's files that are read: lora.ADAPTER_CONFIG and ADAPTER_WEIGHTS; the run's
# settings and record (record.RUN_FILE beside a run's adapter; checkpoint.CONFIG_FILE,
# DRIVER_STATE and MANIFEST in a checkpoint), eval's and export's defaults and the card's table;
# and model_card.CARD (this module stays light: the tokenizer workers import it, and torch is not
# theirs to load)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "run.json", "config.json",
                 "driver_state.json", "manifest.json", "README.md")  # fmt: skip
_INDEX_DIR = ".etags"  # under the cache root: what each localized file was downloaded from


def cache_root() -> Path:
    """Where :func:`localize` keeps S3 downloads (``APPLIANCE_S3_CACHE`` or
    ``~/.cache/appliance/s3``)."""
    return Path(os.environ.get("APPLIANCE_S3_CACHE") or DEFAULT_CACHE_ROOT).expanduser()


def _fmt_bytes(n: int) -> str:
    return f"{n} bytes ({n / 2**30:.2f} GiB)"


def _existing_ancestor(path: Path) -> Path:
    path = path.absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def localize(uri: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """A local path holding the content of ``uri``.

    Local paths are returned as they are (a Path, ``~`` expanded) after checking they exist.
    For ``s3://`` the object (a dataset file) or every object under the prefix (a model or
    dataset directory) is downloaded to ``<cache_dir>/<bucket>/<key>`` (``cache_dir`` defaults
    to :func:`cache_root`) and that path is returned. Files already there with the same size and
    ETag are not fetched again; local files whose S3 object disappeared since an earlier
    localize are removed. Before downloading, the free space on the cache disk is checked
    against the bytes still to fetch.
    """
    if not is_s3(uri):
        path = to_local(uri)
        if not path.exists():
            raise StorageError(f"no such file or directory: {uri}: check the path", uri, NOT_FOUND)
        return path
    return _localize_s3(uri, cache_dir)


def localize_data(uri: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """:func:`localize` for ``--data`` and ``--eval-data``, which may be a glob pattern
    (``data/train-*.jsonl``, ``s3://bucket/corpus/**/*.parquet``; the rule is in ``globs``). A
    local pattern is returned as it is once the directory before its first wildcard is found
    (``data_files`` lists what it names); from S3 only the objects that match are downloaded, and
    the pattern over their local copies is returned. A path that exists under its own name is
    never a pattern, on S3 too (a key may hold `[`: `s3://b/d/part[1].jsonl`)."""
    if not has_glob(uri):
        return localize(uri, cache_dir)
    if is_s3(uri) and has_glob(split_s3(uri)[0]):
        raise StorageError(
            f"{uri}: the bucket's name cannot be a pattern; name the bucket", uri, INVALID
        )
    if exists(uri):  # a file, a directory, or an S3 object or prefix, named as it is
        return localize(uri, cache_dir)
    fixed, pattern = split_glob(uri)
    if not is_s3(uri):
        base = to_local(fixed or ".")
        if not base.is_dir():
            raise StorageError(
                f"no such directory: {fixed} (the part of {uri} before its first wildcard): "
                f"check the path{brace_hint(uri)}",
                uri,
                NOT_FOUND,
            )
        return to_local(uri)
    none = (
        f"nothing matches {uri}: no object under {fixed}/ has a name that matches {pattern}; "
        f"check the pattern (`aws s3 ls --recursive {fixed}/`){brace_hint(uri)}"
    )

    def wanted(name: str) -> bool:
        return glob_match(pattern, name)

    return _localize_s3(fixed, cache_dir, wanted, none, shown=uri) / pattern


def localize_model(uri: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """:func:`localize` for a model directory (``--model``): from S3, only the files at its top
    (config, tokenizer, safetensors and their index, templates, licence), without the other
    weight formats when it holds safetensors (Llama 2's repositories hold every weight twice, as
    ``pytorch_model-*.bin`` too) and without its subdirectories (Llama 3's ``original/`` holds
    Meta's ``consolidated.*.pth``): no model reads them, and they can double the download."""
    if not is_s3(uri):
        return localize(uri, cache_dir)
    top = [o.name for o in list_objects(uri) if "/" not in o.name]
    if not top:  # a file, or nothing at all: as `localize` says it
        return localize(uri, cache_dir)
    safetensors = any(n.endswith(".safetensors") for n in top)

    def wanted(name: str) -> bool:
        other = any(fnmatch.fnmatchcase(name, w) for w in OTHER_WEIGHT_FILES)
        return "/" not in name and not (safetensors and other)

    return _localize_s3(uri, cache_dir, wanted, f"no files at the top of {uri}/")


def localize_adapter(uri: str, cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """:func:`localize` for a LoRA adapter directory (``--adapter``): from S3, only the
    adapter's files and, for its model card, the run's record and card beside them, never the
    run's checkpoints (each as big as the adapter and its optimizer state)."""
    if not is_s3(uri):
        path = localize(uri, cache_dir)
        if path.is_file() and path.name == LATEST_MARKER:  # a run's checkpoints/latest: the
            path = path.parent / path.read_text(encoding="utf-8").strip()  # checkpoint it names
        if path.is_dir() and not (path / ADAPTER_FILES[0]).is_file():
            raise StorageError(_no_adapter(str(path)), uri, NOT_FOUND)
        return path
    none = _no_adapter(uri)
    path = _localize_s3(uri, cache_dir, lambda name: name in ADAPTER_FILES, none)
    if not (path / ADAPTER_FILES[0]).is_file():  # a run's output, say, before it completed
        raise StorageError(none, uri, NOT_FOUND)
    return path


def _no_adapter(uri: str) -> str:
    """What to say of an --adapter `uri` without adapter_config.json: a run's output before its
    run completed (interrupted, failed, running) names its latest checkpoint, an adapter too."""
    none = f"no adapter_config.json under {uri}/: pass a directory written by appliance train (or PEFT)"
    run_file = join(uri, RUN_FILE)
    try:
        record = json.loads(read_bytes(run_file)) if exists(run_file) else None
        saved = list_checkpoints(uri) if isinstance(record, dict) else []
    except (ApplianceError, ValueError):  # an unreadable run.json: nothing more to say than `none`
        return none
    if not isinstance(record, dict):
        return none
    config = record.get("config")
    if isinstance(config, dict) and config.get("finetuning_type") == "full":
        return (
            f"{uri} holds a full fine-tune (--finetuning-type full): its output is a whole model, "
            f"not an adapter; score it with appliance eval --model {uri} --data FILE --seq-len N"
        )
    status = record.get("status", "unknown")
    latest = [c for c in saved if c.complete]
    use = (
        f"pass its latest checkpoint, --adapter {latest[-1].uri}, or finish the run "
        f"({appliance_command()} train --output {uri} --resume)"
        if latest
        else "it has no checkpoint yet either: finish the run first "
        f"({appliance_command()} train --output {uri} --resume)"
    )
    return (
        f"{uri} holds an appliance run ({status}) whose adapter is written when it completes; {use}"
    )


def _localize_s3(
    uri: str,
    cache_dir: str | os.PathLike[str] | None,
    wanted: Callable[[str], bool] | None = None,
    none_wanted: str = "",
    shown: str | None = None,
) -> Path:
    """`localize` of an S3 URI; with `wanted`, only the objects under the prefix `uri` whose
    names (below it) it takes, and StorageError(`none_wanted`) when it takes none, naming
    `shown` (the URI the user gave: a pattern's, say) or `uri`."""
    bucket, key = split_s3(uri)
    key = key.strip("/")
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    objects = list_objects(uri)  # the prefix as a directory

    if wanted is not None:
        objects = [o for o in objects if wanted(o.name)]
        if not objects:
            raise StorageError(none_wanted, shown or uri, NOT_FOUND)
    is_dir = bool(objects) or not key
    if not is_dir:
        try:
            head = s3_client().head_object(Bucket=bucket, Key=key)
        except Exception as e:
            err = s3_error(e, uri, "localizing")
            if err.kind == NOT_FOUND:
                err = StorageError(
                    f"nothing at {uri}: no object with that key and no objects under it; "
                    f"check the URI (`aws s3 ls` it){brace_hint(uri)}",
                    uri,
                    NOT_FOUND,
                )
            raise err from e
        objects = [ObjectInfo("", int(head["ContentLength"]), head["ETag"].strip('"'))]
    if is_dir and not objects:
        raise StorageError(f"nothing under {uri}: the prefix is empty", uri, NOT_FOUND)

    dest = _cache_path(root, f"{bucket}/{key}" if key else bucket, uri)
    for o in objects:  # every key below the prefix lands inside dest, or none is fetched
        if o.name:
            _cache_path(dest, o.name, join(uri, o.name))
    index_path = root / _INDEX_DIR / bucket / f"{key or '_'}.json"
    todo, gone = _stale(objects, _read_index(index_path), dest, wanted)
    if not (todo or gone):
        return dest  # a cache that holds it all already is only read: it may be read-only
    _check_cache_writable(root, uri)
    needed = sum(o.size for o in todo)
    free = shutil.disk_usage(_existing_ancestor(dest)).free
    if needed > free:  # before anything is written
        raise StorageError(
            f"not enough disk space to localize {uri} into {dest}: need "
            f"{_fmt_bytes(needed)}, {_fmt_bytes(free)} free; free space there or point "
            "APPLIANCE_S3_CACHE at a bigger disk",
            uri,
            NO_SPACE,
        )
    # another process on this node fetching the same prefix (tokenizer workers, a trainer per
    # GPU) waits here, then finds the files fetched instead of downloading them again
    with _prefix_lock(index_path):
        index = _read_index(index_path)
        todo, gone = _stale(objects, index, dest, wanted)  # what is still missing
        for name in gone:
            del index[name]
            try:  # an index entry that leads out of the cache (a tampered index) deletes nothing
                stale = names.inside(dest, name) if name else dest
            except ValueError:
                logger.warning("not deleting %r: its name leads out of %s", name, dest)
                continue
            if stale.is_file():
                stale.unlink()
        if gone and not todo:
            _write_index(index_path, index, uri)
        if todo:
            needed = sum(o.size for o in todo)
            logger.info("localizing %s: %d files, %s", uri, len(todo), _fmt_bytes(needed))
        for o in todo:
            src = join(uri, o.name) if o.name else f"{S3_SCHEME}{bucket}/{key}"
            download_file(src, _cache_path(dest, o.name, src) if o.name else dest)
            index[o.name] = {"size": o.size, "etag": o.etag}
            _write_index(index_path, index, uri)  # after each file: an interrupted run resumes
    return dest


def _stale(
    objects: list[ObjectInfo], index: dict, dest: Path, wanted: Callable[[str], bool] | None
) -> tuple[list[ObjectInfo], list[str]]:
    """What the cache lacks: the objects not fetched as they are now (size and ETag, and a
    local file of that size), and the names fetched before that are gone from S3 (of those
    `wanted` takes: the rest are another pattern's)."""
    todo = []
    for o in objects:
        local = dest / o.name if o.name else dest
        fresh = index.get(o.name) == {"size": o.size, "etag": o.etag} and (
            local.is_file() and local.stat().st_size == o.size
        )
        if not fresh:
            todo.append(o)
    names = {o.name for o in objects}
    gone = sorted(n for n in set(index) - names if wanted is None or wanted(n))
    return todo, gone


@contextlib.contextmanager
def _prefix_lock(index_path: Path) -> Iterator[None]:
    """An exclusive flock beside the prefix's index, held while its files are fetched (the
    kernel lets go if the process dies)."""
    lock = index_path.parent / f".{index_path.name}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:  # read-only: another uid's file will do; never through a link planted there
        fd = open_regular(lock, os.O_RDONLY | os.O_CREAT, 0o666)
    except NotARegularFile as e:
        raise StorageError(f"the S3 cache's lock {e}", str(lock), INVALID) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _cache_path(root: Path, name: str, uri: str) -> Path:
    """Where the object `uri`, `name` below `root`, goes in the S3 cache; StorageError when that
    would be outside `root` (a key with `..` in it, a link in the cache)."""
    try:
        return names.inside(root, name)
    except ValueError as e:
        raise StorageError(
            f"{uri}: its key leads out of the S3 cache ({e}); appliance writes only inside "
            f"{root}: rename or delete that object, or give a prefix without it",
            uri,
            INVALID,
        ) from None


def _check_cache_writable(root: Path, uri: str) -> None:
    """StorageError naming the cache and APPLIANCE_S3_CACHE unless `root` can hold downloads. A
    container run as another uid (`docker run --user`) has HOME=/ and no ~/.cache of its own."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):
            pass
    except OSError as e:
        raise StorageError(
            f"cannot download {uri}: the S3 cache {root} is not writable ({e.strerror}); set "
            "APPLIANCE_S3_CACHE to a writable directory (in a container, a mounted volume: the "
            "downloads are then kept between runs)",
            uri,
        ) from None


def _read_index(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_index(path: Path, index: dict[str, dict[str, Any]], uri: str) -> None:
    payload = json.dumps(index, indent=1, sort_keys=True).encode()
    atomic_local_write(path, lambda f: f.write(payload), uri)
