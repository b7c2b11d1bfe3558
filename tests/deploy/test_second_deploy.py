"""`make deploy` and `make destroy` for real (no DRY_RUN), twice and out of order, against the
stand-ins of tests/deploy/fake_cloud.py: aws, docker, kubectl, helm and terraform that record each
call and answer as the real ones would (the tag already in ECR, the cluster already gone, an
output missing, a bucket that still holds checkpoints). The assertions are on the calls made and
their order."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.conftest import HELM, ROOT, require
from tests.deploy.test_deploy_script import CLOUD_TOOLS, make_command

FAKE = Path(__file__).with_name("fake_cloud.py")
ECR = "000000000000.dkr.ecr.us-east-1.amazonaws.com"


class Cloud:
    """The fake cloud's state directory and the environment that puts the fakes on PATH."""

    def __init__(self, tmp_path: Path):
        self.state = tmp_path / "cloud"
        self.state.mkdir()
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir()
        for tool in CLOUD_TOOLS:
            path = bin_dir / tool
            path.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "{FAKE}" {tool} "$@"\n')
            path.chmod(path.stat().st_mode | stat.S_IEXEC)
        self.out = tmp_path / "out"
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "HELM": str(bin_dir / "helm"),
            "REAL_HELM": str(require(HELM)),
            "FAKE_CLOUD": str(self.state),
            "AUTO_APPROVE": "1",
        }

    def make(self, target: str, *args: str) -> subprocess.CompletedProcess[str]:
        """`make TARGET ARGS...`, with only this call's tool calls left in the log."""
        (self.state / "calls.log").unlink(missing_ok=True)
        gpu_class = next((a.split("=")[1] for a in args if a.startswith("GPU_CLASS=")), "a10")
        return subprocess.run(
            [*make_command(), target, f"DEPLOY_OUT_DIR={self.out / gpu_class}", *args],
            cwd=ROOT,
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=120,
        )

    def calls(self) -> list[str]:
        log = self.state / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    def outputs(self, workspace: str) -> dict[str, str]:
        path = self.state / "tf" / workspace / "outputs.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def rendered_job_checksum(self, gpu_class: str) -> str:
        manifest = self.out / gpu_class / "manifests/appliance/templates/rayjob.yaml"
        (line,) = [x for x in manifest.read_text().splitlines() if "checksum/job:" in x]
        return line.split(":", 1)[1].strip()


@pytest.fixture
def cloud(tmp_path: Path) -> Cloud:
    return Cloud(tmp_path)


def in_order(calls: list[str], *expected: str) -> None:
    """Each expected prefix matches a call, in this order."""
    position = 0
    for prefix in expected:
        later = [i for i, c in enumerate(calls) if i >= position and c.startswith(prefix)]
        assert later, f"no call starting {prefix!r} after call {position}:\n" + "\n".join(calls)
        position = later[0] + 1


def starting(calls: list[str], prefix: str) -> list[str]:
    return [c for c in calls if c.startswith(prefix)]


