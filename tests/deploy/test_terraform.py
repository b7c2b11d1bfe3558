"""The Terraform module (terraform/): formatting, checkov, and python-hcl2 checks of what matters:
the GPU-class → instance-type mapping, the IRSA policy's scope, the bucket's protections, the
module layout and the outputs `make deploy` reads.

`terraform init` / `validate` are not run: they download the aws/helm/tls providers, and this
machine (and CI) reach no provider registry. fmt needs no provider; checkov and the hcl2 tests
read the source."""

from __future__ import annotations

import functools
import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import hcl2
import pytest
import yaml

from tests.deploy.conftest import CHART, CHECKOV, ROOT, TERRAFORM, require, run, unquote

BUCKET_ARN = "aws_s3_bucket.this.arn"
OBJECTS_ARN = "${aws_s3_bucket.this.arn}/*"


def ref(value: str) -> str:
    """Normalise an hcl2 string: drop quotes, and ${} when it wraps the whole value."""
    value = unquote(value)
    if isinstance(value, str) and re.fullmatch(r"\$\{[^{}]*\}", value):
        return value[2:-1]
    return value


def _blocks(module: dict[str, Any], kind: str) -> dict[str, dict[str, Any]]:
    """resource/data blocks as {type: {name: body}}."""
    out: dict[str, dict[str, Any]] = {}
    for block in module.get(kind, []):
        for rtype, named in block.items():
            for name, body in named.items():
                out.setdefault(unquote(rtype), {})[unquote(name)] = body
    return out


@functools.cache
def module(directory: Path = TERRAFORM) -> dict[str, Any]:
    parsed: dict[str, list[Any]] = {}
    for path in sorted(directory.glob("*.tf")):
        with open(path) as f:
            for key, value in hcl2.load(f).items():
                parsed.setdefault(key, []).extend(value)
    return {
        "resource": _blocks(parsed, "resource"),
        "data": _blocks(parsed, "data"),
        "variable": {
            unquote(k): v for block in parsed.get("variable", []) for k, v in block.items()
        },
        "output": {unquote(k): v for block in parsed.get("output", []) for k, v in block.items()},
        "locals": {k: v for block in parsed.get("locals", []) for k, v in block.items()},
        "module": {unquote(k): v for block in parsed.get("module", []) for k, v in block.items()},
    }


def policy_statements(name: str) -> list[dict[str, Any]]:
    return module()["data"]["aws_iam_policy_document"][name]["statement"]


# -- tools ---------------------------------------------------------------------------------------


def test_terraform_files_are_formatted() -> None:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("terraform is not installed (fmt -check needs only the binary)")
    result = run([terraform, "fmt", "-check", "-recursive", "-diff", TERRAFORM])
    assert result.returncode == 0, result.stdout + result.stderr


def test_checkov_fails_no_check_and_every_skip_gives_a_reason() -> None:
    # One run over the module and its examples; --skip-download: no Prisma Cloud look-ups.
    cmd = [require(CHECKOV), "-d", TERRAFORM, "--framework", "terraform", "--skip-download"]
    result = run([*cmd, "-o", "json"])
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    (report,) = [r for r in reports if r["check_type"] == "terraform"]
    failed = [
        f"{c['check_id']} {c['resource']} ({c['file_path']})"
        for c in report["results"]["failed_checks"]
    ]
    assert failed == []
    assert report["summary"]["parsing_errors"] == 0
    assert report["summary"]["resource_count"] >= 30
    for check in report["results"]["skipped_checks"]:
        reason = check["check_result"].get("suppress_comment", "")
        assert len(reason) > 20 and reason != "No comment provided", check["check_id"]
    assert result.returncode == 0, result.stderr[-2000:]


# -- GPU class → instance type ------------------------------------------------------------------


def test_gpu_class_a10_maps_to_g5_and_4090_to_g6e() -> None:
    types = unquote(module()["locals"]["gpu_instance_types"])
    assert set(types) == {"a10", "4090"}
    assert types["a10"].startswith("g5.")  # NVIDIA A10G
    assert types["4090"].startswith("g6e.")  # NVIDIA L40S, the 4090's AD102 die


def test_gpu_class_variable_accepts_exactly_the_mapped_classes() -> None:
    variable = module()["variable"]["gpu_class"]
    condition = ref(variable["validation"][0]["condition"])
    classes = set(re.findall(r'"([^"]+)"', condition.split("]")[0]))
    assert classes == set(unquote(module()["locals"]["gpu_instance_types"]))
    assert unquote(variable["default"]) in classes


