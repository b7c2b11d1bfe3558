"""Which files a `--data` names: a dataset file, a directory searched recursively (sorted by
relative path, other files skipped: `unreadable_files`), a glob pattern, or a Hugging Face dataset
id in the local cache (`resolve_dataset`); and what a run says about a dataset before it reads it
(`dataset_notes`: files skipped, files named for several splits; `not_held_out_notes`:
--eval-data files that are --data's too). How each file is read: files.py.
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

from appliance.data.files import DATA_FILES, data_format, has_documents
from appliance.errors import DataError
from appliance.storage.globs import brace_hint, glob_match, has_glob, split_glob
from appliance.storage.hub import is_hub_id, resolve_repo
from appliance.storage.names import why_outside
from appliance.storage.uri import is_s3


def find_data_files(path: str | Path) -> list[Path]:
    """The dataset's files in document order: a file, a directory's data files, or those a glob
    pattern names (`is_pattern`).

    DataError if the path is missing, holds no data file (`data_format`), or no document at all.
    """
    root = Path(path)
    if is_pattern(root):
        files, others = _matching(root)
        if others and not files:
            raise DataError(
                f"empty dataset: no data files ({DATA_FILES}) match {path} (it matched "
                f"{len(others)} other file(s): {some_of([str(f) for f in others])})"
            )
        if not files:
            dirs = [p for p in glob.glob(str(root), recursive=True) if Path(p).is_dir()]
            raise DataError(
                f"no file matches {path}: "
                + (
                    f"it names directories only ({some_of(dirs, 3)}), and a pattern names files: "
                    f"add /** for every file under them"
                    if dirs
                    else "check the pattern (* and ? match within a name, ** any directories)"
                    + brace_hint(str(path))
                )
            )
    elif not root.exists():
        raise DataError(f"dataset not found: {path}{brace_hint(str(path))}")
    elif root.is_file():
        if data_format(root) is None:
            raise DataError(f"unsupported dataset file {path}: expected a data file ({DATA_FILES})")
        files = [root]
    else:
        files = _files_under(root)
        if not files:
            skipped = [
                f"{len(names)} {what} file(s): {some_of(names)}"
                for what, names in (
                    ("other", unreadable_files(root)),
                    ("hidden", _relative(_files_under(root, hidden=True), root)),
                )
                if names
            ]
            raise DataError(
                f"empty dataset: no data files ({DATA_FILES}) under {path}"
                + (f" (skipped {'; '.join(skipped)})" if skipped else "")
            )
    if not has_documents(files):
        raise DataError(
            f"empty dataset: no documents in {path} ({len(files)} file(s), all empty or blank)"
        )
    return files


def is_pattern(path: str | Path) -> bool:
    """Whether `--data` names its files by a glob pattern (`globs`): a wildcard in a path that
    does not exist under its own name."""
    return has_glob(str(path)) and not Path(path).exists()


def _matching(pattern: Path) -> tuple[list[Path], list[Path]]:
    """The data files a glob pattern names and the other files it names, each sorted by path:
    the document order of a directory of the same files. A pattern names files, as on S3, where
    there are no directories: `data/**` for every file under `data`."""
    hits = (Path(p) for p in glob.glob(str(pattern), recursive=True))
    files = sorted((p for p in hits if p.is_file()), key=Path.as_posix)
    data = [f for f in files if data_format(f) is not None]
    return data, [f for f in files if data_format(f) is None]


def some_of(names: list[str], n: int = 5) -> str:
    """The first `n` of `names`, comma-separated, "..." after them if there are more."""
    return ", ".join(names[:n]) + (", ..." if len(names) > n else "")


def _hidden(f: Path, root: Path) -> bool:
    """Is `f` hidden under `root`: its name, or a directory's on the way, starts with "."
    (`.ipynb_checkpoints/`, macOS's `._` copies, `.git/`)? A directory's hidden files are not
    its data, as a pattern's `*` does not match them."""
    return any(part.startswith(".") for part in f.relative_to(root).parts)


def _files_under(root: Path, hidden: bool = False) -> list[Path]:
    """The data files under a directory (or, `hidden`, its hidden ones), sorted by relative
    POSIX path: the document order is the same on every machine."""
    files = [
        f
        for f in root.rglob("*")
        if data_format(f) is not None and _hidden(f, root) == hidden and f.is_file()
    ]
    return sorted(files, key=lambda f: f.relative_to(root).as_posix())


def _others_under(root: Path) -> list[Path]:
    """The files under a directory that are not data (`.csv`, ...), hidden files left out."""
    return [
        f
        for f in root.rglob("*")
        if data_format(f) is None and not _hidden(f, root) and f.is_file()
    ]


def dataset_root(path: str | Path) -> Path:
    """The directory a dataset's file names are given relative to: a directory itself, a
    pattern's part before its first wildcard, a file's directory."""
    path = Path(path)
    if is_pattern(path):
        return Path(split_glob(str(path))[0] or ".")
    return path if path.is_dir() else path.parent


def file_names(path: str | Path, files: list[Path]) -> list[str]:
    """`files` of the dataset `path` by their names relative to its `dataset_root`: what
    `named_files` takes back, on any node that has the dataset under another root."""
    root = dataset_root(path)
    return [f.relative_to(root).as_posix() for f in files]


def named_files(path: str | Path, names: list[str]) -> list[Path]:
    """The files of the dataset `path` that `file_names` named when the run started, in that
    order, whatever the directory or pattern names now: a file added since (a shard written into
    the directory mid-run) would move the documents the workers' cursors count. DataError naming
    the first one that is gone."""
    root = dataset_root(path)
    files = [root / name for name in names]
    for f in files:
        if not f.is_file():
            raise DataError(
                f"{path}: {f} was one of its data files when the run started and is not there "
                "now: put it back, or resume the run on the data as it is now (--resume "
                "--allow-data-change)"
            )
    return files


def _listing(path: Path) -> tuple[Path, list[Path], list[Path]]:
    """A dataset directory's or pattern's data files and other files, with the directory their
    names are given relative to (`dataset_root`)."""
    if is_pattern(path):
        return dataset_root(path), *_matching(path)
    if path.is_dir():
        return path, _files_under(path), _others_under(path)
    return path.parent, [], []


def _relative(files: list[Path], root: Path) -> list[str]:
    return sorted(f.relative_to(root).as_posix() for f in files)


def unreadable_files(path: str | Path) -> list[str]:
    """Files under a dataset directory, or named by its pattern, that are not data (`.csv`, ...):
    skipped, and said so."""
    root, _, others = _listing(Path(path))
    return _relative(others, root)


# the words that name a split in a file's path, as `datasets` infers splits from file names
SPLIT_WORDS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}


