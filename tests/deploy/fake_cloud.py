"""Stand-ins for aws, docker, kubectl, helm and terraform, for running scripts/deploy.sh for real
(no DRY_RUN) without a cloud. Each call is appended to $FAKE_CLOUD/calls.log ("tool arg arg...")
and answered the way the real tool answers, from a small state kept in files under $FAKE_CLOUD:

    tf/<workspace>/outputs.json  terraform outputs of that workspace's stack (absent: none)
    tf/<workspace>/resources     `terraform state list` (absent or empty: nothing deployed)
    tf/<workspace>/force         force_destroy=true has been applied to the bucket
    eks-log-group-left           EKS re-created the cluster's log group after a destroy: an apply
                                 fails on it (ResourceAlreadyExistsException) until `terraform
                                 import aws_cloudwatch_log_group.cluster` takes it into the state
    apply-error                  an error every apply of the stack fails with
    gpu-zones                    the zones that offer the GPU type today, one a line (absent:
                                 us-east-1a, us-east-1b): an apply without availability_zones
                                 that would move a stack's subnets to others fails as a plan
                                 that replaces them
    workspace                    the selected terraform workspace
    bucket-objects               the bucket holds objects: destroy fails without force_destroy
    ecr-tags                     image tags in the (IMMUTABLE) ECR repository, one a line
    clusters-gone                cluster names that no longer exist, one a line
    no-credentials               `aws sts get-caller-identity` fails as it does without them
    offline                      `terraform init` fails as it does when the registry is out of
                                 reach (no network, a proxy)
    user-kubeconfig              contexts written into the user's own kubeconfig (~/.kube/config):
                                 update-kubeconfig without --kubeconfig
    rayjob-checksum              the live RayJob's checksum/job annotation (absent: no RayJob)
    rayjob-status                its status.jobDeploymentStatus (absent: Running); `kubectl exec
                                 ... python -m appliance.cluster.jobstop` in the head pod (which `get pods`
                                 names while the release is installed) makes it Complete
    helm/<namespace>/<release>.json  the release's history: [{revision, status, description}];
                                 `upgrade --install` fails while the last one is pending-*
    owners/<namespace>.json      {"Kind/name": release} of the objects the releases of a local
                                 chart (helm/appliance) installed

`aws eks update-kubeconfig --kubeconfig FILE` writes FILE (naming the context); kubectl and helm
fail, as a trap, when a call that reaches the cluster does not name both a kubeconfig file that
update-kubeconfig wrote and its context: it would act on whatever the user's kubeconfig says.
`terraform apply` creates the stack of its -var gpu_class in the selected workspace, and fails as
a plan that would replace another class's stack if that workspace already holds one; `docker push`
of a tag already in ECR fails as ECR's immutability does; `terraform destroy` without force_destroy
stops at a non-empty bucket after deleting the cluster, as the real destroy does.

helm `template`, `version` and `lint` run the real helm ($REAL_HELM); `upgrade --install`,
`history -o json`, `rollback` and `uninstall` keep each release's revisions, and an upgrade of a
release left pending-install/-upgrade/-rollback fails as helm's does ("another operation ... is
in progress"). An upgrade of a local chart renders it with the real helm and, as helm does,
refuses to take over an object that another release owns ("exists and cannot be imported into
the current release"); `kubectl get serviceaccount` answers "owner:<release>" (deploy.sh's
go-template) from that record. Written by the tests of
tests/deploy/test_deploy_script.py into a tmp dir as `<tool>` wrappers that exec this file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

STATE = Path(os.environ["FAKE_CLOUD"])
ACCOUNT = "000000000000"
REGION = "us-east-1"


def lines(name: str) -> list[str]:
    path = STATE / name
    return path.read_text().split() if path.exists() else []


def add_line(name: str, value: str) -> None:
    with open(STATE / name, "a") as f:
        f.write(value + "\n")


def fail(message: str, code: int = 1) -> None:
    print(message, file=sys.stderr)
    sys.exit(code)


def option(args: list[str], name: str) -> str | None:
    """The value of `--name value` or `--name=value` in args."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


