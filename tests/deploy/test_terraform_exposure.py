"""The Terraform module's EKS API endpoint is private by default, public only for the CIDR blocks
named; the runs' noncurrent-version retention is the user's to set (issue 44, item 12). The
endpoint was open to 0.0.0.0/0 by default, and an overwritten S3 run was unrecoverable after a
day."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import hcl2
import pytest

TERRAFORM = Path(__file__).parents[2] / "terraform"


def parsed(name: str) -> dict:
    with open(TERRAFORM / name) as f:
        return hcl2.load(f)


def variables() -> dict:
    return {
        k.strip('"'): v for block in parsed("variables.tf")["variable"] for k, v in block.items()
    }


def test_the_eks_endpoint_is_private_unless_cidr_blocks_are_named():
    cidrs = variables()["cluster_endpoint_public_access_cidrs"]
    assert cidrs["default"] == []
    (validation,) = cidrs["validation"]
    assert "cidrnetmask" in validation["condition"]
    (cluster,) = [
        body
        for block in parsed("main.tf")["resource"]
        for kind, named in block.items()
        if kind.strip('"') == "aws_eks_cluster"
        for body in named.values()
    ]
    (vpc,) = cluster["vpc_config"]
    assert vpc["endpoint_private_access"] is True
    public = vpc["endpoint_public_access"]
    assert "length(var.cluster_endpoint_public_access_cidrs) > 0" in public  # not `true`
    assert "0.0.0.0/0" not in (TERRAFORM / "variables.tf").read_text()


def test_the_runs_noncurrent_retention_is_a_variable():
    retention = variables()["run_noncurrent_version_days"]
    assert retention["default"] >= 7 and retention["type"] in ("number", "${number}")
    text = (TERRAFORM / "storage.tf").read_text()
    assert "noncurrent_days = var.run_noncurrent_version_days" in text
    assert "noncurrent_days = 1\n" not in text
    readme = (TERRAFORM / "README.md").read_text()
    assert "`run_noncurrent_version_days`" in readme
    assert "TF_VAR_cluster_endpoint_public_access_cidrs" in readme


def test_terraform_fmt_check_passes():
    terraform = shutil.which("terraform") or "/usr/local/bin/terraform"
    if not Path(terraform).exists():
        pytest.skip("terraform is not installed")
    done = subprocess.run(
        [terraform, "fmt", "-check", "-recursive", "-diff", str(TERRAFORM)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
