"""The Helm chart (helm/appliance): lint, render for each GPU class with monitoring on and off,
validate every object (kubernetes-validate; the KubeRay CRD schemas; the PodMonitor schema),
and check what the pods get: GPUs, /dev/shm, node selection, image, IRSA, metrics, dashboards."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

import hcl2
import pytest
import yaml

from appliance.errors import ConfigError
from tests.deploy.conftest import (
    CHART,
    CI_VALUES,
    CRD_KINDS,
    GPU_CLASSES,
    HELM,
    TERRAFORM,
    by_kind,
    crd_errors,
    entrypoint_config,
    helm_template,
    image_file,
    kubernetes_validate,
    one,
    podmonitor_validate,
    render,
    require,
    run,
    trainer_node_resource,
    unquote,
)

GIB = 1024**3
SCRIPTS = CHART.parents[1] / "scripts"
PRESETS = {  # what values.yaml promises per class
    "a10": {"instanceType": "g5.8xlarge", "shm": "100Gi", "gpus": 1},
    "4090": {"instanceType": "g6e.8xlarge", "shm": "200Gi", "gpus": 1},
}
MONITORING = {"monitoring-on": "true", "monitoring-off": "false"}


@pytest.fixture(scope="module")
def renders() -> dict[tuple[str, str], list[dict[str, Any]]]:
    """Every GPU class × monitoring forced on/off, rendered from the chart's ci/ values."""
    return {
        (cls, mon): render(CI_VALUES[cls], sets={"monitoring.podMonitor.enabled": flag})
        for cls in GPU_CLASSES
        for mon, flag in MONITORING.items()
    }


def head_pod(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]


def worker_pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [g["template"] for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]]