@pytest.mark.integration
@pytest.mark.parametrize("gpu_class", ["a10", "4090"])
def test_a_second_deploy_reuses_the_image_and_reruns_the_job_only_when_it_changed(
    cloud, gpu_class
) -> None:
    cluster = f"appliance-{gpu_class}"
    kubectl = f"kubectl --kubeconfig {cloud.out / gpu_class / 'kubeconfig'} --context {cluster}"
    first = cloud.make("deploy", f"GPU_CLASS={gpu_class}")
    assert first.returncode == 0, first.stdout
    calls = cloud.calls()
    in_order(
        calls,
        "terraform -chdir=terraform init",
        f"terraform -chdir=terraform workspace select -or-create=true {gpu_class}",
        f"terraform -chdir=terraform apply -input=false -auto-approve -var gpu_class={gpu_class}",
        f"aws eks update-kubeconfig --name {cluster} --region us-east-1 --alias {cluster}",
        f"aws ecr describe-images --region us-east-1 --repository-name {cluster}",
        "aws ecr get-login-password",
        f"docker build --platform linux/amd64 -t {ECR}/{cluster}:",
        f"docker push {ECR}/{cluster}:",
        f"{kubectl} apply --server-side --force-conflicts -f deploy/kuberay/crds",
        "helm upgrade --install kuberay-operator kuberay/kuberay-operator --version 1.7.0",
        "helm upgrade --install prometheus prometheus-community/kube-prometheus-stack",
        "helm template appliance helm/appliance",
        f"{kubectl} get rayjob appliance-train",
        "helm upgrade --install appliance helm/appliance",
    )
    assert starting(calls, kubectl) == [c for c in calls if c.startswith("kubectl")]
    # Helm created the RayJob with the rendered checksum.
    checksum = cloud.rendered_job_checksum(gpu_class)
    (cloud.state / "rayjob-checksum").write_text(checksum)

    # The same deploy again: the tag is in ECR (IMMUTABLE: a push would be refused), so nothing
    # is built or pushed; the job is unchanged, so it is left alone (running or finished).
    second = cloud.make("deploy", f"GPU_CLASS={gpu_class}")
    assert second.returncode == 0, second.stdout
    calls = cloud.calls()
    assert starting(calls, "docker") == [] and starting(calls, "aws ecr get-login") == []
    assert "already in ECR (not rebuilt)" in second.stdout
    # only reads: nothing is deleted
    assert [c.removeprefix(kubectl).split()[:3] for c in starting(calls, "kubectl")] == [
        ["apply", "--server-side", "--force-conflicts"],
        ["get", "serviceaccount", "appliance"],
        ["get", "rayjob", "appliance-train"],
    ]
    assert "RayJob appliance-train: unchanged" in second.stdout
    assert (cloud.state / "rayjob-checksum").exists()

    # New job arguments, the job finished: the live RayJob is deleted before helm upgrades the
    # release (KubeRay would never resubmit it), and helm creates the new one.
    (cloud.state / "rayjob-status").write_text("Complete")
    third = cloud.make("deploy", f"GPU_CLASS={gpu_class}", "STEPS=7")
    assert third.returncode == 0, third.stdout
    calls = cloud.calls()
    in_order(
        calls,
        "helm template appliance helm/appliance",
        f"{kubectl} get rayjob appliance-train",
        f"{kubectl} delete rayjob appliance-train --namespace appliance --wait",
        "helm upgrade --install appliance helm/appliance",
    )
    assert not (cloud.state / "rayjob-checksum").exists()
    assert cloud.rendered_job_checksum(gpu_class) != checksum


@pytest.mark.integration
def test_rerun_deletes_an_unchanged_job_so_that_it_trains_again(cloud) -> None:
    assert cloud.make("deploy", "GPU_CLASS=a10").returncode == 0
    (cloud.state / "rayjob-checksum").write_text(cloud.rendered_job_checksum("a10"))
    (cloud.state / "rayjob-status").write_text("Failed")  # e.g. the data was not uploaded yet
    again = cloud.make("deploy", "GPU_CLASS=a10", "RERUN=1")
    assert again.returncode == 0, again.stdout
    in_order(
        cloud.calls(),
        f"kubectl --kubeconfig {cloud.out / 'a10/kubeconfig'} --context appliance-a10 get rayjob",
        f"kubectl --kubeconfig {cloud.out / 'a10/kubeconfig'} --context appliance-a10 delete rayjob",
        "helm upgrade --install appliance helm/appliance",
    )


@pytest.mark.integration
def test_the_subnet_zones_of_the_first_apply_are_kept_when_aws_offerings_change(cloud) -> None:
    """Left to terraform, the zones follow where AWS offers the GPU type today: a change there
    would plan to replace the subnets, the node groups and the cluster (the fake refuses that
    plan). A later deploy passes back the zones the stack has."""
    first = cloud.make("deploy", "GPU_CLASS=a10")
    assert first.returncode == 0, first.stdout
    (first_apply,) = starting(cloud.calls(), "terraform -chdir=terraform apply")
    assert "availability_zones" not in first_apply  # no stack yet: terraform picks them
    assert cloud.outputs("a10")["availability_zones"] == '["us-east-1a", "us-east-1b"]'

    (cloud.state / "gpu-zones").write_text("us-east-1c\nus-east-1d\n")
    again = cloud.make("deploy", "GPU_CLASS=a10")
    assert again.returncode == 0, again.stdout
    assert 'Subnet zones: ["us-east-1a", "us-east-1b"] (the stack\'s own, kept)' in again.stdout
    (apply,) = starting(cloud.calls(), "terraform -chdir=terraform apply")
    assert apply.endswith('-var availability_zones=["us-east-1a", "us-east-1b"]')
    assert cloud.outputs("a10")["availability_zones"] == '["us-east-1a", "us-east-1b"]'

    # a new class's stack (its own workspace) takes the zones offered now
    assert cloud.make("deploy", "GPU_CLASS=4090").returncode == 0
    assert cloud.outputs("4090")["availability_zones"] == '["us-east-1c", "us-east-1d"]'


