"""`--model org/name`: a Hugging Face hub id, found in the local Hugging Face cache.

Nothing is downloaded: the id resolves, through huggingface_hub's own cache lookup (`HF_HOME`,
`HF_HUB_CACHE`, the `models--org--name/snapshots/<commit>/` layout, `refs/main`), to the snapshot
directory that `hf download org/name` filled, and that directory is used like any other model
directory. `org/name@revision` picks a branch, tag or commit. When the model is not cached the
error gives the command that downloads it.
"""

from __future__ import annotations

import re
from pathlib import Path

from . import storage
from .errors import ModelError

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*(@[\w./-]+)?$")


def is_hub_id(model: str) -> bool:
    """`org/name` (or `org/name@revision`) that is neither an s3:// URI nor an existing path."""
    if storage.is_s3(model) or model.startswith((".", "/", "~")):
        return False
    return bool(_HUB_ID.match(model)) and not Path(model).exists()


def resolve_model(model: str, flag: str = "--model") -> str:
    """A local path or s3:// URI as it is; a hub id as its snapshot directory in the local
    Hugging Face cache. ModelError (naming `flag`) when the id is not cached."""
    if not is_hub_id(model):
        return model
    from huggingface_hub import constants, snapshot_download

    repo_id, _, revision = model.partition("@")
    try:
        return snapshot_download(repo_id, revision=revision or None, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached (huggingface_hub names it several ways)
        raise ModelError(
            f"{flag} {model}: not a directory here and not in the local Hugging Face cache "
            f"({constants.HF_HUB_CACHE}); download it with `hf download {repo_id}"
            f"{' --revision ' + revision if revision else ''}` (or `hf download {repo_id} "
            f"--local-dir DIR` and pass {flag} DIR)"
        ) from None
