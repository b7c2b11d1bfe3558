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
    KUBERAY_CRD_VERSION,
    ROOT,
    SCHEMAS,
    SHELLCHECK,
    TERRAFORM,
    crd_errors,
    entrypoint_config,
    helm_template,
    kubernetes_validate,
    require,
    run,
    unquote,
)

INSTANCE = {"a10": "g5.8xlarge", "4090": "g6e.8xlarge"}
CLOUD_TOOLS = ("terraform", "aws", "docker", "kubectl", "helm")
DEPLOY_SH = ROOT / "scripts" / "deploy.sh"


def make_command() -> list[str]:
    """The lead's Makefile includes deploy.mk; before it exists, use deploy.mk directly."""
    makefile = ROOT / "Makefile"
    if makefile.exists() and "include deploy.mk" in makefile.read_text():
        return ["make", "--no-print-directory"]
    return ["make", "--no-print-directory", "-f", "deploy.mk"]


def executable(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def traps(tmp_path: Path) -> dict[str, str]:
    """Environment whose cloud CLIs, and helm, are traps that record any call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls.log"
    for tool in CLOUD_TOOLS:
        executable(bin_dir / tool, f'#!/bin/sh\necho "{tool} $*" >> {calls}\nexit 97\n')
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "HELM": str(bin_dir / "helm"),
        "DEPLOY_OUT_DIR": str(tmp_path / "out"),
        "CALLS": str(calls),
    }


@pytest.fixture
def sandbox(traps: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """The traps, but with a real helm whose calls are recorded."""
    helm = tmp_path / "bin" / "helm-recorded"
    executable(helm, f'#!/bin/sh\necho "helm $*" >> {traps["CALLS"]}\nexec {require(HELM)} "$@"\n')
    return {**traps, "HELM": str(helm)}


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


def terraform_apply(output: str) -> str:
    """The one `terraform apply` command a dry run printed."""
    (apply,) = [
        c for c in printed_commands(output) if c.startswith("terraform -chdir=terraform apply")
    ]
    return apply


def tool_calls(env: dict[str, str]) -> list[str]:
    calls = Path(env["CALLS"])
    return calls.read_text().splitlines() if calls.exists() else []


def rendered(env: dict[str, str]) -> dict[str, dict]:
    """The dry run's rendered manifests, by kind."""
    files = sorted((Path(env["DEPLOY_OUT_DIR"]) / "manifests").rglob("*.yaml"))
    return {d["kind"]: d for f in files for d in yaml.safe_load_all(f.read_text()) if d}


def instance_sizes() -> dict[str, tuple[int, str, str, str]]:
    """deploy.sh's GPU_INSTANCE_SIZES table: type -> (GPUs, cpu, memory, shmSize)."""
    table = re.search(r'^GPU_INSTANCE_SIZES="\n(.*?)^"', DEPLOY_SH.read_text(), re.M | re.S)
    assert table, "GPU_INSTANCE_SIZES not found in scripts/deploy.sh"
    rows = [line.split() for line in table.group(1).splitlines() if line.strip()]
    return {t: (int(g), c, m, s) for t, g, c, m, s in rows}


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
    repo = f"000000000000.dkr.ecr.us-east-1.amazonaws.com/{cluster}"
    kubectl = f"kubectl --kubeconfig {out}/kubeconfig --context {cluster}"
    expected_in_order = [
        "terraform -chdir=terraform init",
        f"terraform -chdir=terraform workspace select -or-create=true {gpu_class}",
        f"terraform -chdir=terraform apply -input=false -var gpu_class={gpu_class}",
        "terraform -chdir=terraform output -raw cluster_name",
        "terraform -chdir=terraform output -raw irsa_role_arn",
        f"aws eks update-kubeconfig --name {cluster} --region us-east-1 --alias {cluster} "
        f"--kubeconfig {out}/kubeconfig",
        f"aws ecr describe-images --region us-east-1 --repository-name {cluster} --image-ids imageTag=",
        "aws ecr get-login-password --region us-east-1 | docker login --username AWS",
        f"docker build --platform linux/amd64 -t {repo}:",
        f"docker push {repo}:",
        f"{kubectl} apply --server-side --force-conflicts -f deploy/kuberay/crds",
        "helm repo add kuberay https://ray-project.github.io/kuberay-helm/",
        f"helm upgrade --install kuberay-operator kuberay/kuberay-operator --version {KUBERAY_CRD_VERSION}",
        "helm upgrade --install prometheus prometheus-community/kube-prometheus-stack --version ",
        f"helm template appliance helm/appliance --namespace appliance -f {out}/values.generated.yaml",
        f"{kubectl} get rayjob appliance-train --namespace appliance",
        f"helm upgrade --install appliance helm/appliance --create-namespace --namespace appliance -f {out}/values.generated.yaml",
    ]
    position = 0
    for expected in expected_in_order:
        matches = [i for i, c in enumerate(commands) if c.startswith(expected) and i >= position]
        assert matches, f"not printed (in order): {expected}\n" + "\n".join(commands)
        position = matches[0]
    # The printed commands use deploy.sh's own kubeconfig, by its absolute path.
    hints = [line.strip() for line in result.stdout.splitlines() if "kubectl " in line]
    with_kubeconfig = f"KUBECONFIG={out}/kubeconfig kubectl "
    assert (
        f"{with_kubeconfig}port-forward -n prometheus-system svc/prometheus-grafana 3000:80"
        in hints
    )
    assert f"{with_kubeconfig}port-forward -n appliance svc/appliance-head-svc 8265:8265" in hints
    token = "get secret -n appliance appliance -o jsonpath='{.data.auth_token}' | base64 -d"
    assert f"{with_kubeconfig}{token}" in hints  # the Secret KubeRay names after the RayCluster
    assert [h for h in hints if not h.startswith(("+ ", with_kubeconfig))] == []

    # Every helm and kubectl call that reaches a cluster names this class's kubeconfig and context.
    for command in commands:
        if command.startswith(("helm upgrade", "helm uninstall")):
            assert command.endswith(f"--kubeconfig {out}/kubeconfig --kube-context {cluster}")
        if command.startswith("kubectl"):
            assert command.startswith(f"{kubectl} "), command
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
    core = [
        f
        for f in files
        if any(d and d["kind"] == "ServiceAccount" for d in yaml.safe_load_all(f.read_text()))
    ]
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
    spec = stack["prometheus"]["prometheusSpec"]
    assert spec["podMonitorSelectorNilUsesHelmValues"] is False
    # Prometheus keeps its data on a volume (EBS, provisioned by terraform's EBS CSI add-on).
    claim = spec["storageSpec"]["volumeClaimTemplate"]["spec"]
    assert claim["storageClassName"] == "gp2" and claim["resources"]["requests"]["storage"]
    assert spec["retention"] and spec["retentionSize"]
    # its volume goes with it: `helm uninstall` would leave a billed EBS volume behind
    assert spec["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete"}


def test_job_arguments_and_extra_values_reach_the_rendered_chart(sandbox, tmp_path) -> None:
    config = tmp_path / "train.yaml"
    config.write_text("lora_rank: 8\nseq_len: 512\n")
    extra = tmp_path / "extra-values.yaml"
    extra.write_text("worker:\n  replicas: 2\nrayTokenAuth: false\n")
    args = [
        "MODEL=s3://b/m",
        "DATA=s3://b/d",
        "OUTPUT=s3://b/o",
        "STEPS=7",
        f"TRAIN_CONFIG={config}",
        f"CHART_VALUES={extra}",
    ]
    result = dry_run("deploy", sandbox, "GPU_CLASS=a10", *args)
    assert result.returncode == 0, result.stdout
    manifests = Path(sandbox["DEPLOY_OUT_DIR"]) / "manifests" / "appliance" / "templates"
    job = yaml.safe_load((manifests / "rayjob.yaml").read_text())
    entrypoint = job["spec"]["entrypoint"]
    for expected in ("--model s3://b/m", "--data s3://b/d", "--output s3://b/o", "--steps 7"):
        assert expected in entrypoint
    assert "--config /etc/appliance/train.yaml" in entrypoint
    config_map = yaml.safe_load((manifests / "train-config.yaml").read_text())
    assert yaml.safe_load(config_map["data"]["train.yaml"]) == {"lora_rank": 8, "seq_len": 512}
    # What `appliance train` makes of that command line and config on the head.
    cfg = entrypoint_config(list(rendered(sandbox).values()))
    assert (cfg.lora_rank, cfg.seq_len, cfg.steps, cfg.model) == (8, 512, 7, "s3://b/m")
    cluster = yaml.safe_load((manifests / "raycluster.yaml").read_text())
    assert cluster["spec"]["workerGroupSpecs"][0]["replicas"] == 2  # CHART_VALUES applied
    # rayTokenAuth off: no authOptions, and no token for the hints to read
    assert "authOptions" not in cluster["spec"] and "auth_token" not in result.stdout
    assert "port-forward -n appliance svc/appliance-head-svc 8265:8265" in result.stdout


@pytest.mark.parametrize("gpu_class", ["a10", "4090"])
def test_destroy_dry_run_uninstalls_the_releases_before_terraform_destroy(
    sandbox, gpu_class
) -> None:
    result = dry_run("destroy", sandbox, f"GPU_CLASS={gpu_class}", "FORCE=1")
    assert result.returncode == 0, result.stdout
    commands = printed_commands(result.stdout)
    workspace = f"terraform -chdir=terraform workspace select -or-create=true {gpu_class}"
    (state_list,) = [
        i for i, c in enumerate(commands) if c.startswith("terraform -chdir=terraform state list")
    ]
    assert commands.index(workspace) < state_list
    uninstall = [i for i, c in enumerate(commands) if c.startswith("helm uninstall")]
    (destroy,) = [
        i for i, c in enumerate(commands) if c.startswith("terraform -chdir=terraform destroy")
    ]
    assert len(uninstall) == 3 and max(uninstall) < destroy
    assert commands[uninstall[0]].startswith("helm uninstall appliance --namespace appliance")
    kubeconfig = f"--kubeconfig {sandbox['DEPLOY_OUT_DIR']}/kubeconfig"
    context = f"{kubeconfig} --kube-context appliance-{gpu_class}"
    assert all(commands[i].endswith(context) for i in uninstall)
    kubectl = f"kubectl {kubeconfig} --context appliance-{gpu_class}"
    # a running job is stopped the graceful way (a last checkpoint) before its release goes
    (stop,) = [i for i, c in enumerate(commands) if c.startswith(f"{kubectl} exec ")]
    assert stop < uninstall[0]
    assert commands[stop].endswith("-c ray-head -- python -m appliance.cluster.jobstop")
    (pvcs,) = [i for i, c in enumerate(commands) if c.startswith(f"{kubectl} delete pvc --all")]
    assert uninstall[1] < pvcs < destroy  # after Prometheus, before the cluster goes
    assert "--namespace prometheus-system" in commands[pvcs]
    # FORCE: only the bucket needs force_destroy first; the image repository always goes.
    assert commands[destroy - 1].endswith("-var force_destroy=true -target=aws_s3_bucket.this")
    assert commands[destroy].endswith(f"-var gpu_class={gpu_class}")
    assert tool_calls(sandbox) == ["helm version"]


def test_an_unknown_gpu_class_stops_before_any_command(traps) -> None:
    result = dry_run("deploy", traps, "GPU_CLASS=h100")
    assert result.returncode != 0
    assert "GPU_CLASS must be a10 or 4090 (got 'h100')" in result.stdout
    assert printed_commands(result.stdout) == []
    assert tool_calls(traps) == []


def test_the_default_job_config_is_accepted_by_appliance_train(sandbox) -> None:
    assert dry_run("deploy", sandbox, "GPU_CLASS=4090").returncode == 0
    cfg = entrypoint_config(list(rendered(sandbox).values()))
    assert cfg.cluster == "auto" and cfg.model.startswith("s3://appliance-4090-dry-run-bucket/")


@pytest.mark.parametrize(
    ("release", "fullname"), [("foo", "foo-appliance"), ("my-appliance", "my-appliance")]
)
def test_the_printed_names_are_the_ones_the_chart_gives_a_release(
    sandbox, release, fullname
) -> None:
    result = dry_run("deploy", sandbox, "GPU_CLASS=a10", f"RELEASE={release}")
    assert result.returncode == 0, result.stdout
    docs = rendered(sandbox)
    assert docs["RayCluster"]["metadata"]["name"] == fullname
    assert docs["RayJob"]["metadata"]["name"] == f"{fullname}-train"
    assert f"kubectl logs -n appliance -f job/{fullname}-train" in result.stdout
    assert f"svc/{fullname}-head-svc 8265:8265" in result.stdout
    assert f"helm upgrade --install {release} helm/appliance" in result.stdout


def test_a_dry_run_says_what_to_upload_before_the_job_can_succeed(sandbox) -> None:
    result = dry_run("deploy", sandbox, "GPU_CLASS=a10")
    assert result.returncode == 0, result.stdout
    bucket = "s3://appliance-a10-dry-run-bucket"
    entrypoint = rendered(sandbox)["RayJob"]["spec"]["entrypoint"]
    assert f"--model {bucket}/models/base" in entrypoint
    assert f"--data {bucket}/data" in entrypoint
    assert "Before the training job can succeed, upload" in result.stdout
    assert f"aws s3 sync /path/to/base-model {bucket}/models/base" in result.stdout
    assert f"aws s3 sync /path/to/data-dir {bucket}/data" in result.stdout


def test_with_model_and_data_given_no_upload_is_asked_for(sandbox) -> None:
    result = dry_run("deploy", sandbox, "GPU_CLASS=a10", "MODEL=s3://b/m", "DATA=s3://b/d")
    assert result.returncode == 0, result.stdout
    assert "aws s3 sync" not in result.stdout


def test_a_gpu_instance_type_reaches_terraform_and_sizes_the_chart(sandbox) -> None:
    result = dry_run("deploy", sandbox, "GPU_CLASS=a10", "GPU_INSTANCE_TYPE=g5.12xlarge")
    assert result.returncode == 0, result.stdout
    apply = terraform_apply(result.stdout)
    assert apply.endswith("-var gpu_class=a10 -var gpu_instance_type=g5.12xlarge")
    (group,) = rendered(sandbox)["RayCluster"]["spec"]["workerGroupSpecs"]
    spec = group["template"]["spec"]
    gpus, cpu, memory, shm = instance_sizes()["g5.12xlarge"]
    assert gpus == 4
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "g5.12xlarge"}
    limits = spec["containers"][0]["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["cpu"], limits["memory"]) == (gpus, cpu, memory)
    assert group["rayStartParams"]["num-gpus"] == "4"
    (shm_volume,) = [v for v in spec["volumes"] if v["name"] == "shm"]
    assert shm_volume["emptyDir"]["sizeLimit"] == shm


@pytest.mark.parametrize(
    ("gpu_class", "instance_type"), [("a10", "p4d.24xlarge"), ("a10", "g6e.12xlarge")]
)
def test_an_instance_type_the_script_cannot_size_is_refused_before_any_command(
    traps, gpu_class, instance_type
) -> None:
    result = dry_run(
        "deploy", traps, f"GPU_CLASS={gpu_class}", f"GPU_INSTANCE_TYPE={instance_type}"
    )
    assert result.returncode != 0
    (line,) = [out for out in result.stdout.splitlines() if "GPU_INSTANCE_TYPE" in out]
    assert f"GPU_INSTANCE_TYPE={instance_type} is not a GPU_CLASS={gpu_class} instance type" in line
    known = line.split("known: ")[1].split()
    assert "g5.2xlarge" in known and "g5.12xlarge" in known
    assert not [t for t in known if not t.startswith("g5.")]
    assert printed_commands(result.stdout) == [] and tool_calls(traps) == []


def test_every_instance_size_the_script_knows_renders_and_leaves_room_per_trainer() -> None:
    """Each row passes the chart's own checks, and memory covers /dev/shm (one weight store per
    node) plus 8Gi and 4Gi per extra trainer (one per GPU)."""
    presets = yaml.safe_load((CHART / "values.yaml").read_text())["gpuClasses"]
    for instance_type, (gpus, cpu, memory, shm) in instance_sizes().items():
        memory_gi, shm_gi = int(memory.removesuffix("Gi")), int(shm.removesuffix("Gi"))
        assert memory_gi >= shm_gi + 8 + 4 * (gpus - 1), instance_type
        assert int(cpu) >= 4, instance_type
        gpu_class = "a10" if instance_type.startswith("g5.") else "4090"
        helm_template(
            sets={
                "gpuClass": gpu_class,
                "job.enabled": "false",
                "gpuClassOverrides.instanceType": instance_type,
                "gpuClassOverrides.gpusPerNode": str(gpus),
                "gpuClassOverrides.cpu": cpu,
                "gpuClassOverrides.memory": memory,
                "gpuClassOverrides.shmSize": shm,
            }
        )
        preset = presets[gpu_class]
        if preset["instanceType"] == instance_type:  # the chart's own sizes for its presets
            assert (gpus, cpu, memory, shm) == (
                preset["gpusPerNode"], preset["cpu"], preset["memory"], preset["shmSize"]
            )  # fmt: skip


def test_the_scripts_pass_shellcheck() -> None:
    scripts = [*sorted((ROOT / "scripts").glob("*.sh")), ROOT / "benchmarks" / "gpu_proof.sh"]
    assert ROOT / "scripts" / "deploy.sh" in scripts
    result = run([require(SHELLCHECK), *scripts])
    assert result.returncode == 0, result.stdout


def test_the_pinned_kuberay_is_the_one_whose_crds_the_repository_holds() -> None:
    script = DEPLOY_SH.read_text()
    (kuberay,) = re.findall(r'^KUBERAY_VERSION="\$\{KUBERAY_VERSION:-([0-9.]+)\}"', script, re.M)
    assert kuberay == KUBERAY_CRD_VERSION
    assert tuple(map(int, kuberay.split("."))) >= (1, 6)  # RayCluster upgradeStrategy
    readme = (SCHEMAS.parent / "README.md").read_text()
    assert f"v{kuberay}" in readme and "github.com/ray-project/kuberay" in readme
    for path in sorted(SCHEMAS.glob("*.yaml")):  # what `kubectl apply -f` gets (~1 MB each)
        head = path.read_text()[:600]
        assert "\nkind: CustomResourceDefinition\n" in head and "\n  group: ray.io\n" in head
    assert {p.name for p in SCHEMAS.glob("*.yaml")} == {
        "ray.io_rayclusters.yaml",
        "ray.io_rayjobs.yaml",
    }
    # kube-prometheus-stack is pinned too: an unpinned chart moves under a redeploy.
    (stack,) = re.findall(
        r'^KUBE_PROMETHEUS_STACK_VERSION="\$\{KUBE_PROMETHEUS_STACK_VERSION:-(.*)\}"', script, re.M
    )
    assert re.fullmatch(r"\d+\.\d+\.\d+", stack)


def test_a_dry_run_shows_the_last_deploys_settings_and_saves_none(sandbox) -> None:
    out = Path(sandbox["DEPLOY_OUT_DIR"])
    out.mkdir()
    settings = out / "deploy.env"
    settings.write_text("GPU_INSTANCE_TYPE='g5.12xlarge'\n")
    result = dry_run("deploy", sandbox, "GPU_CLASS=a10", "STEPS=9")
    assert result.returncode == 0, result.stdout
    apply = terraform_apply(result.stdout)
    assert apply.endswith("-var gpu_class=a10 -var gpu_instance_type=g5.12xlarge")
    assert f"Settings from the last deploy ({settings}): GPU_INSTANCE_TYPE=g5.12xlarge" in (
        result.stdout
    )
    # a dry run deploys nothing, so it is no "last deploy": nothing is written
    assert settings.read_text() == "GPU_INSTANCE_TYPE='g5.12xlarge'\n"
    assert not (out / "releases").exists()