@pytest.mark.integration
def test_a_redeploy_takes_in_the_eks_log_group_that_eks_recreated_after_a_destroy(cloud) -> None:
    assert cloud.make("deploy", "GPU_CLASS=a10").returncode == 0
    assert cloud.make("destroy", "GPU_CLASS=a10").returncode == 0
    (cloud.state / "eks-log-group-left").touch()  # EKS wrote its last logs after the destroy

    again = cloud.make("deploy", "GPU_CLASS=a10")
    assert again.returncode == 0, again.stdout
    assert "ResourceAlreadyExistsException" in again.stdout  # terraform's error is shown
    assert "The EKS log group /aws/eks/appliance-a10/cluster exists outside" in again.stdout
    apply = "terraform -chdir=terraform apply -input=false -auto-approve -var gpu_class=a10"
    in_order(
        cloud.calls(),
        apply,
        "terraform -chdir=terraform import -input=false -var gpu_class=a10 "
        "aws_cloudwatch_log_group.cluster /aws/eks/appliance-a10/cluster",
        apply,
        "helm upgrade --install",
    )
    assert cloud.outputs("a10")["cluster_name"] == "appliance-a10"

    # any other failure of the apply stops the deploy, naming what to do
    (cloud.state / "apply-error").write_text("Error: waiting for EKS Node Group: capacity")
    failed = cloud.make("deploy", "GPU_CLASS=a10")
    assert failed.returncode != 0
    assert "terraform apply failed (see above)" in failed.stdout
    assert starting(cloud.calls(), "terraform -chdir=terraform import") == []


@pytest.mark.integration
def test_the_two_gpu_classes_keep_separate_states(cloud) -> None:
    assert cloud.make("deploy", "GPU_CLASS=a10").returncode == 0
    # In one shared state, this apply would plan to replace the a10 stack (the fake refuses it).
    deploy_4090 = cloud.make("deploy", "GPU_CLASS=4090")
    assert deploy_4090.returncode == 0, deploy_4090.stdout
    assert cloud.outputs("a10")["cluster_name"] == "appliance-a10"
    assert cloud.outputs("4090")["cluster_name"] == "appliance-4090"

    destroy_4090 = cloud.make("destroy", "GPU_CLASS=4090")
    assert destroy_4090.returncode == 0, destroy_4090.stdout
    calls = cloud.calls()
    in_order(
        calls,
        "terraform -chdir=terraform workspace select -or-create=true 4090",
        "terraform -chdir=terraform state list",
        "aws eks update-kubeconfig --name appliance-4090 --region us-east-1 --alias appliance-4090",
        "helm uninstall appliance --namespace appliance --ignore-not-found --wait "
        f"--kubeconfig {cloud.out / '4090/kubeconfig'} --kube-context appliance-4090",
        "helm uninstall prometheus",
        "helm uninstall kuberay-operator",
        "terraform -chdir=terraform destroy -input=false -auto-approve -var gpu_class=4090",
    )
    assert not [c for c in calls if "appliance-a10" in c]
    assert cloud.outputs("4090") == {}
    assert cloud.outputs("a10")["cluster_name"] == "appliance-a10"  # untouched


