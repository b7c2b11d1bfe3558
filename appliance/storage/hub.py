"""`--model org/name` and `--data org/name`: Hugging Face hub ids, found in the local Hugging Face
cache.

Nothing is downloaded: the id resolves, through huggingface_hub's own cache lookup (`HF_HOME`,
`HF_HUB_CACHE`, the `models--org--name/snapshots/<commit>/` layout, or `datasets--org--name/...`
for a dataset, `refs/main`), to the snapshot directory that `hf download org/name` (with
`--repo-type dataset` for a dataset) filled, and that directory is used like any other model or
dataset directory. `org/name@revision` picks a branch, tag or commit. When the id is not cached
the error gives the command that downloads it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import NamedTuple

from appliance.errors import ModelError
from appliance.storage import uri as storage
from appliance.storage.names import why_outside

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


def is_hub_id(model: str) -> bool:
    """`org/name` (or `org/name@revision`) that is neither an s3:// URI nor an existing path."""
    if storage.is_s3(model) or model.startswith((".", "/", "~")):
        return False
    return bool(_HUB_ID.match(model)) and not Path(model).exists()


class CachedRepo(NamedTuple):
    """Where a path lies in the local Hugging Face cache."""

    repo_id: str  # org/name
    revision: str  # the snapshot's commit
    inside: str  # the rest of the path, inside the snapshot ("" for the snapshot itself)


def cached_repo(path: str | Path, repo_type: str = "model") -> CachedRepo | None:
    """The repo whose cached snapshot holds `path` (`.../models--org--name/snapshots/<commit>/…`,
    `datasets--…` for a dataset): what `resolve_model` or `resolve_dataset` made of a hub id,
    named by its id again (model cards, adapter configs). None for any other path."""
    parts, prefix = Path(path).parts, f"{repo_type}s--"
    for i in range(len(parts) - 2):
        owner, _, repo = parts[i].removeprefix(prefix).partition("--")
        if (
            parts[i].startswith(prefix)
            and owner
            and repo
            and parts[i + 1] == "snapshots"
            and re.fullmatch(r"[0-9a-f]{40}", parts[i + 2])
        ):
            return CachedRepo(f"{owner}/{repo}", parts[i + 2], "/".join(parts[i + 3 :]))
    return None


def resolve_model(model: str, flag: str = "--model") -> str:
    """A local path or s3:// URI as it is; a hub id as its snapshot directory in the local
    Hugging Face cache. ModelError (naming `flag`) when the id is not cached."""
    return resolve_repo(model, flag, "model", ModelError)


def resolve_repo(uri: str, flag: str, repo_type: str, error: type[Exception]) -> str:
    if not is_hub_id(uri):
        return uri
    from huggingface_hub import constants, snapshot_download

    repo_id, _, revision = uri.partition("@")
    if revision and (why := why_outside(revision)) is not None:  # refs/<revision> is a path
        raise error(
            f"{flag} {uri}: the revision {revision!r} is not a branch, tag or commit ({why}); "
            "give one as the hub names it"
        )
    try:
        return snapshot_download(
            repo_id, repo_type=repo_type, revision=revision or None, local_files_only=True
        )
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub names it several ways)
        kind = "" if repo_type == "model" else f" --repo-type {repo_type}"
        what = "not a directory here" if repo_type == "model" else "not a file or directory here"
        raise error(
            f"{flag} {uri}: {what} and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it with `hf download {repo_id}{kind}"
            f"{' --revision ' + revision if revision else ''}` (or `hf download {repo_id}{kind} "
            f"--local-dir DIR` and pass {flag} DIR)"
        ) from None