def without_globals(args: list[str]) -> list[str]:
    """args less kubectl's/helm's --kubeconfig, --context and --kube-context (and their values)."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--kubeconfig", "--context", "--kube-context"):
            skip = True
        elif not arg.startswith(("--kubeconfig=", "--context=", "--kube-context=")):
            out.append(arg)
    return out


def tf_vars(args: list[str]) -> dict[str, str]:
    return dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-var")


# -- terraform -----------------------------------------------------------------------------------


def workspace_dir() -> Path:
    name = (STATE / "workspace").read_text() if (STATE / "workspace").exists() else "default"
    path = STATE / "tf" / name
    path.mkdir(parents=True, exist_ok=True)
    return path


def outputs() -> dict[str, str]:
    path = workspace_dir() / "outputs.json"
    return json.loads(path.read_text()) if path.exists() else {}


def resources() -> list[str]:
    path = workspace_dir() / "resources"
    return path.read_text().split() if path.exists() else []


def offered_zones() -> list[str]:
    """The two zones terraform picks when availability_zones is not given: the first two where
    AWS offers the GPU type today (state file gpu-zones; it can change between deploys)."""
    return sorted(lines("gpu-zones") or ["us-east-1a", "us-east-1b"])[:2]


def stack(
    gpu_class: str, instance: str | None, zones: list[str]
) -> tuple[dict[str, str], list[str]]:
    """The outputs and state of a deployed stack of one GPU class."""
    cluster = f"appliance-{gpu_class}"
    instance = instance or {"a10": "g5.8xlarge", "4090": "g6e.8xlarge"}[gpu_class]
    out = {
        "cluster_name": cluster,
        "region": REGION,
        "bucket_name": f"{cluster}-bucket",
        "irsa_role_arn": f"arn:aws:iam::{ACCOUNT}:role/{cluster}-irsa",
        "ecr_repository_url": f"{ACCOUNT}.dkr.ecr.{REGION}.amazonaws.com/{cluster}",
        "gpu_class": gpu_class,
        "availability_zones": json.dumps(zones),  # as `output -json` prints it
        "gpu_instance_type": instance,
        "gpu_node_count": "1",
        "kubernetes_namespace": "appliance",
        "service_account_name": "appliance",
    }
    state = [
        "aws_cloudwatch_log_group.cluster",
        "aws_eks_cluster.this",
        "aws_ecr_repository.this",
        "aws_s3_bucket.this",
        "aws_vpc.this",
    ]
    return out, state


def terraform(args: list[str]) -> None:
    args = [a for a in args if not a.startswith("-chdir=")]
    command, rest = args[0], args[1:]
    ws = workspace_dir()
    if command == "init":
        if (STATE / "offline").exists():
            fail(
                "Error: Failed to query available provider packages\n\nCould not retrieve the "
                "list of available versions for provider hashicorp/aws: could not connect to "
                "registry.terraform.io: dial tcp: lookup registry.terraform.io: no such host"
            )
        return
    if command == "workspace" and rest[0] == "select":
        (STATE / "workspace").write_text(rest[-1])
        return
    if command == "output":
        name = rest[-1]
        if name not in outputs():
            fail(f'Error: Output "{name}" not found')
        print(outputs()[name], end="")
        return
    if command == "import":
        address, name = rest[-2], rest[-1]
        if (
            address != "aws_cloudwatch_log_group.cluster"
            or not (STATE / "eks-log-group-left").exists()
        ):
            fail(f"Error: Cannot import non-existent remote object ({address} {name})")
        (STATE / "eks-log-group-left").unlink()
        (ws / "resources").write_text("\n".join([*resources(), address]))
        return
    if command == "state" and rest[0] == "list":
        print("\n".join(resources()))
        return
    if command == "apply":
        variables = tf_vars(rest)
        if any(a.startswith("-target=") for a in rest):
            if variables.get("force_destroy") == "true":
                (ws / "force").touch()
            return
        gpu_class = variables["gpu_class"]
        deployed = outputs().get("gpu_class")
        if deployed and deployed != gpu_class:
            fail(f"Plan: the {deployed} stack would be replaced by a {gpu_class} one")
        pinned = variables.get("availability_zones")
        zones = json.loads(pinned) if pinned else offered_zones()
        if (
            "availability_zones" in outputs()
            and json.loads(outputs()["availability_zones"]) != zones
        ):
            fail(
                "Plan: 9 to add, 0 to change, 9 to destroy: aws_subnet.private[0] must be "
                f"replaced (availability_zone {outputs()['availability_zones']} -> {zones}), "
                "and the node groups and the cluster with it"
            )
        if (STATE / "apply-error").exists():
            fail((STATE / "apply-error").read_text())
        log_group = f"/aws/eks/appliance-{gpu_class}/cluster"
        if (STATE / "eks-log-group-left").exists() and "aws_cloudwatch_log_group.cluster" not in (
            resources()
        ):
            fail(
                f"Error: creating CloudWatch Logs Log Group ({log_group}): operation error "
                "CloudWatch Logs: CreateLogGroup, https response error StatusCode: 400, "
                "ResourceAlreadyExistsException: The specified log group already exists"
            )
        out, state = stack(gpu_class, variables.get("gpu_instance_type"), zones)
        gone = [name for name in lines("clusters-gone") if name != out["cluster_name"]]
        (STATE / "clusters-gone").write_text("".join(f"{name}\n" for name in gone))
        (ws / "outputs.json").write_text(json.dumps(out))
        (ws / "resources").write_text("\n".join(state))
        return
    if command == "destroy":
        cluster = outputs().get("cluster_name")
        if cluster:
            add_line("clusters-gone", cluster)
        if (STATE / "bucket-objects").exists() and not (ws / "force").exists():
            # Everything but the bucket is gone; so are the outputs that named it.
            (ws / "resources").write_text("aws_s3_bucket.this")
            kept = {k: v for k, v in outputs().items() if k in ("bucket_name", "region")}
            (ws / "outputs.json").write_text(json.dumps(kept))
            fail(
                "Error: deleting S3 Bucket: BucketNotEmpty: The bucket you tried to delete is not empty"
            )
        for name in ("outputs.json", "resources", "force"):
            (ws / name).unlink(missing_ok=True)
        return
    fail(f"fake terraform: unexpected command {args}", 2)


# -- aws, docker, kubectl, helm ------------------------------------------------------------------


def aws(args: list[str]) -> None:
    service, command = args[0], args[1]
    if (service, command) == ("sts", "get-caller-identity"):
        if (STATE / "no-credentials").exists():
            fail(
                "\nUnable to locate credentials. You can configure credentials by running "
                '"aws configure".',
                253,
            )
        print(ACCOUNT)
        return
    if (service, command) == ("eks", "update-kubeconfig"):
        name = option(args, "--name")
        if name in lines("clusters-gone"):
            fail(
                "An error occurred (ResourceNotFoundException) when calling the DescribeCluster "
                f"operation: No cluster found for name: {name}.",
                254,
            )
        alias = option(args, "--alias")
        kubeconfig = option(args, "--kubeconfig")
        if kubeconfig is None:
            add_line("user-kubeconfig", alias)
            kubeconfig = "/root/.kube/config"
        else:
            Path(kubeconfig).write_text(f"current-context: {alias}\n")
        print(f"Added new context {alias} to {kubeconfig}")
        return
    if (service, command) == ("ecr", "describe-images"):
        tag = option(args, "--image-ids").split("=", 1)[1]
        if tag not in lines("ecr-tags"):
            fail(
                "An error occurred (ImageNotFoundException) when calling the DescribeImages "
                f"operation: The image with imageId {{imageTag:'{tag}'}} does not exist",
                254,
            )
        print(json.dumps({"imageDetails": [{"imageTags": [tag]}]}))
        return
    if (service, command) == ("ecr", "get-login-password"):
        print("fake-password")
        return
    fail(f"fake aws: unexpected command {args}", 2)


def docker(args: list[str]) -> None:
    if args[0] == "login":
        sys.stdin.read()
        print("Login Succeeded")
        return
    if args[0] == "build":
        return
    if args[0] == "push":
        repository, tag = args[1].rsplit(":", 1)
        if tag in lines("ecr-tags"):
            fail(
                f"tag invalid: The image tag '{tag}' already exists in the '{repository}' "
                "repository and cannot be overwritten because the repository is immutable."
            )
        add_line("ecr-tags", tag)
        return
    fail(f"fake docker: unexpected command {args}", 2)


def cluster_reachable(args: list[str]) -> None:
    context = option(args, "--context") or option(args, "--kube-context")
    if context is None:
        fail("fake: no kube context given: the call would act on whatever context is current", 3)
    kubeconfig = option(args, "--kubeconfig")
    if kubeconfig is None or not Path(kubeconfig).exists():
        fail(f"fake: no kubeconfig of deploy.sh's own ({kubeconfig}): the user's would be used", 3)
    if Path(kubeconfig).read_text() != f"current-context: {context}\n":
        fail(f"fake: context {context} is not in {kubeconfig}", 3)
    if context in lines("clusters-gone"):
        fail("Error: Kubernetes cluster unreachable: dial tcp: lookup on 127.0.0.53: no such host")


def kubectl(args: list[str]) -> None:
    cluster_reachable(args)
    args = without_globals(args)
    if args[:2] == ["get", "serviceaccount"]:
        owner = owners(option(args, "--namespace") or "default").get(f"ServiceAccount/{args[2]}")
        if owner is not None:
            print(f"owner:{owner}", end="")
        return
    checksum = STATE / "rayjob-checksum"
    if args[:2] == ["get", "rayjob"]:  # deploy.sh's go-template: found:<checksum>:<status>
        status = STATE / "rayjob-status"
        if checksum.exists():
            state = status.read_text() if status.exists() else "Running"
            print(f"found:{checksum.read_text()}:{state}", end="")
        return
    if args[:2] == ["delete", "rayjob"]:
        if not checksum.exists():
            fail(f'Error from server (NotFound): rayjobs.ray.io "{args[2]}" not found')
        checksum.unlink()
        (STATE / "rayjob-status").unlink(missing_ok=True)
        return
    if args[:2] == ["get", "pods"]:  # deploy.sh looks for a release's Ray head pod by labels
        labels = dict(pair.split("=", 1) for pair in (option(args, "-l") or "").split(","))
        release = labels.get("app.kubernetes.io/instance", "")
        history = release_history(release_file(args, release))
        if labels.get("ray.io/node-type") == "head" and history:
            print(f"pod/{release}-head-7xk2p")
        return
    if args[0] == "exec" and args[args.index("--") + 1 :] == [
        "python",
        "-m",
        "appliance.cluster.jobstop",
    ]:
        # the running job stops (SIGTERM, a checkpoint) and KubeRay marks its RayJob finished
        if checksum.exists():
            (STATE / "rayjob-status").write_text("Complete")
        return
    if args[0] == "apply" or args[:2] == ["delete", "pvc"]:
        return
    fail(f"fake kubectl: unexpected command {args}", 2)


def release_file(args: list[str], name: str) -> Path:
    namespace = option(args, "--namespace") or option(args, "-n") or "default"
    return STATE / "helm" / namespace / f"{name}.json"


def release_history(path: Path) -> list[dict[str, object]]:
    return json.loads(path.read_text()) if path.exists() else []


def add_revision(path: Path, history: list[dict[str, object]], description: str) -> None:
    """A new deployed revision; the ones before it are superseded, as helm leaves them."""
    for revision in history:
        if revision["status"] in ("deployed", "pending-upgrade", "pending-rollback"):
            revision["status"] = "superseded"
    revision = len(history) + 1
    history.append({"revision": revision, "status": "deployed", "description": description})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(history))


def owners(namespace: str) -> dict[str, str]:
    path = STATE / "owners" / f"{namespace}.json"
    return json.loads(path.read_text()) if path.exists() else {}


def set_owners(namespace: str, owned: dict[str, str]) -> None:
    path = STATE / "owners" / f"{namespace}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(owned))


def rendered_objects(command: list[str]) -> list[str]:
    """ "Kind/name" of each object `helm upgrade --install NAME CHART ARGS...` would install, from
    the real `helm template` of a chart directory (a repository chart: none recorded)."""
    name, chart, rest = command[2], command[3], command[4:]
    if not Path(chart).is_dir():
        return []
    rest = [a for a in rest if a not in ("--create-namespace", "--wait")]
    result = subprocess.run(
        [os.environ["REAL_HELM"], "template", name, chart, *rest], capture_output=True, text=True
    )
    if result.returncode != 0:
        fail(result.stderr)
    objects = []
    for doc in result.stdout.split("\n---"):
        kind = re.search(r"^kind: (\S+)", doc, re.M)
        object_name = re.search(r"^  name: (\S+)", doc, re.M)
        if kind and object_name:
            objects.append(f"{kind.group(1)}/{object_name.group(1).strip(chr(34))}")
    return objects


def install_objects(command: list[str], namespace: str) -> None:
    """Record the release's objects, refusing any that another release owns, as helm does."""
    release = command[2]
    owned = owners(namespace)
    objects = rendered_objects(command)
    for obj in objects:
        owner = owned.get(obj)
        if owner is not None and owner != release:
            kind, name = obj.split("/", 1)
            fail(
                f'Error: UPGRADE FAILED: Unable to continue with install: {kind} "{name}" in '
                f'namespace "{namespace}" exists and cannot be imported into the current release: '
                "invalid ownership metadata; annotation validation error: key "
                f'"meta.helm.sh/release-name" must equal "{release}": current value is "{owner}"'
            )
    owned = {obj: owner for obj, owner in owned.items() if owner != release}  # helm prunes
    owned.update({obj: release for obj in objects})
    set_owners(namespace, owned)