@pytest.mark.integration
def test_destroy_stops_at_a_bucket_with_checkpoints_and_a_force_rerun_finishes(cloud) -> None:
    assert cloud.make("deploy", "GPU_CLASS=a10").returncode == 0
    (cloud.state / "bucket-objects").touch()

    first = cloud.make("destroy", "GPU_CLASS=a10")
    assert first.returncode != 0
    assert "rerun with FORCE=1" in first.stdout
    # The image repository is not what stopped it: it is deleted with its images.
    assert "aws_ecr_repository" not in first.stdout

    # The rerun: the cluster is gone and its outputs with it; every step before terraform
    # destroy is skipped instead of stopping the script.
    rerun = cloud.make("destroy", "GPU_CLASS=a10", "FORCE=1")
    assert rerun.returncode == 0, rerun.stdout
    calls = cloud.calls()
    in_order(
        calls,
        "terraform -chdir=terraform workspace select -or-create=true a10",
        "terraform -chdir=terraform state list",
        "terraform -chdir=terraform output -raw cluster_name",
        "terraform -chdir=terraform apply -input=false -auto-approve -var gpu_class=a10 "
        "-var force_destroy=true -target=aws_s3_bucket.this",
        "terraform -chdir=terraform destroy -input=false -auto-approve -var gpu_class=a10",
    )
    assert starting(calls, "helm uninstall") == [] and starting(calls, "aws eks") == []
    assert "no cluster_name/region output: the cluster is gone" in rerun.stdout
    assert cloud.outputs("a10") == {}


@pytest.mark.integration
def test_destroy_when_the_cluster_is_gone_but_its_outputs_remain(cloud) -> None:
    assert cloud.make("deploy", "GPU_CLASS=4090").returncode == 0
    (cloud.state / "clusters-gone").write_text("appliance-4090\n")
    result = cloud.make("destroy", "GPU_CLASS=4090")
    assert result.returncode == 0, result.stdout
    calls = cloud.calls()
    in_order(
        calls,
        "aws eks update-kubeconfig --name appliance-4090",
        "terraform -chdir=terraform destroy",
    )
    assert starting(calls, "helm uninstall") == []  # never against whatever context is current
    assert "cluster appliance-4090 does not answer" in result.stdout


@pytest.mark.integration
def test_destroying_a_class_that_was_never_deployed_does_nothing(cloud) -> None:
    result = cloud.make("destroy", "GPU_CLASS=4090", "FORCE=1")
    assert result.returncode == 0, result.stdout
    assert "nothing to destroy" in result.stdout
    assert cloud.calls() == [
        "helm version",
        "aws sts get-caller-identity --query Account --output text",
        "terraform -chdir=terraform init -input=false",
        "terraform -chdir=terraform workspace select -or-create=true 4090",
        "terraform -chdir=terraform state list",
    ]


@pytest.mark.integration
def test_without_credentials_or_the_registry_each_target_says_so_in_one_line(cloud) -> None:
    """Without AWS credentials `make deploy` went on to terraform, and without the provider
    registry it ended in three pages of terraform's errors with no word of its own; `make
    destroy` of a class never deployed from this checkout failed the same way."""
    (cloud.state / "no-credentials").touch()
    for target in ("deploy", "destroy"):
        result = cloud.make(target, "GPU_CLASS=a10")
        assert result.returncode != 0
        assert "deploy.sh: no working AWS credentials here" in result.stdout
        assert "aws configure" in result.stdout
        assert not starting(cloud.calls(), "terraform"), cloud.calls()
    (cloud.state / "no-credentials").unlink()
    (cloud.state / "offline").touch()
    result = cloud.make("deploy", "GPU_CLASS=a10")
    assert result.returncode != 0
    *_, last = [line for line in result.stdout.splitlines() if line.startswith("deploy.sh:")]
    assert last.startswith("deploy.sh: terraform init failed (above)")
    assert "registry.terraform.io" in last
    assert not starting(cloud.calls(), "terraform -chdir=terraform apply")
    result = cloud.make("destroy", "GPU_CLASS=a10")  # no state in this checkout: nothing to do
    assert result.returncode == 0, result.stdout
    assert "Nothing deployed for GPU class a10 from this checkout" in result.stdout
    assert not starting(cloud.calls(), "terraform -chdir=terraform destroy")


