"""Shared helpers for the deployment checks: tool paths, helm rendering, schema validation.

The tools come from `bash scripts/install-tools.sh` (run by `make test` and `make deploy-tools`):
.tools/bin/helm, .venv-tools/bin/{checkov,hadolint,kubernetes-validate,shellcheck}, .tools/node;
where those are absent, the same tool on PATH is used. A test whose tool is truly absent is
skipped with the command that installs it.
"""

from __future__ import annotations

import copy
import functools
import json
import re
import shlex
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "appliance"
TERRAFORM = ROOT / "terraform"
# KubeRay's CRDs of the release scripts/deploy.sh installs (deploy/kuberay/README.md: source).
SCHEMAS = ROOT / "deploy" / "kuberay" / "crds"
KUBERAY_CRD_VERSION = "1.7.0"

# Where python-hcl2 is missing (the GPU machine's image), the modules that import it at the top
# are not collected: tests/conftest.py's pytest_ignore_collect.

TOOLS_VENV = ROOT / ".venv-tools" / "bin"


def tool(local: Path) -> Path:
    """The repo-local tool (install-tools.sh) if it is there, else the same name on PATH, else
    the repo-local path (which `require` then skips on)."""
    if local.exists():
        return local
    found = shutil.which(local.name)
    return Path(found) if found else local


HELM = tool(ROOT / ".tools" / "bin" / "helm")
CHECKOV = tool(TOOLS_VENV / "checkov")
HADOLINT = tool(TOOLS_VENV / "hadolint")
KUBERNETES_VALIDATE = tool(TOOLS_VENV / "kubernetes-validate")
SHELLCHECK = tool(TOOLS_VENV / "shellcheck")
NODE_MODELS = ROOT / ".tools" / "node"
DOCKERFILE = ROOT / "Dockerfile"
PODMONITOR_VALIDATOR = Path(__file__).with_name("validate_podmonitor.mjs")

GPU_CLASSES = ("a10", "4090")
CI_VALUES = {cls: CHART / "ci" / f"{cls}-values.yaml" for cls in GPU_CLASSES}
CRD_KINDS = {"RayCluster", "RayJob", "PodMonitor"}
INSTALL_HINT = "run `bash scripts/install-tools.sh` (make deploy-tools)"


def require(path: Path) -> Path:
    """Skip the calling test when a tool binary is absent (make test installs them first)."""
    if not path.exists():
        pytest.skip(f"{path.relative_to(ROOT)} is not installed (nor on PATH): {INSTALL_HINT}")
    return path


def run(cmd: list[str | Path], **kwargs: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(c) for c in cmd], capture_output=True, text=True, cwd=kwargs.pop("cwd", ROOT), **kwargs
    )