# the split to point to first: --data's train split, --eval-data's validation split
ONE_SPLIT_FIRST = {False: ("train", "validation", "test"), True: ("validation", "test", "train")}


def split_of(relative: str) -> str | None:
    """The split a data file's path names (`data/test-00000-of-00001.parquet`: "test"), if any."""
    words = set(re.split(r"[-._ /]", relative.lower()))
    return next((split for split, names in SPLIT_WORDS.items() if words & set(names)), None)


def split_pattern(split: str, files: list[str]) -> str | None:
    """A glob pattern naming exactly the files of `split` among `files` (names relative to the
    dataset's root): `data/train*` for `data/train-00000-of-00002.parquet`, `dev/**` for
    `dev/part-0.jsonl`; None when neither form names them alone."""
    mine = {f for f in files if split_of(f) == split}
    for f in sorted(mine):
        for word in re.finditer(r"[^-._ /]+", f):
            if word.group().lower() in SPLIT_WORDS[split]:
                end = word.end()
                pattern = f[:end] + ("/**" if f[end : end + 1] == "/" else "*")
                if {g for g in files if glob_match(pattern, g)} == mine:
                    return pattern
                break
    return None


def dataset_notes(path: str | Path, flag: str, uri: str) -> list[str]:
    """What to tell the user about a dataset directory or pattern (`path`, the local copy of
    `uri`, given as `flag`) before a run reads it: the files skipped as not data, and files named
    for several splits, every one of which is read (a dataset downloaded from the Hub holds its
    test split beside its train split)."""
    root, data, others = _listing(Path(path))
    notes = []
    if skipped := _relative(others, root):
        notes.append(
            f"{flag} {uri}: skipped {len(skipped)} file(s) that are not data ({DATA_FILES}): "
            + some_of(skipped)
        )
    is_dir = not is_pattern(Path(path)) and Path(path).is_dir()
    if is_dir and (hidden := _relative(_files_under(root, hidden=True), root)):
        notes.append(f"{flag} {uri}: skipped {len(hidden)} hidden file(s): " + some_of(hidden))
    files = _relative(data, root)
    splits: dict[str, list[str]] = {}
    for f in files:
        if (split := split_of(f)) is not None:
            splits.setdefault(split, []).append(f)
    if len(splits) > 1:
        named = "; ".join(  # train, validation, test
            f"{len(splits[split])} {split}: {some_of(splits[split], 1)}"
            for split in SPLIT_WORDS
            if split in splits
        )
        split = next(s for s in ONE_SPLIT_FIRST[flag == "--eval-data"] if s in splits)
        if (pattern := split_pattern(split, files)) is not None:
            base = split_glob(uri)[0] if has_glob(uri) else uri.rstrip("/")
            one = f"e.g. {flag} '{base}/{pattern}'" if base else f"e.g. {flag} '{pattern}'"
        else:
            one = "a directory of its files alone or a pattern that names them"
        notes.append(
            f"{flag} {uri}: its {len(files)} files are named for several splits ({named}), and "
            f"every one is read: to use one split, give {flag} its files alone ({one})"
        )
    return notes