@pytest.mark.integration
def test_deploy_and_destroy_leave_the_users_kubeconfig_alone(cloud) -> None:
    """`aws eks update-kubeconfig` writes deploy.sh's own kubeconfig, never ~/.kube/config (whose
    current context would otherwise point at the new cluster, and after a destroy at a deleted
    one); every kubectl and helm call names that file (the fakes refuse any that does not)."""
    kubeconfig = cloud.out / "a10" / "kubeconfig"
    deploy = cloud.make("deploy", "GPU_CLASS=a10")
    assert deploy.returncode == 0, deploy.stdout
    calls = cloud.calls()
    (update,) = starting(calls, "aws eks update-kubeconfig")
    assert update.endswith(f"--alias appliance-a10 --kubeconfig {kubeconfig}")
    assert kubeconfig.read_text() == "current-context: appliance-a10\n"
    cluster_calls = [c for c in calls if c.startswith(("kubectl", "helm upgrade"))]
    assert cluster_calls and all(f"--kubeconfig {kubeconfig} " in c for c in cluster_calls)
    assert f"KUBECONFIG={kubeconfig} kubectl port-forward -n appliance" in deploy.stdout

    destroy = cloud.make("destroy", "GPU_CLASS=a10")
    assert destroy.returncode == 0, destroy.stdout
    uninstalls = starting(cloud.calls(), "helm uninstall")
    assert len(uninstalls) == 3 and all(f"--kubeconfig {kubeconfig} " in c for c in uninstalls)
    assert not kubeconfig.exists()  # its cluster is gone
    assert not (cloud.state / "user-kubeconfig").exists()


def set_release_history(cloud: Cloud, namespace: str, release: str, *statuses: str) -> None:
    path = cloud.state / "helm" / namespace / f"{release}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    history = [{"revision": i, "status": s} for i, s in enumerate(statuses, 1)]
    path.write_text(json.dumps(history))


@pytest.mark.integration
def test_releases_left_pending_by_an_interrupted_deploy_are_recovered_first(cloud) -> None:
    """A deploy killed mid-upgrade leaves its release pending-*; helm then refuses every upgrade
    ("another operation is in progress"). The next deploy rolls each such release back to its
    last deployed revision, or uninstalls one that never deployed, then upgrades it."""
    assert cloud.make("deploy", "GPU_CLASS=a10").returncode == 0
    set_release_history(
        cloud, "kuberay-system", "kuberay-operator", "superseded", "deployed", "pending-upgrade"
    )
    set_release_history(cloud, "prometheus-system", "prometheus", "deployed", "pending-rollback")
    set_release_history(cloud, "appliance", "appliance", "pending-install")

    again = cloud.make("deploy", "GPU_CLASS=a10")
    assert again.returncode == 0, again.stdout
    calls = cloud.calls()
    in_order(
        calls,
        "helm history kuberay-operator --namespace kuberay-system --output json --kubeconfig ",
        "helm rollback kuberay-operator 2 --namespace kuberay-system --kubeconfig ",
        "helm upgrade --install kuberay-operator",
        "helm history prometheus --namespace prometheus-system --output json",
        "helm rollback prometheus 1 --namespace prometheus-system",
        "helm upgrade --install prometheus",
        "helm history appliance --namespace appliance --output json",
        "helm uninstall appliance --namespace appliance --wait --kubeconfig ",
        "kubectl --kubeconfig",  # the RayJob is compared after the release is recovered
        "helm upgrade --install appliance",
    )
    assert "kuberay-operator is pending-upgrade at revision 3" in again.stdout
    assert "rolling it back to revision 2, its last deployed one" in again.stdout
    assert "appliance is pending-install at revision 1" in again.stdout
    assert "never deployed: uninstalling it" in again.stdout

    # Nothing pending: nothing is rolled back or uninstalled.
    third = cloud.make("deploy", "GPU_CLASS=a10")
    assert third.returncode == 0, third.stdout
    assert starting(cloud.calls(), "helm rollback") == []
    assert starting(cloud.calls(), "helm uninstall") == []


@pytest.mark.integration
def test_a_pending_release_with_nothing_to_roll_back_to_stops_the_deploy(cloud) -> None:
    assert cloud.make("deploy", "GPU_CLASS=a10").returncode == 0
    set_release_history(cloud, "appliance", "appliance", "failed", "pending-upgrade")
    result = cloud.make("deploy", "GPU_CLASS=a10")
    assert result.returncode != 0
    assert "appliance (namespace appliance) is pending-upgrade at revision 2" in result.stdout
    assert "helm history appliance -n appliance" in result.stdout
    assert starting(cloud.calls(), "helm upgrade --install appliance") == []


