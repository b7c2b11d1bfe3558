"""The Dockerfile: hadolint-clean (ignores justified inline), a plain Ubuntu base (torch brings
its CUDA runtime) that starts on older drivers, built for linux/amd64, the pinned torch, Ray at the chart's rayVersion, a non-root user, the
`appliance` entrypoint and ports, the example configs at a fixed path.
(No docker daemon here or in CI: the image itself is built by `make image` where docker runs.)"""

from __future__ import annotations

import re
from pathlib import Path

import tomllib
import yaml
from packaging.requirements import Requirement

from tests.deploy.conftest import (
    CHART,
    DOCKERFILE,
    HADOLINT,
    ROOT,
    dockerfile_instructions,
    image_file,
    require,
    run,
)

instructions = dockerfile_instructions


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


def test_the_base_is_plain_ubuntu_and_torch_brings_its_own_cuda() -> None:
    """No nvidia/cuda base: its NVIDIA_REQUIRE_CUDA refuses drivers older than its CUDA, and its
    CUDA libraries duplicate the ones torch's wheel depends on."""
    froms = [rest for kw, rest in instructions() if kw == "FROM"]
    assert len(froms) == 2 and all(f.startswith("ubuntu:${UBUNTU_VERSION}") for f in froms)
    assert re.fullmatch(r"\d\d\.04", arg_default("UBUNTU_VERSION"))
    # torch 2.13.0's CUDA builds on the PyTorch index: cu126 and cu130 (no cu129).
    assert arg_default("TORCH_CUDA") in {"cu126", "cu130"}
    assert arg_default("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/${TORCH_CUDA}"
    assert "CUDA_VERSION" not in DOCKERFILE.read_text()


def test_the_image_starts_on_any_driver_and_gets_gpus_only_where_they_are_given() -> None:
    env = " ".join(rest for kw, rest in final_stage() if kw == "ENV")
    assert "NVIDIA_DISABLE_REQUIRE=1" in env
    assert "NVIDIA_DRIVER_CAPABILITIES=compute,utility" in env
    # The device plugin sets it per pod; `all` in the image would expose every GPU to the head.
    assert "NVIDIA_VISIBLE_DEVICES" not in env and "NVIDIA_REQUIRE_CUDA" not in env


def test_every_docker_build_targets_linux_amd64() -> None:
    """An arm64 image (docker build on Apple silicon) fails with exec format error on g5/g6e."""
    builds = [
        line.strip()
        for path in (ROOT / "deploy.mk", ROOT / "scripts" / "deploy.sh")
        for line in path.read_text().splitlines()
        if re.search(r"\bdocker build\b", line) and not line.lstrip().startswith(("#", "echo"))
    ]
    assert len(builds) == 2, builds
    assert all("--platform linux/amd64" in b for b in builds), builds


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
    for source in copied:  # each COPY source is an allowed path or inside one
        assert any(source == a or source.startswith(f"{a}/") for a in allowed), source
    assert {"pyproject.toml", "setup.py", "appliance"} <= copied


def test_the_build_stage_compiles_the_quantizers_and_the_runtime_stage_can_build_triton() -> None:
    """setup.py's C extension (appliance/quant/_quantize.c) is optional, so an image built without a
    compiler would still build and quietly load --base-quant models ~5x slower: the build stage
    installs gcc and Python's headers and fails unless the extension imports. The runtime stage
    has them too: Triton builds its CUDA launcher with them at the first kernel launch (without
    them the fused dequant falls back to PyTorch, and torch.compile and flex_attention fail)."""
    steps = instructions()
    last_from = max(i for i, (kw, _) in enumerate(steps) if kw == "FROM")
    build, runtime = steps[:last_from], steps[last_from:]
    build_runs = " ".join(rest for kw, rest in build if kw == "RUN")
    for package in ("gcc", "libc6-dev", "python3-dev"):
        assert re.search(rf"apt-get install[^&]*\b{package}\b", build_runs), package
    install = next(
        rest for kw, rest in build if kw == "RUN" and "pip install" in rest and " . " in rest
    )
    assert "import torch, ray, appliance, appliance.quant._quantize" in install
    runtime_runs = " ".join(rest for kw, rest in runtime if kw == "RUN")
    for package in ("gcc", "libc6-dev", "python3-dev"):
        assert re.search(rf"apt-get install[^&]*\b{package}\b", runtime_runs), package


def test_ray_is_pinned_to_the_charts_ray_version() -> None:
    ray_version = yaml.safe_load((CHART / "values.yaml").read_text())["rayVersion"]
    assert arg_default("RAY_VERSION") == ray_version
    (install,) = [rest for kw, rest in instructions() if kw == "RUN" and "--constraint" in rest]
    assert '"ray[default]==${RAY_VERSION}"' in install
    assert "assert ray.__version__ == '${RAY_VERSION}'" in install  # the build checks it
    # ...and the pin is one the package itself accepts.
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (ray,) = [Requirement(r) for r in pyproject["project"]["dependencies"] if r.startswith("ray")]
    assert ray.specifier.contains(ray_version), (str(ray), ray_version)


def test_the_example_configs_land_at_a_fixed_path_in_the_image() -> None:
    configs = sorted((ROOT / "appliance" / "configs").glob("*.yaml"))
    assert configs
    for config in configs:
        assert image_file(f"/opt/appliance/configs/{config.name}") == config
    assert image_file("/opt/appliance/configs/70b.yaml") is None


def final_env() -> dict[str, str]:
    """The final stage's ENV, KEY=VALUE pairs (no spaces in the values)."""
    env = {}
    for kw, rest in final_stage():
        if kw == "ENV":
            env.update(pair.split("=", 1) for pair in rest.replace("\\", " ").split())
    return env


def test_the_caches_are_where_any_uid_can_write() -> None:
    """`docker run --user <uid>` (as docs/deploy.md suggests for a host-owned /runs) has HOME=/:
    the S3 cache and Triton's kernel cache must not default to ~ there."""
    env = final_env()
    runs = " ".join(rest for kw, rest in final_stage() if kw == "RUN")
    cache_dir = str(Path(env["APPLIANCE_S3_CACHE"]).parent)
    assert f"install -d -m 1777 {cache_dir}" in runs  # sticky and world-writable, as /tmp
    assert env["TRITON_CACHE_DIR"].startswith("/tmp/")