def test_an_explicit_instance_type_overrides_the_gpu_class_default() -> None:
    assert module()["variable"]["gpu_instance_type"]["default"] is None
    expression = ref(module()["locals"]["gpu_instance_type"]).replace(" ", "")
    assert expression == "coalesce(var.gpu_instance_type,local.gpu_instance_types[var.gpu_class])"
    gpu_nodes = module()["resource"]["aws_eks_node_group"]["gpu"]
    assert [ref(t) for t in gpu_nodes["instance_types"]] == ["local.gpu_instance_type"]
    assert ref(gpu_nodes["ami_type"]) == "AL2023_x86_64_NVIDIA"


def test_the_gpu_nodes_carry_the_taint_and_labels_the_chart_expects() -> None:
    gpu_nodes = module()["resource"]["aws_eks_node_group"]["gpu"]
    (taint,) = unquote(gpu_nodes["taint"])
    assert (taint["key"], taint["effect"]) == ("nvidia.com/gpu", "NO_SCHEDULE")
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in values[
        "worker"
    ]["tolerations"]
    labels = unquote(gpu_nodes["labels"])
    assert labels["nvidia.com/gpu.present"] == "true"  # the device plugin's node selector
    assert ref(labels["appliance.dev/gpu-class"]) == "var.gpu_class"


def test_terraform_and_the_chart_agree_on_each_classes_instance_type() -> None:
    types = unquote(module()["locals"]["gpu_instance_types"])
    presets = yaml.safe_load((CHART / "values.yaml").read_text())["gpuClasses"]
    assert {cls: p["instanceType"] for cls, p in presets.items()} == types


def test_the_device_plugin_is_installed_with_helm() -> None:
    (release,) = module()["resource"]["helm_release"].values()
    assert unquote(release["chart"]) == "nvidia-device-plugin"
    assert ref(release["version"]) == "var.nvidia_device_plugin_version"


# -- S3 and IRSA ---------------------------------------------------------------------------------


def test_the_irsa_policy_names_only_the_bucket_and_its_objects() -> None:
    statements = policy_statements("irsa")
    resources = {ref(r) for s in statements for r in s["resources"]}
    assert resources == {BUCKET_ARN, OBJECTS_ARN}
    for statement in statements:
        assert ref(statement.get("effect", '"Allow"')) == "Allow"
        actions = [ref(a) for a in statement["actions"]]
        assert all(a.startswith("s3:") and "*" not in a for a in actions), actions
        on = {ref(r) for r in statement["resources"]}
        # bucket-level actions on the bucket, object actions on bucket/*
        assert on == ({BUCKET_ARN} if any("Bucket" in a for a in actions) else {OBJECTS_ARN})
    object_actions = {
        ref(a) for s in statements for a in s["actions"] if OBJECTS_ARN in map(ref, s["resources"])
    }
    assert {"s3:GetObject", "s3:PutObject"} <= object_actions


def test_the_irsa_role_has_no_other_policy() -> None:
    resources = module()["resource"]
    (policy,) = [
        p
        for p in resources["aws_iam_role_policy"].values()
        if ref(p["role"]) == "aws_iam_role.irsa.id"
    ]
    assert ref(policy["policy"]) == "data.aws_iam_policy_document.irsa.json"
    attachments = resources.get("aws_iam_role_policy_attachment", {}).values()
    assert not [a for a in attachments if "aws_iam_role.irsa" in ref(a["role"])]


def test_only_the_charts_service_account_may_assume_the_irsa_role() -> None:
    (statement,) = policy_statements("irsa_assume")
    assert [ref(a) for a in statement["actions"]] == ["sts:AssumeRoleWithWebIdentity"]
    conditions = {ref(c["variable"]): [ref(v) for v in c["values"]] for c in statement["condition"]}
    assert conditions == {
        "${local.oidc_issuer}:sub": [
            "system:serviceaccount:${var.kubernetes_namespace}:${var.service_account_name}"
        ],
        "${local.oidc_issuer}:aud": ["sts.amazonaws.com"],
    }


def test_the_bucket_is_private_encrypted_and_versioned() -> None:
    resources = module()["resource"]
    block = resources["aws_s3_bucket_public_access_block"]["this"]
    for setting in (
        "block_public_acls",
        "block_public_policy",
        "ignore_public_acls",
        "restrict_public_buckets",
    ):
        assert block[setting] is True, setting
    versioning = resources["aws_s3_bucket_versioning"]["this"]["versioning_configuration"][0]
    assert ref(versioning["status"]) == "Enabled"
    (rule,) = resources["aws_s3_bucket_server_side_encryption_configuration"]["this"]["rule"]
    assert ref(rule["apply_server_side_encryption_by_default"][0]["sse_algorithm"]) == "aws:kms"
    for name in (
        "aws_s3_bucket_public_access_block",
        "aws_s3_bucket_versioning",
        "aws_s3_bucket_policy",
    ):
        assert ref(resources[name]["this"]["bucket"]) == "aws_s3_bucket.this.id"