def owners(cloud: Cloud, namespace: str = "appliance") -> dict[str, str]:
    path = cloud.state / "owners" / f"{namespace}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def dashboard_config_maps(owned: dict[str, str]) -> dict[str, str]:
    return {o: r for o, r in owned.items() if o.startswith("ConfigMap/") and "dashboards" in o}


@pytest.mark.integration
def test_a_second_release_reuses_the_service_account_and_the_dashboards_of_the_first(
    cloud,
) -> None:
    """Every release must run as the ServiceAccount the IRSA role trusts; the first creates it
    (and the Grafana dashboards, whose uids are fixed); a second one (RELEASE=foo) reuses both,
    instead of failing on helm's "exists and cannot be imported into the current release"."""
    first = cloud.make("deploy", "GPU_CLASS=a10")
    assert first.returncode == 0, first.stdout
    dashboards = dashboard_config_maps(owners(cloud))
    assert set(dashboards) == {
        "ConfigMap/appliance-dashboards",
        "ConfigMap/appliance-ray-dashboards",
    }

    second = cloud.make("deploy", "GPU_CLASS=a10", "RELEASE=foo")
    assert second.returncode == 0, second.stdout
    assert (
        "ServiceAccount appliance and the Grafana dashboards belong to release appliance: "
        "release foo uses them and installs neither" in second.stdout
    )
    owned = owners(cloud)
    assert owned["ServiceAccount/appliance"] == "appliance"
    assert (
        owned["RayCluster/foo-appliance"] == "foo" and owned["RayJob/foo-appliance-train"] == "foo"
    )
    assert dashboard_config_maps(owned) == dashboards  # one set: no two dashboards share a uid
    values = yaml.safe_load((cloud.out / "a10" / "values.generated.yaml").read_text())
    assert values["serviceAccount"] == {
        "create": False,
        "name": "appliance",
        "roleArn": "arn:aws:iam::000000000000:role/appliance-a10-irsa",
    }
    assert values["monitoring"]["dashboards"] == {"enabled": False}
    cluster = yaml.safe_load(
        (cloud.out / "a10/manifests/appliance/templates/raycluster.yaml").read_text()
    )
    assert cluster["spec"]["headGroupSpec"]["template"]["spec"]["serviceAccountName"] == "appliance"

    # The first release, deployed again, keeps what it owns. (RELEASE is named: a plain
    # `make deploy` now means foo, the release deployed last.)
    again = cloud.make("deploy", "GPU_CLASS=a10", "RELEASE=appliance")
    assert again.returncode == 0, again.stdout
    assert "belong to release" not in again.stdout
    assert owners(cloud)["ServiceAccount/appliance"] == "appliance"
    assert dashboard_config_maps(owners(cloud)) == dashboards

    # destroy stops and uninstalls both releases, not only the one deployed last
    destroyed = cloud.make("destroy", "GPU_CLASS=a10")
    assert destroyed.returncode == 0, destroyed.stdout
    kubectl = f"kubectl --kubeconfig {cloud.out / 'a10/kubeconfig'} --context appliance-a10"
    for release in ("appliance", "foo"):
        in_order(
            cloud.calls(),
            f"{kubectl} exec --namespace appliance pod/{release}-head-7xk2p -c ray-head -- "
            "python -m appliance.cluster.jobstop",
            f"helm uninstall {release} --namespace appliance --ignore-not-found --wait",
            "terraform -chdir=terraform destroy",
        )
    assert owners(cloud) == {}


@pytest.mark.integration
def test_whichever_release_comes_first_creates_the_service_account(cloud) -> None:
    foo = cloud.make("deploy", "GPU_CLASS=a10", "RELEASE=foo")
    assert foo.returncode == 0, foo.stdout
    assert owners(cloud)["ServiceAccount/appliance"] == "foo"
    assert set(dashboard_config_maps(owners(cloud)).values()) == {"foo"}
    default = cloud.make("deploy", "GPU_CLASS=a10", "RELEASE=appliance")
    assert default.returncode == 0, default.stdout
    assert "belong to release foo: release appliance uses them" in default.stdout
    assert owners(cloud)["ServiceAccount/appliance"] == "foo"


