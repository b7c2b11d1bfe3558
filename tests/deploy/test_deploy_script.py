"""`make deploy DRY_RUN=1` / `make destroy DRY_RUN=1`: every command printed, the chart rendered
into a directory, and no cloud touched (terraform, aws, docker and kubectl on PATH are traps
that record any call; helm is wrapped to record which subcommands ran)."""

from __future__ import annotations

import os
import re
import stat
import subprocess
from pathlib import Path

import hcl2
import pytest
import yaml

from tests.deploy.conftest import (
    CHART,
    HELM,
    ROOT,
    TERRAFORM,
    crd_errors,
    kubernetes_validate,
    require,
    run,
    unquote,
)

SHELLCHECK = ROOT / ".venv-tools" / "bin" / "shellcheck"
INSTANCE = {"a10": "g5.8xlarge", "4090": "g6e.8xlarge"}


def make_command() -> list[str]:
    """The lead's Makefile includes deploy.mk; before it exists, use deploy.mk directly."""
    makefile = ROOT / "Makefile"
    if makefile.exists() and "include deploy.mk" in makefile.read_text():
        return ["make", "--no-print-directory"]
    return ["make", "--no-print-directory", "-f", "deploy.mk"]


@pytest.fixture
def sandbox(tmp_path: Path) -> dict[str, str]:
    """Environment whose cloud CLIs are traps and whose helm is recorded."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    for tool in ("terraform", "aws", "docker", "kubectl"):
        trap = bin_dir / tool
        trap.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexit 97\n')
        trap.chmod(trap.stat().st_mode | stat.S_IEXEC)
    helm = bin_dir / "helm-recorded"
    helm.write_text(f'#!/bin/sh\necho "helm $*" >> {calls}\nexec {require(HELM)} "$@"\n')
    helm.chmod(helm.stat().st_mode | stat.S_IEXEC)
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HELM": str(helm),
        "DEPLOY_OUT_DIR": str(tmp_path / "out"),
        "CALLS": str(calls),
    }


def dry_run(target: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*make_command(), target, "DRY_RUN=1", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,  # one stream, in the order it was printed
        text=True,
        timeout=120,
    )


def printed_commands(output: str) -> list[str]:
    return [line[2:] for line in output.splitlines() if line.startswith("+ ")]


def tool_calls(env: dict[str, str]) -> list[str]:
    calls = Path(env["CALLS"])
    return calls.read_text().splitlines() if calls.exists() else []


def terraform_default(name: str) -> str:
    with open(TERRAFORM / "variables.tf") as f:
        variables = unquote(hcl2.load(f))["variable"]
    (default,) = [v[name]["default"] for v in variables if name in v]
    return default


@pytest.mark.parametrize("gpu_class", ["a10", "4090"])
def test_deploy_dry_run_prints_every_step_and_renders_the_chart(sandbox, gpu_class) -> None:
    result = dry_run("deploy", sandbox, f"GPU_CLASS={gpu_class}")
    assert result.returncode == 0, result.stdout
    commands = printed_commands(result.stdout)
    out = Path(sandbox["DEPLOY_OUT_DIR"])
    cluster = f"appliance-{gpu_class}"
    expected_in_order = [
        "terraform -chdir=terraform init",
        f"terraform -chdir=terraform apply -input=false -var gpu_class={gpu_class}",
        "terraform -chdir=terraform output -raw cluster_name",
        "terraform -chdir=terraform output -raw irsa_role_arn",
        f"aws eks update-kubeconfig --name {cluster} --region us-east-1",
        "aws ecr get-login-password --region us-east-1 | docker login --username AWS",
        f"docker build -t 000000000000.dkr.ecr.us-east-1.amazonaws.com/{cluster}:",
        f"docker push 000000000000.dkr.ecr.us-east-1.amazonaws.com/{cluster}:",
        "helm repo add kuberay https://ray-project.github.io/kuberay-helm/",
        "helm upgrade --install kuberay-operator kuberay/kuberay-operator --version",
        "helm upgrade --install prometheus prometheus-community/kube-prometheus-stack",
        f"helm template appliance helm/appliance --namespace appliance -f {out}/values.generated.yaml",
        f"helm upgrade --install appliance helm/appliance --create-namespace --namespace appliance -f {out}/values.generated.yaml",
    ]
    position = 0
    for expected in expected_in_order:
        matches = [i for i, c in enumerate(commands) if c.startswith(expected) and i >= position]
        assert matches, f"not printed (in order): {expected}\n" + "\n".join(commands)
        position = matches[0]
    assert (
        "kubectl port-forward -n prometheus-system svc/prometheus-grafana 3000:80" in result.stdout
    )
    assert "kubectl port-forward -n appliance svc/appliance-head-svc 8265:8265" in result.stdout

    # No cloud was touched: the traps never ran, and helm only rendered.
    assert tool_calls(sandbox) == [c for c in tool_calls(sandbox) if c.startswith("helm ")]
    assert {c.split()[1] for c in tool_calls(sandbox)} == {"version", "template"}


@pytest.mark.parametrize("gpu_class", ["a10", "4090"])
def test_the_dry_runs_manifests_wire_terraforms_outputs_into_the_chart(sandbox, gpu_class) -> None:
    assert dry_run("deploy", sandbox, f"GPU_CLASS={gpu_class}").returncode == 0
    out = Path(sandbox["DEPLOY_OUT_DIR"])
    files = sorted((out / "manifests").rglob("*.yaml"))
    docs = {d["kind"]: d for f in files for d in yaml.safe_load_all(f.read_text()) if d}
    assert {"RayCluster", "RayJob", "ServiceAccount", "PodMonitor"} <= set(docs)
    for kind in ("RayCluster", "RayJob"):
        assert crd_errors(docs[kind]) == []
    core = [f for f in files if yaml.safe_load(f.read_text())["kind"] == "ServiceAccount"]
    assert kubernetes_validate(core, f"{terraform_default('kubernetes_version')}.0").returncode == 0

    # IRSA: the ServiceAccount the chart creates is the one the role trusts, and carries the role.
    account = docs["ServiceAccount"]["metadata"]
    assert account["name"] == terraform_default("service_account_name")
    assert account["annotations"]["eks.amazonaws.com/role-arn"].startswith("arn:aws:iam::")
    # Workers go to the node group's instance type; the image is the pushed ECR image.
    (group,) = docs["RayCluster"]["spec"]["workerGroupSpecs"]
    assert group["template"]["spec"]["nodeSelector"] == {
        "node.kubernetes.io/instance-type": INSTANCE[gpu_class]
    }
    image = group["template"]["spec"]["containers"][0]["image"]
    assert re.fullmatch(
        rf"000000000000\.dkr\.ecr\.us-east-1\.amazonaws\.com/appliance-{gpu_class}:\S+", image
    )
    bucket = f"appliance-{gpu_class}-dry-run-bucket"
    assert f"--output s3://{bucket}/runs/" in docs["RayJob"]["spec"]["entrypoint"]

    # Grafana's sidecar looks for the label the chart puts on its dashboards.
    stack = yaml.safe_load((out / "kube-prometheus-stack.values.yaml").read_text())
    sidecar = stack["grafana"]["sidecar"]["dashboards"]
    chart_labels = yaml.safe_load((CHART / "values.yaml").read_text())["monitoring"]["dashboards"][
        "labels"
    ]
    assert chart_labels == {sidecar["label"]: sidecar["labelValue"]}
    assert stack["prometheus"]["prometheusSpec"]["podMonitorSelectorNilUsesHelmValues"] is False


def test_job_arguments_and_extra_values_reach_the_rendered_chart(sandbox, tmp_path) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("lora:\n  rank: 8\n")
    extra = tmp_path / "extra-values.yaml"
    extra.write_text("worker:\n  replicas: 2\n")
    args = [
        "MODEL=s3://b/m",
        "DATA=s3://b/d",
        "OUTPUT=s3://b/o",
        "STEPS=7",
        f"TRAIN_CONFIG={config}",
        f"CHART_VALUES={extra}",
    ]
    assert dry_run("deploy", sandbox, "GPU_CLASS=a10", *args).returncode == 0
    manifests = Path(sandbox["DEPLOY_OUT_DIR"]) / "manifests" / "appliance" / "templates"
    job = yaml.safe_load((manifests / "rayjob.yaml").read_text())
    entrypoint = job["spec"]["entrypoint"]
    for expected in ("--model s3://b/m", "--data s3://b/d", "--output s3://b/o", "--steps 7"):
        assert expected in entrypoint
    assert "--config /etc/appliance/train.yaml" in entrypoint
    config_map = yaml.safe_load((manifests / "train-config.yaml").read_text())
    assert yaml.safe_load(config_map["data"]["train.yaml"]) == {"lora": {"rank": 8}}
    cluster = yaml.safe_load((manifests / "raycluster.yaml").read_text())
    assert cluster["spec"]["workerGroupSpecs"][0]["replicas"] == 2  # CHART_VALUES applied


def test_destroy_dry_run_uninstalls_the_releases_before_terraform_destroy(sandbox) -> None:
    result = dry_run("destroy", sandbox, "GPU_CLASS=4090", "FORCE=1")
    assert result.returncode == 0, result.stdout
    commands = printed_commands(result.stdout)
    uninstall = [i for i, c in enumerate(commands) if c.startswith("helm uninstall")]
    (destroy,) = [
        i for i, c in enumerate(commands) if c.startswith("terraform -chdir=terraform destroy")
    ]
    assert len(uninstall) == 3 and max(uninstall) < destroy
    assert commands[uninstall[0]].startswith("helm uninstall appliance --namespace appliance")
    assert "-var force_destroy=true" in commands[destroy - 1]
    assert tool_calls(sandbox) == ["helm version"]


def test_an_unknown_gpu_class_stops_before_any_command(sandbox) -> None:
    result = dry_run("deploy", sandbox, "GPU_CLASS=h100")
    assert result.returncode != 0
    assert "GPU_CLASS must be a10 or 4090 (got 'h100')" in result.stdout
    assert printed_commands(result.stdout) == []


def test_the_scripts_pass_shellcheck() -> None:
    scripts = [ROOT / "scripts" / "deploy.sh", ROOT / "scripts" / "install-tools.sh"]
    result = run([require(SHELLCHECK), *scripts])
    assert result.returncode == 0, result.stdout
