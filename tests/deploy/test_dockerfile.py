"""The Dockerfile: hadolint-clean (ignores justified inline), a CUDA runtime base whose CUDA
matches torch's build, the pinned torch, a non-root user, the `appliance` entrypoint and ports.
(No docker daemon here or in CI: the image itself is built by `make image` where docker runs.)"""

from __future__ import annotations

import re
from pathlib import Path

from tests.deploy.conftest import HADOLINT, ROOT, require, run

DOCKERFILE = ROOT / "Dockerfile"


def instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def arg_default(name: str) -> str:
    values = [
        rest.split("=", 1)[1]
        for kw, rest in instructions()
        if kw == "ARG" and rest.startswith(f"{name}=")
    ]
    assert len(values) == 1, f"ARG {name}= should be set once, found {values}"
    return values[0]


def final_stage() -> list[tuple[str, str]]:
    steps = instructions()
    last_from = max(i for i, (kw, _) in enumerate(steps) if kw == "FROM")
    return steps[last_from:]


def test_hadolint_finds_nothing() -> None:
    result = run([require(HADOLINT), "--failure-threshold", "info", DOCKERFILE])
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_hadolint_ignore_is_justified_by_the_comment_above_it() -> None:
    lines = DOCKERFILE.read_text().splitlines()
    ignores = [i for i, line in enumerate(lines) if "hadolint ignore=" in line]
    for i in ignores:
        reason = lines[i - 1].strip()
        assert reason.startswith("#") and len(reason) > 30, (
            f"line {i + 1}: say why above the ignore"
        )


def test_the_base_is_a_cuda_runtime_ubuntu_image_matching_torchs_cuda_build() -> None:
    froms = [rest for kw, rest in instructions() if kw == "FROM"]
    assert froms and all(
        f.startswith("nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}") for f in froms
    )
    cuda = arg_default("CUDA_VERSION")
    torch_cuda = arg_default("TORCH_CUDA")
    assert re.fullmatch(r"12\.\d+\.\d+", cuda), cuda
    assert re.fullmatch(r"cu12\d", torch_cuda), torch_cuda
    major, minor, _ = cuda.split(".")
    assert torch_cuda == f"cu{major}{minor}"  # 12.6.x <-> cu126
    assert arg_default("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/${TORCH_CUDA}"


def test_torch_is_pinned_to_the_projects_constraint() -> None:
    pins = dict(
        line.split("==")
        for line in (ROOT / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert arg_default("TORCH_VERSION") == pins["torch"].strip()
    runs = " ".join(rest for kw, rest in instructions() if kw == "RUN")
    assert '"torch==${TORCH_VERSION}+${TORCH_CUDA}"' in runs
    assert "--index-url" in runs and "--constraint constraints.txt ." in runs


def test_the_image_runs_appliance_as_a_non_root_user_and_exposes_metrics_and_dashboard() -> None:
    stage = final_stage()
    users = [rest for kw, rest in stage if kw == "USER"]
    assert users, "the final stage must set USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric, so Kubernetes can verify runAsNonRoot
    entrypoints = [rest for kw, rest in stage if kw == "ENTRYPOINT"]
    assert entrypoints == ['["appliance"]']
    exposed = {p for kw, rest in stage if kw == "EXPOSE" for p in rest.split()}
    assert {"8080", "8265"} <= exposed
    pyproject = (ROOT / "pyproject.toml").read_text()
    # the console script the entrypoint runs
    assert re.search(r"^\[project\.scripts\]\s*\nappliance\s*=", pyproject, re.MULTILINE)


def test_the_build_context_holds_only_what_pip_install_needs() -> None:
    ignore = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ignore[0] == "*"
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = {
        src.rstrip("/")
        for kw, rest in instructions()
        if kw == "COPY" and "--from" not in rest
        for src in rest.split()[:-1]
    }
    assert copied <= allowed
    assert {"pyproject.toml", "appliance"} <= copied