def rendered_entrypoint(cloud: Cloud, gpu_class: str = "a10") -> str:
    manifest = cloud.out / gpu_class / "manifests/appliance/templates/rayjob.yaml"
    return yaml.safe_load(manifest.read_text())["spec"]["entrypoint"]


@pytest.mark.integration
def test_the_options_of_the_last_deploy_persist_until_given_again(cloud) -> None:
    """`make deploy GPU_CLASS=a10` after a deploy with DATA, STEPS and GPU_INSTANCE_TYPE keeps
    them: the job is unchanged (not deleted, not refused for another --data) and terraform keeps
    the node group's instance type (instead of planning to replace it with the default)."""
    first = cloud.make(
        "deploy",
        "GPU_CLASS=a10",
        "DATA=s3://b/data/train.jsonl",
        "STEPS=1000",
        "GPU_INSTANCE_TYPE=g5.12xlarge",
    )
    assert first.returncode == 0, first.stdout
    checksum = cloud.rendered_job_checksum("a10")
    (cloud.state / "rayjob-checksum").write_text(checksum)
    (cloud.state / "rayjob-status").write_text("Complete")

    for again, deletes in ((["GPU_CLASS=a10"], 0), (["GPU_CLASS=a10", "RERUN=1"], 1)):
        (cloud.state / "rayjob-status").write_text("Complete")
        result = cloud.make("deploy", *again)
        assert result.returncode == 0, result.stdout
        # a plain deploy leaves the job alone, RERUN=1 runs the same job again
        assert len([c for c in cloud.calls() if " delete rayjob " in c]) == deletes
        (apply,) = starting(cloud.calls(), "terraform -chdir=terraform apply")
        assert "-var gpu_class=a10 -var gpu_instance_type=g5.12xlarge -var " in apply
        assert cloud.rendered_job_checksum("a10") == checksum
        (line,) = [x for x in result.stdout.splitlines() if x.startswith("Settings from the last")]
        assert "GPU_INSTANCE_TYPE=g5.12xlarge" in line and "STEPS=1000" in line
        assert "DATA=s3://b/data/train.jsonl" in line and "to drop it" in line
    (cloud.state / "rayjob-checksum").write_text(checksum)
    (cloud.state / "rayjob-status").write_text("Complete")  # finished: replaced without asking
    entrypoint = rendered_entrypoint(cloud)
    assert "--data s3://b/data/train.jsonl" in entrypoint and "--steps 1000" in entrypoint

    # Given empty: dropped (the chart's default, the config's steps); the others stay.
    dropped = cloud.make("deploy", "GPU_CLASS=a10", "STEPS=")
    assert dropped.returncode == 0, dropped.stdout
    entrypoint = rendered_entrypoint(cloud)
    assert "--steps" not in entrypoint and "--data s3://b/data/train.jsonl" in entrypoint
    saved = (cloud.out / "a10" / "releases" / "appliance.env").read_text()
    assert "STEPS='" not in saved and "DATA='s3://b/data/train.jsonl'" in saved
    assert "GPU_INSTANCE_TYPE='g5.12xlarge'" in (cloud.out / "a10" / "deploy.env").read_text()

    # Given again: replaced.
    replaced = cloud.make("deploy", "GPU_CLASS=a10", "STEPS=5")
    assert replaced.returncode == 0, replaced.stdout
    assert "--steps 5" in rendered_entrypoint(cloud)


@pytest.mark.integration
def test_each_release_keeps_its_own_job_settings(cloud) -> None:
    assert cloud.make("deploy", "GPU_CLASS=a10", "DATA=s3://b/first").returncode == 0
    assert cloud.make("deploy", "GPU_CLASS=a10", "RELEASE=foo", "DATA=s3://b/foo").returncode == 0
    # A plain deploy acts on the release deployed last, with its own settings...
    plain = cloud.make("deploy", "GPU_CLASS=a10")
    assert plain.returncode == 0, plain.stdout
    assert "helm upgrade --install foo helm/appliance" in plain.stdout
    assert "--data s3://b/foo" in rendered_entrypoint(cloud)
    # ...and the first release, named, gets back its own.
    first = cloud.make("deploy", "GPU_CLASS=a10", "RELEASE=appliance")
    assert first.returncode == 0, first.stdout
    assert "--data s3://b/first" in rendered_entrypoint(cloud)


