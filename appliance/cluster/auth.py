"""Ray's token authentication as this process has it (Ray >= 2.52; the pinned 2.60 turns it on
for every new local cluster, and the Helm chart for its RayCluster).

- `quiet_default_notice`: drop the warning Ray logs on every embedded start that it turned
  authentication on (nothing to act on).
- `token_in_env_if_home_is_read_only`: embedded Ray where ~/.ray, where Ray would save its new
  token, cannot be written.
- `local_token_problem`: RAY_AUTH_MODE=token here but no token Ray can read. Checked before
  anything connects: Ray's C++ client aborts the whole process on it, with a stack trace.
- `what_was_sent`: for the error when a cluster refused this process.
"""

from __future__ import annotations

import logging
import os
import secrets
from pathlib import Path

from appliance.errors import first_line

MODE_ENV = "RAY_AUTH_MODE"
TOKEN_ENV = "RAY_AUTH_TOKEN"
TOKEN_PATH_ENV = "RAY_AUTH_TOKEN_PATH"
#: What every message says to do.
HOW = "set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH) to the cluster's token"
#: Where the Helm chart's cluster keeps it (KubeRay's Secret, named after the RayCluster).
CHART_TOKEN = (
    "kubectl get secret -n NAMESPACE RAYCLUSTER -o jsonpath='{.data.auth_token}' | base64 -d"
)


def mode_is_token() -> bool:
    return os.environ.get(MODE_ENV, "").strip().lower() == "token"


def local_token_problem() -> str | None:
    """With RAY_AUTH_MODE=token: None when Ray finds a token here (RAY_AUTH_TOKEN, then the file
    RAY_AUTH_TOKEN_PATH names, then ~/.ray/auth_token), else what is wrong. None without it."""
    if not mode_is_token():
        return None
    try:
        from ray._raylet import AuthenticationTokenLoader
        from ray.exceptions import AuthenticationError
    except ImportError:  # another Ray than the pinned one: it says what it says
        return None
    try:
        if AuthenticationTokenLoader.instance().has_token(ignore_auth_mode=True):
            return None
    except AuthenticationError as e:  # RAY_AUTH_TOKEN_PATH names a file it cannot read
        return f"RAY_AUTH_MODE is token here, but {first_line(e)}"
    return (
        "RAY_AUTH_MODE is token here, but no token is set (RAY_AUTH_TOKEN is empty or unset, "
        "with no RAY_AUTH_TOKEN_PATH and no ~/.ray/auth_token)"
    )


def what_was_sent() -> str:
    """The token this process sent to a cluster that refused it (after local_token_problem)."""
    if not mode_is_token():
        return "none, as RAY_AUTH_MODE is not token here"
    return "one the cluster does not accept"


def quiet_default_notice() -> None:
    """Ray 2.60's ray.init of a new local cluster enables token authentication and warns that it
    did, on every run ("Token authentication is enabled ... Set RAY_AUTH_MODE=disabled to opt
    out"). Authentication stays on; only that notice is dropped: a warning every run says
    nothing to act on. Any other warning of Ray's (auth disabled, a token missing) still shows."""
    log = logging.getLogger("ray._private.authentication.authentication_token_setup")
    if not any(f is _drop_token_auth_enabled for f in log.filters):
        log.addFilter(_drop_token_auth_enabled)


def _drop_token_auth_enabled(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled")


def token_in_env_if_home_is_read_only() -> None:
    """Ray 2.60's ray.init of a new local cluster turns token authentication on and, with no token
    given, writes a new one to ~/.ray/auth_token. Where the home directory cannot be written
    (`docker run --user <uid>`: HOME is /, which only root may write), that write failed and Ray
    did not start. There the token is made here instead and given to Ray in RAY_AUTH_TOKEN, the
    first place it looks (its processes inherit it): authentication stays on, nothing is written.
    A token the user gave (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, the file) or RAY_AUTH_MODE=disabled
    is left as it is."""
    if os.environ.get(MODE_ENV, "token").strip().lower() != "token":
        return
    if os.environ.get(TOKEN_ENV) or os.environ.get(TOKEN_PATH_ENV):
        return
    ray_home = Path.home() / ".ray"
    if (ray_home / "auth_token").exists():
        return
    try:
        ray_home.mkdir(parents=True, exist_ok=True)  # as Ray would, to write its token there
        if os.access(ray_home, os.W_OK):
            return
    except OSError:
        pass
    os.environ[TOKEN_ENV] = secrets.token_hex(32)
