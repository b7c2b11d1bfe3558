"""Where bytes live: local paths and s3:// URIs behind one set of functions.

uri.py          read, write, list, delete a path or s3:// URI (atomic local writes)
s3.py           the S3 client (endpoint, retries) and how its errors read
localize.py     s3:// models, data and adapters copied into a local cache, once
checkpoints.py  training checkpoints: save, verify, list, load the latest complete one
history.py      the run's per-step losses, kept once: each checkpoint appends its share
hub.py          `org/name` ids found in the local Hugging Face cache
globs.py        glob patterns over local paths and S3 keys
output_lock.py  one writer per --output (train, export): a local lock file, an S3 lease
safe_open.py    lock and marker files opened without following links
names.py        names from outside (S3 keys, manifest entries, shard names) kept inside their root
"""

from appliance.storage.checkpoints import list_checkpoints, load_latest_checkpoint, save_checkpoint
from appliance.storage.localize import localize_data, localize_model
from appliance.storage.uri import exists, is_s3, join, read_bytes, write_bytes

__all__ = [
    "exists",
    "is_s3",
    "join",
    "list_checkpoints",
    "load_latest_checkpoint",
    "localize_data",
    "localize_model",
    "read_bytes",
    "save_checkpoint",
    "write_bytes",
]