@pytest.mark.integration
def test_the_settings_file_is_parsed_never_run(cloud, tmp_path) -> None:
    config = tmp_path / "it's.yaml"
    config.write_text("lora_rank: 4\n")
    settings = cloud.out / "a10" / "releases" / "appliance.env"
    settings.parent.mkdir(parents=True)
    quoted = str(config).replace("'", "'\\''")
    settings.write_text(f"# a comment\nTRAIN_CONFIG='{quoted}'\nSTEPS='3'\n")
    result = cloud.make("deploy", "GPU_CLASS=a10")
    assert result.returncode == 0, result.stdout
    manifests = cloud.out / "a10" / "manifests/appliance/templates"
    config_map = yaml.safe_load((manifests / "train-config.yaml").read_text())
    assert config_map["data"]["train.yaml"] == "lora_rank: 4\n"
    assert settings.read_text().splitlines()[-2:] == ["STEPS='3'", f"TRAIN_CONFIG='{quoted}'"]

    marker = tmp_path / "ran"
    for line in (f"DATA=$(touch {marker})", f"DATA='x'; touch {marker}", "PATH='/tmp'"):
        settings.write_text(line + "\n")
        refused = cloud.make("deploy", "GPU_CLASS=a10")
        assert refused.returncode != 0
        assert f"{settings}:1" in refused.stdout
        assert cloud.calls() == [] and not marker.exists()


@pytest.mark.integration
def test_a_running_job_is_replaced_only_with_replace_running(cloud) -> None:
    """A deploy that would change the RayJob (or RERUN=1) while it still runs would stop the run:
    it stops before the chart is upgraded, saying so, unless REPLACE_RUNNING=1."""
    assert cloud.make("deploy", "GPU_CLASS=a10", "DATA=s3://b/d", "STEPS=10").returncode == 0
    checksum = cloud.rendered_job_checksum("a10")
    (cloud.state / "rayjob-checksum").write_text(checksum)  # running: no rayjob-status yet
    settings = (cloud.out / "a10" / "releases" / "appliance.env").read_text()

    for args, reason in (
        (["STEPS=20"], f"its spec changed (checksum/job {checksum} -> "),
        (["RERUN=1"], "RERUN=1 runs it again"),
    ):
        refused = cloud.make("deploy", "GPU_CLASS=a10", *args)
        assert refused.returncode != 0
        assert "RayJob appliance-train is still running (Running) and this deploy would " in (
            refused.stdout
        )
        assert reason in refused.stdout and "REPLACE_RUNNING=1" in refused.stdout
        assert [c for c in cloud.calls() if " delete rayjob " in c or " exec " in c] == []
        assert starting(cloud.calls(), "helm upgrade --install appliance") == []
        assert (cloud.state / "rayjob-checksum").read_text() == checksum
        # not a successful deploy: its settings are not the last deploy's
        assert (cloud.out / "a10" / "releases" / "appliance.env").read_text() == settings

    unchanged = cloud.make("deploy", "GPU_CLASS=a10")
    assert unchanged.returncode == 0, unchanged.stdout
    assert "RayJob appliance-train: unchanged, left as it is (Running" in unchanged.stdout

    replaced = cloud.make("deploy", "GPU_CLASS=a10", "STEPS=20", "REPLACE_RUNNING=1")
    assert replaced.returncode == 0, replaced.stdout
    assert "REPLACE_RUNNING=1: deleting it (this stops the run)" in replaced.stdout
    kubectl = f"kubectl --kubeconfig {cloud.out / 'a10/kubeconfig'} --context appliance-a10"
    # the run is stopped the graceful way (its step finishes, a checkpoint is written) and waited
    # for, in the head pod, before its RayJob is deleted
    assert "Stopping release appliance's running job gracefully" in replaced.stdout
    in_order(
        cloud.calls(),
        f"{kubectl} get pods --namespace appliance "
        "-l app.kubernetes.io/instance=appliance,ray.io/node-type=head -o name",
        f"{kubectl} exec --namespace appliance pod/appliance-head-7xk2p -c ray-head -- "
        "python -m appliance.cluster.jobstop",
        f"{kubectl} delete rayjob appliance-train",
        "helm upgrade --install appliance helm/appliance",
    )