def helm_template(
    *values_files: Path,
    sets: dict[str, str] | None = None,
    api_versions: tuple[str, ...] = (),
    chart: Path = CHART,
    release: str = "appliance",
    namespace: str = "appliance",
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    cmd: list[str | Path] = [require(HELM), "template", release, chart, "--namespace", namespace]
    for f in values_files:
        cmd += ["-f", f]
    for key, value in (sets or {}).items():
        cmd += ["--set", f"{key}={value}"]
    for api in api_versions:
        cmd += ["--api-versions", api]
    result = run(cmd)
    if check:
        assert result.returncode == 0, result.stderr
    return result


def render(*values_files: Path, **kwargs: Any) -> list[dict[str, Any]]:
    """`helm template` → the list of rendered objects."""
    out = helm_template(*values_files, **kwargs).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = by_kind(docs, kind)
    assert len(found) == 1, f"expected one {kind}, rendered {len(found)}"
    return found[0]


def _strict(schema: Any) -> Any:
    """Reject unknown fields, as the API server does under kubectl's default --validate=strict:
    every object schema that lists properties gets additionalProperties: false, unless it
    preserves unknown fields or already says what extra keys may hold."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    return schema


@functools.cache
def crd_validator(kind: str, version: str = "v1") -> Any:
    """A jsonschema validator for a KubeRay kind from the repository's copy of the CRDs
    (deploy/kuberay/crds), strict about fields."""
    import jsonschema

    crd_file = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}[kind]
    path = SCHEMAS / crd_file
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRDs are ~1 MB of YAML
    crd = yaml.load(path.read_text(), Loader=loader)
    assert crd["spec"]["names"]["kind"] == kind
    (ver,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(copy.deepcopy(ver["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def crd_errors(doc: dict[str, Any]) -> list[str]:
    api_group, version = doc["apiVersion"].split("/")
    assert api_group == "ray.io", doc["apiVersion"]
    validator = crd_validator(doc["kind"], version)
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(doc)
    ]


def kubernetes_validate(files: list[Path], k8s_version: str) -> subprocess.CompletedProcess[str]:
    return run([require(KUBERNETES_VALIDATE), "--strict", "-k", k8s_version, *files])


def podmonitor_validate(
    docs: list[dict[str, Any]], tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    if not (NODE_MODELS / "node_modules" / "@kubernetes-models" / "prometheus-operator").exists():
        pytest.skip(f".tools/node has no PodMonitor schema: {INSTALL_HINT}")
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not on PATH (it comes with npm, which install-tools.sh needs)")
    payload = tmp_path / "podmonitors.json"
    payload.write_text(json.dumps(docs))
    return run([node, PODMONITOR_VALIDATOR, NODE_MODELS, payload])


def unquote(value: Any) -> Any:
    """python-hcl2 keeps HCL's quotes and ${} around values: strip them, recursively."""
    if isinstance(value, str):
        if len(value) >= 2 and value[0] == value[-1] == '"':
            return value[1:-1]
        if value.startswith("${") and value.endswith("}"):
            return value[2:-1]
        return value
    if isinstance(value, list):
        return [unquote(v) for v in value]
    if isinstance(value, dict):
        return {unquote(k): unquote(v) for k, v in value.items() if k != "__is_block__"}
    return value


# -- the image and the job's command line --------------------------------------------------------


def dockerfile_instructions(path: Path = DOCKERFILE) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            out.append((keyword.upper(), rest.strip()))
    return out


def image_file(path: str) -> Path | None:
    """The repository file that lands at `path` in the final image, through the final stage's
    `COPY <context dir>/ <image dir>/` instructions; None when no COPY puts a file there."""
    steps = dockerfile_instructions()
    last_from = max(i for i, (kw, _) in enumerate(steps) if kw == "FROM")
    for keyword, rest in steps[last_from:]:
        if keyword != "COPY" or rest.startswith("--from"):
            continue
        *sources, dest = rest.split()
        for source in sources:
            if source.endswith("/") and dest.endswith("/") and path.startswith(dest):
                candidate = ROOT / source / path[len(dest) :]
                if candidate.is_file():
                    return candidate
    return None


def trainer_node_resource() -> str:
    """The Ray custom resource `appliance train --cluster` places trainers by."""
    try:
        from appliance.cluster.start import TRAINER_NODE_RESOURCE
    except ImportError:  # before the cluster module, it lived in the driver
        from appliance.run.driver import TRAINER_NODE_RESOURCE
    return TRAINER_NODE_RESOURCE


def entrypoint_config(docs: list[dict[str, Any]]) -> Any:
    """Parse the rendered RayJob's entrypoint with the real `appliance train` command-line parser,
    read its --config where the driver would find it (a ConfigMap mounted on the head, or a file
    the image ships) and build the run's config: appliance.config.build_config, which raises
    ConfigError on an unknown key or a bad value, as `appliance train` would at run time."""
    from appliance import config as C
    from appliance.cli.main import train as train_command

    (job,) = [d for d in docs if d["kind"] == "RayJob"]
    args = shlex.split(job["spec"]["entrypoint"])
    assert args[:2] == ["appliance", "train"], args
    params = train_command.make_context("train", args[2:]).params
    config_path = params.pop("config_file")
    file_values: dict[str, Any] = {}
    if config_path is not None:
        file_values = yaml.safe_load(config_text(docs, config_path)) or {}
        assert isinstance(file_values, dict), config_path
    return C.build_config(file_values, params, source=f"--config {config_path}")


def config_text(docs: list[dict[str, Any]], path: str) -> str:
    """The contents the driver (on the Ray head) reads at `path`: from a ConfigMap volume mounted
    on the head, else from the image (see image_file)."""
    (cluster,) = [d for d in docs if d["kind"] == "RayCluster"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    volumes = {v["name"]: v for v in head.get("volumes", [])}
    for mount in head["containers"][0].get("volumeMounts", []):
        directory = mount["mountPath"].rstrip("/") + "/"
        config_map = volumes[mount["name"]].get("configMap")
        if config_map and path.startswith(directory):
            (data,) = [
                d["data"]
                for d in docs
                if d["kind"] == "ConfigMap" and d["metadata"]["name"] == config_map["name"]
            ]
            return data[path[len(directory) :]]
    source = image_file(path)
    assert source is not None, f"--config {path} is neither mounted on the head nor in the image"
    return source.read_text()
