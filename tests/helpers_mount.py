"""Private mount namespaces for tests: a child process (and whatever it starts) sees a file system
changed by mounts that nothing outside it sees (`unshare --mount`, or as an unprivileged user
`unshare --user --map-root-user --mount`)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

UNSHARE_FORMS = (["unshare", "--mount"], ["unshare", "--user", "--map-root-user", "--mount"])


def unshare_prefix() -> list[str]:
    """The first unshare form that can mount a tmpfs here, or skip."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare (util-linux) is not installed")
    for form in UNSHARE_FORMS:
        probe = [*form, "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /dev/shm"]
        if subprocess.run(probe, capture_output=True).returncode == 0:
            return form
    pytest.skip("cannot mount a tmpfs in a private mount namespace here (no CAP_SYS_ADMIN)")
