"""scripts/install-tools.sh: idempotent, quick the second time, and leaves working tools where
the other deploy tests look for them. (`make test` runs it once before pytest, so here it is the
second run; on a machine without the tools this run installs them.)"""

from __future__ import annotations

import time

from tests.deploy.conftest import HADOLINT, HELM, KUBERNETES_VALIDATE, NODE_MODELS, ROOT, run


def test_install_tools_twice_is_quick_and_leaves_working_tools() -> None:
    first = run(["bash", "scripts/install-tools.sh"], timeout=600)
    assert first.returncode == 0, first.stdout + first.stderr
    start = time.monotonic()
    second = run(["bash", "scripts/install-tools.sh"], timeout=120)
    elapsed = time.monotonic() - start
    assert second.returncode == 0, second.stdout + second.stderr
    assert elapsed < 15, f"second run took {elapsed:.1f}s: it should only check its stamps"
    assert second.stderr.count("already") == 3  # helm, python tools, node packages

    helm = run([HELM, "version", "--short"])
    assert helm.returncode == 0 and helm.stdout.startswith("v4."), helm.stdout
    assert run([HADOLINT, "--version"]).stdout.startswith("Haskell Dockerfile Linter")
    assert run([KUBERNETES_VALIDATE, "--version"]).returncode == 0
    assert (ROOT / ".venv-tools" / "bin" / "checkov").exists()
    assert (NODE_MODELS / "node_modules" / "@kubernetes-models" / "prometheus-operator").is_dir()


def test_the_tool_directories_are_ignored_by_git() -> None:
    for path in (
        ".tools/bin/helm",
        ".venv-tools/bin/checkov",
        "build/deploy/a10/values.generated.yaml",
    ):
        result = run(["git", "check-ignore", "-q", path])
        assert result.returncode == 0, f"{path} is not ignored by .gitignore"