# -- module layout and interface -----------------------------------------------------------------


def test_the_module_has_the_standard_files_and_runnable_examples() -> None:
    for name in ("main.tf", "variables.tf", "outputs.tf", "versions.tf"):
        assert (TERRAFORM / name).is_file(), name
    examples = [d for d in (TERRAFORM / "examples").iterdir() if d.is_dir()]
    assert len(examples) >= 2
    variables = set(module()["variable"])
    for example in examples:
        (call,) = module(example)["module"].values()
        assert unquote(call["source"]) == "../.."
        assert set(call) - {"source", "__is_block__", "__comments__"} <= variables, example.name


def test_every_variable_has_a_description_and_a_type_and_every_output_a_description() -> None:
    for name, variable in module()["variable"].items():
        assert len(unquote(variable.get("description", ""))) > 10, name
        assert "type" in variable, name
    for name, output in module()["output"].items():
        assert len(unquote(output.get("description", ""))) > 10, name


def test_a_resource_alone_of_its_type_is_named_this() -> None:
    named = [(rtype, name) for rtype, names in module()["resource"].items() for name in names]
    counts = Counter(rtype for rtype, _ in named)
    alone = [f"{rtype}.{name}" for rtype, name in named if counts[rtype] == 1 and name != "this"]
    assert alone == []


def test_deploy_reads_only_outputs_that_exist() -> None:
    script = (ROOT / "scripts" / "deploy-terraform.sh").read_text()
    used = set(re.findall(r"tf_output (\w+)", script))
    assert {"cluster_name", "region", "bucket_name", "irsa_role_arn"} <= used
    assert used <= set(module()["output"])


def test_the_readme_documents_every_variable_and_output() -> None:
    readme = (TERRAFORM / "README.md").read_text()
    missing = [n for n in [*module()["variable"], *module()["output"]] if f"`{n}`" not in readme]
    assert missing == []


# -- zones, quota, version, S3 endpoint ----------------------------------------------------------


def test_the_gpu_nodes_go_only_to_zones_that_offer_their_instance_type() -> None:
    (offerings,) = module()["data"]["aws_ec2_instance_type_offerings"].values()
    assert ref(offerings["location_type"]) == "availability-zone"
    (instance_filter,) = offerings["filter"]
    assert ref(instance_filter["name"]) == "instance-type"
    assert [ref(v) for v in instance_filter["values"]] == ["local.gpu_instance_type"]
    zones = ref(module()["locals"]["gpu_zones"])
    assert "data.aws_ec2_instance_type_offerings.gpu.locations" in zones
    assert "local.gpu_zones" in ref(module()["locals"]["azs"])  # offered zones first
    gpu_nodes = module()["resource"]["aws_eks_node_group"]["gpu"]
    assert ref(gpu_nodes["subnet_ids"]) == "local.gpu_subnet_ids"
    assert "if contains(local.gpu_zones, az)" in ref(module()["locals"]["gpu_subnet_ids"])


def test_the_plan_refuses_a_gpu_vcpu_quota_too_small_and_says_how_to_raise_it() -> None:
    (quota,) = module()["data"]["aws_servicequotas_service_quota"].values()
    # "Running On-Demand G and VT instances", in vCPUs
    assert (ref(quota["service_code"]), ref(quota["quota_code"])) == ("ec2", "L-DB2E81BA")
    assert "default_vcpus" in ref(module()["locals"]["gpu_vcpus"])
    gpu_nodes = module()["resource"]["aws_eks_node_group"]["gpu"]
    checks = [c for life in gpu_nodes["lifecycle"] for c in life["precondition"]]
    (quota_check,) = [c for c in checks if "gpu_vcpus" in ref(c["condition"])]
    assert ">= local.gpu_vcpus" in ref(quota_check["condition"])
    message = ref(quota_check["error_message"])
    assert "request-service-quota-increase --service-code ec2 --quota-code L-DB2E81BA" in message
    assert any("length(local.gpu_subnet_ids) > 0" in ref(c["condition"]) for c in checks)