def helm(args: list[str]) -> None:
    if args[0] in ("template", "version", "lint"):
        os.execv(os.environ["REAL_HELM"], ["helm", *args])
    if args[0] == "repo":
        return
    cluster_reachable(args)
    command = without_globals(args)
    if command[0] == "list":  # list --namespace NS --short: the releases installed there
        releases = (STATE / "helm" / (option(args, "--namespace") or "default")).glob("*.json")
        print("\n".join(sorted(path.stem for path in releases)))
        return
    path = release_file(args, command[1] if command[0] != "upgrade" else command[2])
    history = release_history(path)
    if command[0] == "upgrade":  # upgrade --install NAME CHART ...
        if history and str(history[-1]["status"]).startswith("pending-"):
            fail(
                "Error: UPGRADE FAILED: another operation (install/upgrade/rollback) is in progress"
            )
        install_objects(command, option(args, "--namespace") or "default")
        add_revision(path, history, "Upgrade complete" if history else "Install complete")
        return
    if command[0] == "history":
        if not history:
            fail("Error: release: not found")
        rows = [{**r, "chart": "chart-1.0.0", "app_version": "1.0"} for r in history]
        print(json.dumps(rows, separators=(",", ":")))  # as Go's encoding/json writes it
        return
    if command[0] == "rollback":  # rollback NAME REVISION
        target = int(command[2])
        if target not in [r["revision"] for r in history]:
            fail(f"Error: release has no {target} version")
        add_revision(path, history, f"Rollback to {target}")
        return
    if command[0] == "uninstall":
        if not history and "--ignore-not-found" not in command:
            fail(f"Error: uninstall: Release not loaded: {command[1]}: release: not found")
        path.unlink(missing_ok=True)
        namespace = option(args, "--namespace") or "default"
        owned = owners(namespace)
        set_owners(namespace, {o: r for o, r in owned.items() if r != command[1]})
        return
    fail(f"fake helm: unexpected command {args}", 2)


TOOLS = {"terraform": terraform, "aws": aws, "docker": docker, "kubectl": kubectl, "helm": helm}

if __name__ == "__main__":
    tool, args = sys.argv[1], sys.argv[2:]
    with open(STATE / "calls.log", "a") as log:
        log.write(" ".join([tool, *args]) + "\n")
    TOOLS[tool](args)