def not_held_out_notes(data: str | Path, eval_data: str | Path, eval_uri: str) -> list[str]:
    """A note when `eval_data` (given as `--eval-data eval_uri`) shares files with `data` (the
    same file, however reached): a validation loss over documents the run trains on is not a
    held-out loss."""

    def files(path: Path) -> set[Path]:
        found = [path] if path.is_file() else _listing(path)[1]
        return {f.resolve() for f in found if data_format(f) is not None}

    shared = sorted(files(Path(data)) & files(Path(eval_data)))
    if not shared:
        return []
    return [
        f"--eval-data {eval_uri}: {len(shared)} of its files are --data's too, so its loss is "
        f"not held out ({some_of([str(f) for f in shared], 3)}): give files the run does not train "
        "on, or --eval-split"
    ]


def resolve_dataset(data: str, flag: str = "--data") -> str:
    """`resolve_model` for a dataset: a hub id as the snapshot directory of the dataset repo
    `hf download org/name --repo-type dataset` filled, and `org/name/PATTERN` as that glob
    pattern inside it (`org/name/data/train-*`: one split, as `datasets`' data_files picks it).
    DataError (naming `flag`) when the id is not cached. A name like a data file's
    (`dir/train.jsonl`) is a path, missing or not, and so is a pattern whose directory exists."""
    if has_glob(data) and not is_s3(data):
        parts = data.split("/", 2)  # org, name, the pattern inside (a hub id holds no wildcard)
        repo_id = "/".join(parts[:2])
        if len(parts) == 3 and is_hub_id(repo_id) and not Path(split_glob(data)[0]).exists():
            if (why := why_outside(parts[2])) is not None:  # the pattern stays in the snapshot
                raise DataError(f"{flag} {data}: {parts[2]!r} leaves the dataset repo ({why})")
            return str(Path(resolve_repo(repo_id, flag, "dataset", DataError)) / parts[2])
        return data
    if data_format(Path(data)) is not None:
        return data
    return resolve_repo(data, flag, "dataset", DataError)