def test_the_default_kubernetes_version_is_recent_and_stays_in_standard_support() -> None:
    major, minor = map(
        int, unquote(module()["variable"]["kubernetes_version"]["default"]).split(".")
    )
    assert (major, minor) >= (1, 35)  # 1.33 left EKS standard support in 2026
    (policy,) = module()["resource"]["aws_eks_cluster"]["this"]["upgrade_policy"]
    assert ref(policy["support_type"]) == "STANDARD"


def test_s3_goes_through_a_gateway_endpoint_on_the_nodes_route_table() -> None:
    endpoint = module()["resource"]["aws_vpc_endpoint"]["this"]
    assert ref(endpoint["vpc_endpoint_type"]) == "Gateway"
    assert ref(endpoint["service_name"]) == "com.amazonaws.${var.region}.s3"
    assert [ref(r) for r in endpoint["route_table_ids"]] == ["aws_route_table.private.id"]
    nodes = module()["resource"]["aws_eks_node_group"]
    assert all(
        ref(g["subnet_ids"]) in ("aws_subnet.private[*].id", "local.gpu_subnet_ids")
        for g in nodes.values()
    )


def test_prometheus_volumes_can_be_provisioned() -> None:
    addon = module()["resource"]["aws_eks_addon"]["this"]
    assert ref(addon["addon_name"]) == "aws-ebs-csi-driver"
    assert ref(addon["service_account_role_arn"]) == "aws_iam_role.ebs_csi.arn"
    (statement,) = module()["data"]["aws_iam_policy_document"]["ebs_csi_assume"]["statement"]
    subjects = [ref(v) for c in statement["condition"] for v in c["values"]]
    assert "system:serviceaccount:kube-system:ebs-csi-controller-sa" in subjects
    # deploy.sh asks for that volume in the StorageClass every EKS cluster has.
    assert "storageClassName: gp2" in (ROOT / "scripts" / "deploy.sh").read_text()


def test_destroy_deletes_the_image_repository_but_keeps_a_bucket_with_checkpoints() -> None:
    resources = module()["resource"]
    assert resources["aws_ecr_repository"]["this"]["force_delete"] is True  # images rebuild
    assert ref(resources["aws_ecr_repository"]["this"]["image_tag_mutability"]) == "IMMUTABLE"
    assert ref(resources["aws_s3_bucket"]["this"]["force_destroy"]) == "var.force_destroy"
    assert module()["variable"]["force_destroy"]["default"] is False


def test_noncurrent_runs_are_kept_the_set_retention_and_other_versions_thirty() -> None:
    """The appliance prunes <output>/checkpoints/step-*/ every few minutes; in the versioned
    bucket each pruned checkpoint (and an overwritten run) stays as noncurrent versions for as
    long as the lifecycle keeps them: var.run_noncurrent_version_days under the runs' prefix
    (make deploy's default OUTPUT; 7 by default, issue 44), 30 days elsewhere."""
    from appliance.storage.checkpoints import checkpoints_uri

    lifecycle = module()["resource"]["aws_s3_bucket_lifecycle_configuration"]["this"]
    rules = {ref(rule["id"]): rule for rule in lifecycle["rule"]}

    def prefix(rule: dict[str, Any]) -> str:
        (only,) = rule["filter"]
        value = ref(only["prefix"])
        if value.startswith("local."):
            value = ref(module()["locals"][value.removeprefix("local.")])
        return value

    def noncurrent_days(rule: dict[str, Any]) -> int:
        (expiration,) = rule["noncurrent_version_expiration"]
        return expiration["noncurrent_days"]

    runs = rules["expire-pruned-run-checkpoints"]
    assert ref(runs["status"]) == "Enabled"
    assert ref(noncurrent_days(runs)) == "var.run_noncurrent_version_days"
    assert module()["variable"]["run_noncurrent_version_days"]["default"] == 7
    assert runs["expiration"][0]["expired_object_delete_marker"] is True
    everything = rules["expire-overwritten-versions"]
    assert prefix(everything) == "" and noncurrent_days(everything) == 30
    runs_prefix = prefix(runs)
    assert runs_prefix.endswith("/") and runs_prefix != "/"

    # make deploy's default OUTPUT is under that prefix, and so are its checkpoints.
    script = (ROOT / "scripts" / "deploy.sh").read_text()
    (default_output,) = re.findall(r'JOB_OUTPUT="\$\{OUTPUT:-([^}]*)\}"', script)
    assert default_output.startswith(f"s3://$BUCKET/{runs_prefix}"), default_output
    key = checkpoints_uri(default_output.replace("$BUCKET", "b")).removeprefix("s3://b/")
    assert key.startswith(runs_prefix) and key.endswith("/checkpoints"), key
