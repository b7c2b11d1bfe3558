"""`pytest -m gpu tests/` collects on the GPU machine's image, which lacks Ray, boto3 and some of
`make test`'s test dependencies: a collection error there would end the GPU proof before any GPU
test ran (benchmarks/gpu_proof.sh, stage `tests`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# not on the GPU image (the device tool's KINDS.md package list, 2026-11-17): Ray and boto3, and
# these test dependencies of pyproject's `test` extra
ABSENT_THERE = ("ray", "boto3", "moto", "hcl2", "jsonschema")


def test_gpu_tests_collect_without_ray_boto3_or_the_deploy_test_dependencies():
    script = (
        "import sys; "
        f"sys.modules.update(dict.fromkeys({ABSENT_THERE!r})); "  # None: `import` raises
        "import pytest; "
        "sys.exit(pytest.main(['-m', 'gpu', '--collect-only', '-q', '-p', 'no:cacheprovider', "
        "'tests/']))"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    collected = [line for line in run.stdout.splitlines() if "::" in line]
    assert any(line.startswith("tests/engine/test_engine_gpu.py::") for line in collected), (
        run.stdout
    )
    assert any(line.startswith("tests/quant/test_quant_gpu.py::") for line in collected), run.stdout