def all_pods(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    pods = [head_pod(docs), *worker_pods(docs)]
    pods += [j["spec"]["submitterPodTemplate"] for j in by_kind(docs, "RayJob")]
    return pods


def train_config_maps(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"].endswith("-train-config")
    ]


def volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (vol,) = [v for v in pod["spec"]["volumes"] if v["name"] == name]
    return vol


def gibibytes(quantity: str) -> int:
    assert quantity.endswith("Gi"), quantity
    return int(quantity[:-2])


def ray_start_resources(params: dict[str, str]) -> dict[str, Any]:
    """The custom resources `ray start` gets: KubeRay runs `ray start ... --resources=<value>`
    through a shell, so the value is shell-unquoted before it is JSON."""
    (arg,) = shlex.split(f"--resources={params['resources']}")
    return json.loads(arg.split("=", 1)[1])


def terraform_kubernetes_version() -> str:
    """The EKS version Terraform deploys: what the core objects must be valid for."""
    with open(TERRAFORM / "variables.tf") as f:
        variables = unquote(hcl2.load(f))["variable"]
    (default,) = [
        v["kubernetes_version"]["default"] for v in variables if "kubernetes_version" in v
    ]
    return f"{default}.0"


# -- lint and schemas ----------------------------------------------------------------------------


@pytest.mark.parametrize("values", ["defaults", *GPU_CLASSES])
def test_helm_lint_strict_passes(values: str) -> None:
    cmd = [require(HELM), "lint", "--strict", CHART]
    if values != "defaults":
        cmd += ["-f", CI_VALUES[values]]
    result = run(cmd)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_every_core_object_is_valid_for_the_clusters_kubernetes_version(renders, tmp_path) -> None:
    files, expected = [], set()
    for (cls, mon), docs in renders.items():
        for i, doc in enumerate(d for d in docs if d["kind"] not in CRD_KINDS):
            path = tmp_path / f"{cls}-{mon}-{i}.yaml"
            path.write_text(yaml.safe_dump(doc))
            files.append(path)
            expected.add(f"{doc['kind'].lower()}/{doc['metadata']['name']}")
    assert {e.split("/")[0] for e in expected} >= {"serviceaccount", "configmap"}
    result = kubernetes_validate(files, terraform_kubernetes_version())
    assert result.returncode == 0, result.stdout + result.stderr
    passed = set(re.findall(r"passed for resource (\S+)", result.stdout + result.stderr))
    assert passed == expected


def test_every_raycluster_and_rayjob_matches_the_kuberay_crd_schema(renders) -> None:
    checked = 0
    for key, docs in renders.items():
        for doc in docs:
            if doc["apiVersion"].startswith("ray.io/"):
                assert crd_errors(doc) == [], (key, doc["kind"])
                checked += 1
    assert checked == 2 * len(renders)  # a RayCluster and a RayJob in each


def test_the_crd_check_rejects_a_misspelled_field_and_a_wrong_type(renders) -> None:
    cluster = one(renders[("a10", "monitoring-on")], "RayCluster")
    cluster["spec"]["headGroupSpec"]["rayStartParam"] = {"num-cpus": "0"}
    cluster["spec"]["workerGroupSpecs"][0]["replicas"] = "one"
    errors = "\n".join(crd_errors(cluster))
    assert "'rayStartParam' was unexpected" in errors
    assert "'one' is not of type 'integer'" in errors


def test_the_podmonitor_matches_the_prometheus_operator_schema(renders, tmp_path) -> None:
    monitors = [one(renders[(cls, "monitoring-on")], "PodMonitor") for cls in GPU_CLASSES]
    result = podmonitor_validate(monitors, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("ok ") == len(monitors)
    broken = json.loads(json.dumps(monitors[0]))
    broken["spec"]["podMetricsEndpoints"][0]["interval"] = 15
    assert podmonitor_validate([broken], tmp_path).returncode == 1


# -- what the pods get ---------------------------------------------------------------------------


@pytest.mark.parametrize("cls", GPU_CLASSES)
def test_gpu_workers_request_and_limit_the_presets_gpus_and_the_head_none(renders, cls) -> None:
    docs = renders[(cls, "monitoring-on")]
    for pod in worker_pods(docs):
        (container,) = pod["spec"]["containers"]
        for bound in ("requests", "limits"):
            assert container["resources"][bound]["nvidia.com/gpu"] == PRESETS[cls]["gpus"]
    cluster = one(docs, "RayCluster")
    (group,) = cluster["spec"]["workerGroupSpecs"]
    assert group["rayStartParams"]["num-gpus"] == str(PRESETS[cls]["gpus"])
    (head,) = head_pod(docs)["spec"]["containers"]
    assert "nvidia.com/gpu" not in json.dumps(head["resources"])
    assert cluster["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"


@pytest.mark.parametrize("cls", GPU_CLASSES)
def test_worker_shm_is_a_memory_backed_emptydir_that_holds_the_object_store(renders, cls) -> None:
    docs = renders[(cls, "monitoring-on")]
    (group,) = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    pod = group["template"]
    shm = volume(pod, "shm")["emptyDir"]
    assert shm == {"medium": "Memory", "sizeLimit": PRESETS[cls]["shm"]}
    (container,) = pod["spec"]["containers"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # The weight store lives in Ray's object store, which must fit in /dev/shm...
    object_store = int(group["rayStartParams"]["object-store-memory"])
    assert object_store == (gibibytes(shm["sizeLimit"]) - 4) * GIB
    # ...and a memory-backed emptyDir counts against the memory limit, so leave headroom.
    memory = gibibytes(container["resources"]["limits"]["memory"])
    assert memory == gibibytes(container["resources"]["requests"]["memory"])
    assert memory >= gibibytes(shm["sizeLimit"]) + 8


@pytest.mark.parametrize("cls", GPU_CLASSES)
def test_the_heads_object_store_fits_in_its_memory_backed_shm(renders, cls) -> None:
    head = one(renders[(cls, "monitoring-on")], "RayCluster")["spec"]["headGroupSpec"]
    shm = volume(head["template"], "shm")["emptyDir"]
    assert shm["medium"] == "Memory"
    (container,) = head["template"]["spec"]["containers"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    # Without object-store-memory Ray would take 30% of the pod's memory: more than /dev/shm.
    object_store = int(head["rayStartParams"]["object-store-memory"])
    assert object_store == (gibibytes(shm["sizeLimit"]) - 1) * GIB
    assert gibibytes(container["resources"]["limits"]["memory"]) > gibibytes(shm["sizeLimit"])


def test_a_bigger_head_shm_gets_a_bigger_head_object_store_and_a_tiny_one_is_refused() -> None:
    docs = render(CI_VALUES["a10"], sets={"head.shmSize": "4Gi"})
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["object-store-memory"] == str(3 * GIB)
    result = helm_template(CI_VALUES["a10"], sets={"head.shmSize": "1Gi"}, check=False)
    assert result.returncode != 0
    assert "head.shmSize (1Gi) must be at least 2Gi" in result.stderr


@pytest.mark.parametrize("cls", GPU_CLASSES)
def test_gpu_workers_carry_the_custom_resource_appliance_places_trainers_by(renders, cls) -> None:
    cluster = one(renders[(cls, "monitoring-on")], "RayCluster")["spec"]
    (group,) = cluster["workerGroupSpecs"]
    assert ray_start_resources(group["rayStartParams"]) == {trainer_node_resource(): 1}
    assert "resources" not in cluster["headGroupSpec"]["rayStartParams"]


def test_extra_worker_custom_resources_join_the_trainer_node_resource() -> None:
    docs = render(CI_VALUES["a10"], sets={"worker.customResources.spot": "2"})
    (group,) = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    assert ray_start_resources(group["rayStartParams"]) == {trainer_node_resource(): 1, "spot": 2}
    assert crd_errors(one(docs, "RayCluster")) == []


def test_worker_ray_start_resources_that_would_drop_the_trainer_resource_are_refused() -> None:
    result = helm_template(
        CI_VALUES["a10"], sets={"worker.rayStartParams.resources": '{"x": 1}'}, check=False
    )
    assert result.returncode != 0
    assert "put custom resources in worker.customResources instead" in result.stderr


@pytest.mark.parametrize("cls", GPU_CLASSES)
def test_workers_land_on_the_gpu_class_instance_type_and_tolerate_the_gpu_taint(
    renders, cls
) -> None:
    for pod in worker_pods(renders[(cls, "monitoring-off")]):
        spec = pod["spec"]
        assert spec["nodeSelector"] == {
            "node.kubernetes.io/instance-type": PRESETS[cls]["instanceType"]
        }
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
            "tolerations"
        ]
    assert "nodeSelector" not in head_pod(renders[(cls, "monitoring-off")])["spec"]


def test_a_custom_node_selector_replaces_the_instance_type_selector() -> None:
    docs = render(CI_VALUES["a10"], sets={"worker.nodeSelector.appliance\\.dev/gpu-class": "a10"})
    for pod in worker_pods(docs):
        assert pod["spec"]["nodeSelector"] == {"appliance.dev/gpu-class": "a10"}


def test_gpu_class_overrides_resize_the_workers_and_their_object_store() -> None:
    docs = render(
        CI_VALUES["a10"],
        sets={
            "gpuClassOverrides.instanceType": "g5.12xlarge",
            "gpuClassOverrides.gpusPerNode": "4",
            "gpuClassOverrides.memory": "180Gi",
            "gpuClassOverrides.shmSize": "160Gi",
        },
    )
    (group,) = one(docs, "RayCluster")["spec"]["workerGroupSpecs"]
    spec = group["template"]["spec"]
    assert spec["nodeSelector"] == {"node.kubernetes.io/instance-type": "g5.12xlarge"}
    assert spec["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4
    assert volume(group["template"], "shm")["emptyDir"]["sizeLimit"] == "160Gi"
    assert group["rayStartParams"]["object-store-memory"] == str(156 * GIB)


def test_gpu_class_4090_may_be_given_as_a_number_on_the_command_line() -> None:
    docs = render(CI_VALUES["a10"], sets={"gpuClass": "4090"})  # --set makes it an int
    for pod in worker_pods(docs):
        assert pod["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "g6e.8xlarge"


@pytest.mark.parametrize("cls", GPU_CLASSES)
def test_every_container_runs_the_configured_image(renders, cls) -> None:
    values = yaml.safe_load(CI_VALUES[cls].read_text())
    image = f"{values['image']['repository']}:{values['image']['tag']}"
    pods = all_pods(renders[(cls, "monitoring-on")])
    assert len(pods) == 3  # head, GPU workers, job submitter
    for pod in pods:
        assert [c["image"] for c in pod["spec"]["containers"]] == [image]


def test_the_image_tag_defaults_to_the_charts_app_version() -> None:
    app_version = yaml.safe_load((CHART / "Chart.yaml").read_text())["appVersion"]
    docs = render(CI_VALUES["a10"], sets={"image.tag": ""})
    for pod in all_pods(docs):
        assert pod["spec"]["containers"][0]["image"].endswith(f":{app_version}")


def test_every_pod_runs_as_the_irsa_service_account_as_non_root(renders) -> None:
    docs = renders[("a10", "monitoring-on")]
    account = one(docs, "ServiceAccount")
    role = yaml.safe_load(CI_VALUES["a10"].read_text())["serviceAccount"]["roleArn"]
    assert account["metadata"]["annotations"]["eks.amazonaws.com/role-arn"] == role
    for pod in all_pods(docs):
        assert pod["spec"]["serviceAccountName"] == account["metadata"]["name"]
        assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
        for container in pod["spec"]["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False


def test_without_a_role_arn_the_service_account_has_no_irsa_annotation() -> None:
    docs = render(CI_VALUES["a10"], sets={"serviceAccount.roleArn": ""})
    assert "eks.amazonaws.com/role-arn" not in json.dumps(one(docs, "ServiceAccount"))


def test_a_release_that_reuses_the_service_account_creates_none_and_runs_as_it() -> None:
    """serviceAccount.create=false: what `make deploy RELEASE=foo` sets when another release of
    the stack owns the ServiceAccount the IRSA role trusts (Helm refuses to adopt it)."""
    docs = render(
        CI_VALUES["a10"],
        release="foo",
        sets={"serviceAccount.create": "false", "serviceAccount.name": "appliance"},
    )
    assert by_kind(docs, "ServiceAccount") == []
    for pod in all_pods(docs):
        assert pod["spec"]["serviceAccountName"] == "appliance"


def test_dashboards_have_fixed_uids_so_only_one_release_may_install_them() -> None:
    """Every release would ship the same dashboard uids (Grafana keeps one dashboard per uid);
    they filter by cluster, so one set serves every release: `make deploy` installs them with
    the first release only, and monitoring.dashboards.enabled=false leaves them out."""

    def uids(docs: list[dict[str, Any]]) -> set[str]:
        maps = [
            d for d in by_kind(docs, "ConfigMap") if "grafana_dashboard" in d["metadata"]["labels"]
        ]
        return {json.loads(text)["uid"] for m in maps for text in m["data"].values()}

    first = uids(render(CI_VALUES["a10"], release="appliance"))
    assert first and first == uids(render(CI_VALUES["a10"], release="foo"))
    off = render(CI_VALUES["a10"], release="foo", sets={"monitoring.dashboards.enabled": "false"})
    assert uids(off) == set()


# -- the training job ----------------------------------------------------------------------------


def test_the_rayjob_runs_appliance_train_on_the_charts_cluster_with_the_job_args(renders) -> None:
    docs = renders[("a10", "monitoring-on")]
    job, cluster = one(docs, "RayJob"), one(docs, "RayCluster")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    job_values = yaml.safe_load(CI_VALUES["a10"].read_text())["job"]
    assert shlex.split(job["spec"]["entrypoint"]) == [
        "appliance", "train", "--cluster", "auto",
        "--model", job_values["model"],
        "--data", job_values["data"],
        "--output", job_values["output"],
        "--config", "/etc/appliance/train.yaml",
        "--steps", "100",
        "--auto-resume",
    ]  # fmt: skip
    # The inline config reaches the head (where the driver runs) at that path.
    (config,) = train_config_maps(docs)
    assert yaml.safe_load(config["data"]["train.yaml"]) == yaml.safe_load(job_values["config"])
    head = head_pod(docs)
    assert volume(head, "train-config")["configMap"]["name"] == config["metadata"]["name"]
    mounts = head["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "train-config", "mountPath": "/etc/appliance", "readOnly": True} in mounts


def test_a_config_file_from_the_image_and_extra_args_reach_the_entrypoint(renders) -> None:
    docs = renders[("4090", "monitoring-off")]
    args = shlex.split(one(docs, "RayJob")["spec"]["entrypoint"])
    assert args[args.index("--config") + 1] == "/opt/appliance/configs/llama3-8b-4090.yaml"
    assert args[-2:] == ["--gpu-memory-budget", "24GiB"]
    assert "--steps" not in args  # steps: null leaves the config's value
    assert train_config_maps(docs) == []  # no inline config, nothing mounted


@pytest.mark.parametrize("cls", GPU_CLASSES)
def test_appliance_train_accepts_the_ci_jobs_command_line_and_config(renders, cls) -> None:
    docs = renders[(cls, "monitoring-on")]
    job = yaml.safe_load(CI_VALUES[cls].read_text())["job"]
    cfg = entrypoint_config(docs)
    assert (cfg.cluster, cfg.model, cfg.data, cfg.output) == (
        "auto", job["model"], job["data"], job["output"]
    )  # fmt: skip
    assert cfg.auto_resume  # a rerun of the job continues its run, the first one starts it
    if "config" in job:  # inline: the ConfigMap on the head
        assert cfg.lora_rank == yaml.safe_load(job["config"])["lora_rank"]
        assert cfg.steps == job["steps"]
    else:  # the image's file; the flag overrides its gpu_memory_budget
        assert cfg.seq_len == 4096 and cfg.gpu_memory_budget == "24GiB"


def test_every_config_file_the_ci_values_name_is_in_the_image() -> None:
    named = 0
    for values_file in sorted((CHART / "ci").glob("*.yaml")):
        path = (yaml.safe_load(values_file.read_text()).get("job") or {}).get("configFile")
        if path:
            assert image_file(path) is not None, f"{values_file.name}: {path} is not in the image"
            named += 1
    assert named >= 1


def test_a_nested_config_that_appliance_train_would_reject_is_caught() -> None:
    docs = render(CI_VALUES["a10"], sets={"job.config": "lora:\n  rank: 16\n"})
    with pytest.raises(ConfigError, match="unknown key 'lora'"):
        entrypoint_config(docs)


def test_without_auto_resume_the_job_has_no_resume_flag() -> None:
    docs = render(CI_VALUES["a10"], sets={"job.autoResume": "false"})
    assert "--auto-resume" not in shlex.split(one(docs, "RayJob")["spec"]["entrypoint"])
    assert not entrypoint_config(docs).auto_resume


def test_arguments_with_spaces_are_quoted_for_the_shell() -> None:
    docs = render(
        CI_VALUES["a10"], sets={"job.extraArgs[0]": "--run-name", "job.extraArgs[1]": "my run"}
    )
    assert shlex.split(one(docs, "RayJob")["spec"]["entrypoint"])[-2:] == ["--run-name", "my run"]


def test_a_missing_model_uri_is_refused_with_the_value_to_set() -> None:
    result = helm_template(check=False)
    assert result.returncode != 0
    assert "job.model is required" in result.stderr


def test_with_the_job_disabled_only_the_cluster_is_installed() -> None:
    docs = render(sets={"job.enabled": "false"})
    assert by_kind(docs, "RayJob") == [] and len(by_kind(docs, "RayCluster")) == 1


# -- refusals ------------------------------------------------------------------------------------


def test_an_unknown_gpu_class_is_refused_naming_the_known_ones() -> None:
    result = helm_template(CI_VALUES["a10"], sets={"gpuClass": "h100"}, check=False)
    assert result.returncode != 0
    assert 'gpuClass "h100" is not one of: 4090, a10' in result.stderr


@pytest.mark.parametrize(
    "value, refusal",
    [
        ("job.steps=abc", "at '/job/steps': got string, want null or integer"),  # was --steps 0
        ("job.steps=-5", "at '/job/steps': minimum: got -5, want 1"),
        ("job.step=5", "at '/job': additional properties 'step' not allowed"),  # a typo: ignored
        ("worker.nodeSelectors.a=b", "at '/worker': additional properties 'nodeSelectors'"),
        ("worker.resources.limits.cpu=8", "at '/worker': additional properties 'resources'"),
        ("worker.replicas=0", "at '/worker/replicas': minimum: got 0, want 1"),  # waited forever
        ("gpuClassOverrides.gpusPerNode=0", "at '/gpuClassOverrides/gpusPerNode': minimum"),
        ("gpuClassOverrides.gpusPerNode=1.5", "at '/gpuClassOverrides/gpusPerNode': got"),
        ("gpuClassOverrides.cpu=lots", "at '/gpuClassOverrides/cpu': 'lots' does not match"),
        ("job.output=runs/a", "at '/job/output': 'runs/a' does not match pattern"),  # pod-local
    ],
)
def test_values_of_the_wrong_kind_or_unknown_keys_are_refused_naming_them(value, refusal) -> None:
    """values.schema.json: each of these rendered with exit 0, into a job that trained 0 steps,
    a cluster with no trainer, an output in a pod's own file system, or a value ignored."""
    key, _, setting = value.partition("=")
    result = helm_template(CI_VALUES["a10"], sets={key: setting}, check=False)
    assert result.returncode != 0
    assert refusal in result.stderr


@pytest.mark.parametrize(
    "release, refusal",
    [
        ("exp.1", 'the objects\' name "exp.1-appliance" is not a DNS label'),
        ("a-very-long-release-name-for-the-appliance-x", "is 44 characters: at most 40"),
        ("thirty-one-characters-release-x", "is 41 characters: at most 40"),
    ],
)
def test_a_release_whose_objects_name_is_no_dns_label_or_would_be_cut_is_refused(
    release, refusal
) -> None:
    """Names were cut to 40 characters, so two releases sharing their first 40 named the same
    objects; a dot gave a head service KubeRay cannot create."""
    result = helm_template(CI_VALUES["a10"], release=release, check=False)
    assert result.returncode != 0
    assert refusal in result.stderr
    assert one(render(CI_VALUES["a10"], release="a" * 30), "RayCluster")["metadata"]["name"] == (
        "a" * 30 + "-appliance"
    )


def test_worker_memory_must_leave_room_beside_shm() -> None:
    result = helm_template(
        CI_VALUES["a10"],
        sets={"gpuClassOverrides.memory": "100Gi", "gpuClassOverrides.shmSize": "96Gi"},
        check=False,
    )
    assert result.returncode != 0
    assert "must exceed shmSize (96Gi) by at least 8Gi" in result.stderr


def test_a_shm_size_not_in_gi_is_refused() -> None:
    result = helm_template(
        CI_VALUES["a10"], sets={"gpuClassOverrides.shmSize": "100G"}, check=False
    )
    assert result.returncode != 0
    assert "must be a whole number of Gi" in result.stderr


def test_the_longest_release_name_keeps_kuberay_names_short() -> None:
    release = "appliance-" + "x" * 30  # 40 characters: the objects' name, as it is
    name = one(render(CI_VALUES["a10"], release=release), "RayCluster")["metadata"]["name"]
    assert name == release
    assert len(f"{name}-head-svc") <= 63


# -- metrics and dashboards ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("setting", "api_present", "expected"),
    [
        ("auto", False, 0),
        ("auto", True, 1),
        ("true", False, 1),
        ("false", True, 0),
    ],
)
def test_the_podmonitor_follows_the_monitoring_api_unless_forced(
    setting, api_present, expected
) -> None:
    docs = render(
        CI_VALUES["a10"],
        sets={"monitoring.podMonitor.enabled": setting},
        api_versions=("monitoring.coreos.com/v1",) if api_present else (),
    )
    assert len(by_kind(docs, "PodMonitor")) == expected


def test_the_podmonitor_scrapes_port_8080_on_the_head_and_every_worker(renders) -> None:
    docs = renders[("a10", "monitoring-on")]
    monitor = one(docs, "PodMonitor")
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    cluster = one(docs, "RayCluster")["spec"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        labels = group["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items()
        ports = {
            p["name"]: p["containerPort"]
            for p in group["template"]["spec"]["containers"][0]["ports"]
        }
        assert ports[endpoint["port"]] == 8080
        assert group["rayStartParams"]["metrics-export-port"] == "8080"
    submitter = one(docs, "RayJob")["spec"]["submitterPodTemplate"]["metadata"]["labels"]
    assert not selector.items() <= submitter.items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["appliance"]}
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


def env_of(container: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


@pytest.mark.parametrize("cls", GPU_CLASSES)
def test_a_deleted_pod_stops_the_runs_jobs_within_its_grace_period(renders, cls) -> None:
    """Ray's job supervisor SIGKILLs a stopped driver after RAY_JOB_STOP_WAIT_TIME_S (3 s by
    default): the head raises it to gracefulStopSeconds; each Ray pod's preStop hook stops the
    cluster's jobs through the head and waits for them, inside the pod's grace period."""
    docs = renders[(cls, "monitoring-off")]
    cluster = one(docs, "RayCluster")["metadata"]["name"]
    head, workers = head_pod(docs), worker_pods(docs)
    for pod in (head, *workers):
        assert pod["spec"]["terminationGracePeriodSeconds"] == 900 + 60
        (container,) = pod["spec"]["containers"]
        assert env_of(container)["RAY_JOB_STOP_WAIT_TIME_S"] == "900"
    (head_container,) = head["spec"]["containers"]
    assert head_container["lifecycle"]["preStop"]["exec"]["command"] == [
        *("python", "-m", "appliance.cluster.jobstop")
    ]
    for pod in workers:
        (container,) = pod["spec"]["containers"]
        assert container["lifecycle"]["preStop"]["exec"]["command"] == [
            *("python", "-m", "appliance.cluster.jobstop", "--address"),
            f"http://{cluster}-head-svc:8265",  # KubeRay's name for the head's service
        ]


def test_the_pods_stop_hook_is_a_command_the_image_runs(renders) -> None:
    """The workers' preStop command line, run here (the image's `python` is the venv's, which
    has appliance): with no head to answer it says so and succeeds, so a pod whose cluster is
    already gone is not held for its grace period."""
    (pod, *_) = worker_pods(renders[("a10", "monitoring-off")])
    (container,) = pod["spec"]["containers"]
    python, *args = container["lifecycle"]["preStop"]["exec"]["command"]
    assert python == "python"
    args[args.index("--address") + 1] = "http://127.0.0.1:9"  # nothing listens on discard
    done = run([sys.executable, *args])
    assert done.returncode == 0, done.stderr
    assert "no Ray dashboard answers at http://127.0.0.1:9" in done.stdout


def test_graceful_stop_seconds_sets_the_wait_and_the_grace_period_and_zero_is_refused() -> None:
    docs = render(CI_VALUES["a10"], sets={"gracefulStopSeconds": "1800"})
    for pod in (head_pod(docs), *worker_pods(docs)):
        assert pod["spec"]["terminationGracePeriodSeconds"] == 1860
        assert env_of(pod["spec"]["containers"][0])["RAY_JOB_STOP_WAIT_TIME_S"] == "1800"
    refused = helm_template(CI_VALUES["a10"], sets={"gracefulStopSeconds": "0"}, check=False)
    assert refused.returncode != 0
    assert "gracefulStopSeconds must be a whole number of seconds >= 1 (got 0)" in refused.stderr


@pytest.mark.parametrize("cls", GPU_CLASSES)
def test_ray_token_authentication_is_on_unless_turned_off(renders, cls) -> None:
    """KubeRay (>= 1.5.1) makes the token and puts it in every Ray container when the RayCluster
    asks for it (the CRD schema test above checks the field); the notes say how to read it from
    the Secret KubeRay names after the cluster."""
    docs = renders[(cls, "monitoring-off")]
    cluster = one(docs, "RayCluster")
    assert cluster["spec"]["authOptions"] == {"mode": "token"}
    off = one(render(CI_VALUES[cls], sets={"rayTokenAuth": "false"}), "RayCluster")
    assert "authOptions" not in off["spec"]
    assert crd_errors(off) == []


def test_the_notes_say_how_to_read_the_ray_token() -> None:
    def notes(*sets: str) -> str:
        cmd = [require(HELM), "install", "appliance", CHART, "-n", "appliance"]
        cmd += ["-f", CI_VALUES["a10"], "--dry-run=client", *sets]
        result = run(cmd)
        assert result.returncode == 0, result.stderr
        return result.stdout.split("NOTES:", 1)[1]

    read = "kubectl get secret -n appliance appliance -o jsonpath='{.data.auth_token}' | base64 -d"
    assert read in notes()
    assert read in notes("--set", "job.enabled=false")  # for `ray job submit` from here too
    assert "export RAY_AUTH_MODE=token" in notes("--set", "job.enabled=false")
    assert "auth_token" not in notes("--set", "rayTokenAuth=false")


def test_the_ray_dashboard_listens_on_all_interfaces(renders) -> None:
    head = one(renders[("a10", "monitoring-off")], "RayCluster")["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "0.0.0.0"
    ports = {
        p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]
    }
    assert ports["dashboard"] == 8265


@pytest.fixture
def chart_copy(tmp_path: Path) -> Path:
    """The chart with one extra dashboard, so the glob is exercised whatever dashboards exist."""
    copy = tmp_path / "appliance"
    shutil.copytree(CHART, copy)
    (copy / "dashboards").mkdir(exist_ok=True)
    (copy / "dashboards" / "zz-test-dashboard.json").write_text(
        json.dumps({"title": 'test — ünïcode "quotes"\ttab', "panels": [{"id": 1}]}, indent=2)
    )
    return copy


def test_every_dashboard_json_lands_in_the_configmap_with_the_sidecar_label(chart_copy) -> None:
    docs = render(CI_VALUES["a10"], chart=chart_copy)
    (configmap,) = [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "appliance-dashboards"
    ]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    files = sorted((chart_copy / "dashboards").glob("*.json"))
    assert {f.name for f in files} == set(configmap["data"])
    for f in files:
        assert configmap["data"][f.name] == f.read_text()
        json.loads(configmap["data"][f.name])
    # A ConfigMap holds at most 1 MiB.
    assert len(json.dumps(configmap["data"]).encode()) < 1024 * 1024


def test_without_dashboard_files_no_dashboard_configmap_is_rendered(chart_copy) -> None:
    for f in (chart_copy / "dashboards").glob("*.json"):
        f.unlink()
    shutil.rmtree(chart_copy / "dashboards-ray")
    docs = render(CI_VALUES["a10"], chart=chart_copy)
    assert not [
        d for d in by_kind(docs, "ConfigMap") if "grafana_dashboard" in d["metadata"]["labels"]
    ]


def test_notes_say_how_to_watch_the_run() -> None:
    result = run(
        [
            require(HELM),
            "install",
            "appliance",
            CHART,
            "-n",
            "appliance",
            "-f",
            CI_VALUES["a10"],
            "--dry-run=client",
        ]
    )
    assert result.returncode == 0, result.stderr
    notes = result.stdout.split("NOTES:", 1)[1]
    assert "kubectl port-forward -n appliance svc/appliance-head-svc 8265:8265" in notes
    assert "kubectl port-forward -n prometheus-system svc/prometheus-grafana 3000:80" in notes
    assert "kubectl logs -n appliance -f job/appliance-train" in notes


# -- values.yaml documentation -------------------------------------------------------------------


def test_every_value_is_documented_with_a_doc_comment() -> None:
    """KubeRay chart style: each value (or a section above it) has a `# --` comment."""
    undocumented, stack, comment = [], [], []
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            comment.append(stripped)
            continue
        match = re.match(r"^(\s*)([\w\"./-]+):", line)
        if not match or stripped.startswith("- "):
            comment = [] if not stripped else comment
            continue
        indent, key = len(match.group(1)), match.group(2).strip('"')
        stack = [(i, k, d) for i, k, d in stack if i < indent]
        documented = any(c.startswith("# --") for c in comment) or any(d for _, _, d in stack)
        stack.append((indent, key, documented))
        comment = []
        is_leaf = not re.match(r"^\s*[\w\"./-]+:\s*$", line)
        if is_leaf and not documented:
            undocumented.append(".".join(k for _, k, _ in stack))
    assert undocumented == []


def test_rays_own_dashboard_is_provisioned_for_the_ray_dashboards_metrics_tab(renders) -> None:
    """The Metrics tab embeds panels of Grafana dashboard uid rayDefaultDashboard: the chart ships
    the one the image's Ray generates, in its own folder."""
    docs = renders[("a10", "monitoring-on")]
    (configmap,) = [
        d for d in by_kind(docs, "ConfigMap") if d["metadata"]["name"] == "appliance-ray-dashboards"
    ]
    assert configmap["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert configmap["metadata"]["annotations"]["grafana_folder"] == "Ray"
    (content,) = configmap["data"].values()
    assert json.loads(content)["uid"] == "rayDefaultDashboard"
    assert len(json.dumps(configmap["data"]).encode()) < 1024 * 1024  # a ConfigMap's limit
    # ...generated by the Ray the image runs (the chart's rayVersion), as the script writes it.
    import importlib.util

    import ray

    spec = importlib.util.spec_from_file_location("ray_dashboards", SCRIPTS / "ray_dashboards.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    if ray.__version__ != yaml.safe_load((CHART / "values.yaml").read_text())["rayVersion"]:
        pytest.skip(f"installed ray {ray.__version__} is not the chart's rayVersion")
    assert content == script.generate(), "regenerate: python scripts/ray_dashboards.py"
    off = render(CI_VALUES["a10"], sets={"monitoring.dashboards.ray": "false"})
    assert "appliance-ray-dashboards" not in [d["metadata"]["name"] for d in off]


# -- upgrades -------------------------------------------------------------------------------------


def job_checksum(docs: list[dict[str, Any]]) -> str:
    return one(docs, "RayJob")["metadata"]["annotations"]["checksum/job"]


def test_a_changed_pod_spec_recreates_the_clusters_pods() -> None:
    """KubeRay >= 1.6 (the version make deploy pins) recreates every pod when the spec changes;
    a new training config changes the head's checksum annotation, hence the spec."""
    docs = render(CI_VALUES["a10"])
    assert one(docs, "RayCluster")["spec"]["upgradeStrategy"] == {"type": "Recreate"}
    other = render(CI_VALUES["a10"], sets={"job.config": "lora_rank: 4\n"})
    annotation = "checksum/train-config"
    assert (
        head_pod(docs)["metadata"]["annotations"][annotation]
        != head_pod(other)["metadata"]["annotations"][annotation]
    )
    assert (
        crd_errors(one(render(CI_VALUES["a10"], sets={"upgradeStrategy": "None"}), "RayCluster"))
        == []
    )
    bad = helm_template(CI_VALUES["a10"], sets={"upgradeStrategy": "Rolling"}, check=False)
    assert bad.returncode != 0 and "upgradeStrategy must be Recreate or None" in bad.stderr


def test_the_job_checksum_changes_with_what_the_job_runs_on_and_only_that() -> None:
    base = job_checksum(render(CI_VALUES["a10"]))
    changes = {
        "job.steps": "7",
        "job.config": "lora_rank: 4\n",
        "image.tag": "other",
        "job.extraArgs[0]": "--resume",
        # the cluster's pods are recreated (upgradeStrategy), which kills a running job
        "gpuClassOverrides.shmSize": "96Gi",
        "head.shmSize": "4Gi",
        "rayTokenAuth": "false",
    }
    for key, value in changes.items():
        assert job_checksum(render(CI_VALUES["a10"], sets={key: value})) != base, key
    for key, value in {"worker.replicas": "3", "monitoring.podMonitor.interval": "30s"}.items():
        assert job_checksum(render(CI_VALUES["a10"], sets={key: value})) == base, key
