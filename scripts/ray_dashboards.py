"""Write Ray's own Grafana dashboard into the Helm chart (helm/appliance/dashboards-ray/).

The Ray dashboard's Metrics tab embeds panels of the Grafana dashboard with uid
`rayDefaultDashboard`, which Ray generates at run time on the head node only for a Grafana it
provisions itself. The chart ships the same JSON, generated here from the installed Ray, in a
ConfigMap that kube-prometheus-stack's Grafana sidecar loads (folder "Ray").

    .venv/bin/python scripts/ray_dashboards.py     # after changing the image's RAY_VERSION

The installed Ray must be the chart's rayVersion (a test compares the file with a fresh one).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import ray
import yaml
from ray.dashboard.modules.metrics.grafana_dashboard_factory import (
    generate_default_grafana_dashboard,
)

CHART = Path(__file__).resolve().parents[1] / "helm" / "appliance"
OUT = CHART / "dashboards-ray" / "ray-default.json"


def generate() -> str:
    """Ray's default dashboard as the chart ships it (Ray's JSON, re-indented)."""
    content, _uid = generate_default_grafana_dashboard()
    return json.dumps(json.loads(content), indent=1, sort_keys=True) + "\n"


def main() -> int:
    want = str(yaml.safe_load((CHART / "values.yaml").read_text())["rayVersion"])
    if ray.__version__ != want:
        print(
            f"installed ray {ray.__version__} is not the chart's rayVersion {want}", file=sys.stderr
        )
        return 1
    OUT.write_text(generate())
    print(f"wrote {OUT.relative_to(CHART.parents[1])} (Ray {ray.__version__})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
