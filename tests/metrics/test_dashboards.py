"""Grafana dashboards and the local compose stack: every PromQL expression parses (promtool),
uses only metrics the appliance or Ray exports (checked against a live scrape of embedded Ray),
and the compose file's mounts and ports point at real files and agree with each other."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest
import yaml

from appliance.config import DEFAULT_METRICS_PORT
from appliance.metrics import names as N
from tests.metrics.test_metrics import (
    embedded_ray,
    record_everything_and_scrape,
    samples,
    scrape_until,
)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = ROOT / "helm" / "appliance" / "dashboards"
CHART_VALUES = yaml.safe_load((ROOT / "helm" / "appliance" / "values.yaml").read_text())
COMPOSE_DIR = ROOT / "deploy" / "compose"
DASHBOARD_FILES = sorted(DASHBOARDS.glob("*.json"))

# Ray node metrics that only exist on a node with a GPU, so a CPU scrape cannot show them.
# Source: Ray's metrics docs (https://docs.ray.io/en/latest/ray-observability/reference/
# system-metrics.html, "GPU" rows) and ray/dashboard/modules/reporter/reporter_agent.py
# (METRICS_GAUGES); test_gpu_only_metrics_are_rays_own checks each name in the installed Ray.
GPU_ONLY_METRICS = {
    "ray_node_gpus_available",
    "ray_node_gpus_utilization",
    "ray_node_gram_used",
    "ray_node_gram_available",
}

# Appliance series the dashboards use that only a GPU run records, so the CPU run of
# tests/e2e/test_prometheus_e2e.py cannot show them (a key with labels excludes only selectors that
# carry those matchers). Every other `ray_appliance_*` selector a dashboard uses must match series
# in that real run's Prometheus data; test_gpu_only_appliance_series_are_real_and_used keeps this
# list from rotting.
APPLIANCE_GPU_ONLY_SERIES = {
    "ray_appliance_gpu_busy_ratio": "timed with CUDA events on the compute stream",
    "ray_appliance_gpu_nvml_utilization_ratio": "sampled from NVML, which needs an NVIDIA GPU",
    "ray_appliance_gpu_memory_allocated_bytes": "torch.cuda.memory_allocated()",
    "ray_appliance_gpu_memory_reserved_bytes": "torch.cuda.memory_reserved()",
    "ray_appliance_mfu_ratio": "needs the peak FLOP/s of a known GPU (hardware.PEAK_BF16_FLOPS)",
    "ray_appliance_h2d_bytes_total": "on a CPU the weights are used in place: nothing is copied, "
    "and a counter is only created by a positive increment",
    "ray_appliance_h2d_seconds_total": "no host-to-device copies on a CPU (as h2d_bytes)",
    'ray_appliance_phase_seconds_total{phase="h2d_stall"}': "the wait for a weight copy, timed "
    "with CUDA events: always 0 on a CPU, so never added to the counter",
}

# Grafana's variables, replaced by values Prometheus accepts before promtool or a query sees them.
GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "$cluster": ".*",
    "$run": ".*",
}

PROMQL_KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "inf", "nan", "atan2",
}  # fmt: skip


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def expressions(dashboard: dict) -> list[str]:
    """Every PromQL expression of a dashboard: panel targets (rows included) and query variables."""
    found = []

    def panels(items: list) -> Iterator[dict]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for panel in panels(dashboard.get("panels", [])):
        found += [t["expr"] for t in panel.get("targets", []) if t.get("expr")]
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query)
            assert m, f"variable {var['name']}: unexpected query {query!r}"
            found.append(m.group(1))
    return found


def substitute(expr: str) -> str:
    for var, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(var, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (function, aggregator and label names left out)."""
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    s = re.sub(r"\{[^}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\]]*\]", " ", s)  # range durations
    s = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", s)
    names = set()
    for m in re.finditer(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", s):
        rest = s[m.end() :].lstrip()
        if m.group() in PROMQL_KEYWORDS or rest.startswith("("):
            continue  # a keyword, or a function / aggregator call
        names.add(m.group())
    return names


ALL_EXPRESSIONS = [(p.name, e) for p in DASHBOARD_FILES for e in expressions(load(p))]


# ---------------------------------------------------------------------- structure


def test_the_four_dashboards_exist_with_unique_uids():
    names = {p.stem for p in DASHBOARD_FILES}
    assert names == {"training", "utilization", "step-time", "data"}
    uids = [load(p)["uid"] for p in DASHBOARD_FILES]
    assert len(set(uids)) == len(uids)
    for p in DASHBOARD_FILES:
        d = load(p)
        assert d["title"].startswith("Appliance / ") and "appliance" in d["tags"]
        ids = [panel["id"] for panel in d["panels"]]
        assert len(set(ids)) == len(ids), f"{p.name}: duplicate panel ids"


def test_datasource_is_a_template_variable_everywhere():
    """No hard-wired datasource uid: Helm's Grafana and the compose one name theirs differently."""
    for p in DASHBOARD_FILES:
        d = load(p)
        variables = {v["name"]: v for v in d["templating"]["list"]}
        ds = variables["datasource"]
        assert ds["type"] == "datasource" and ds["query"] == "prometheus"

        def walk(node: object, where: str) -> None:
            if isinstance(node, dict):
                if "datasource" in node:
                    expected = {"type": "prometheus", "uid": "${datasource}"}
                    assert node["datasource"] == expected, where
                for k, v in node.items():
                    walk(v, f"{where}.{k}")
            elif isinstance(node, list):
                for item in node:
                    walk(item, where)

        walk(d, p.stem)
        data_panels = [x for x in d["panels"] if x["type"] != "row"]
        assert all("datasource" in x for x in data_panels)


def test_dashboards_show_what_the_issue_asks_for():
    text = {p.stem: json.dumps(load(p)) for p in DASHBOARD_FILES}
    wanted = {
        "training": ["ray_appliance_tokens_total", "ray_appliance_loss",
                     "ray_appliance_learning_rate", "ray_appliance_mfu_ratio"],
        "utilization": ["ray_appliance_gpu_busy_ratio",
                        "ray_appliance_gpu_nvml_utilization_ratio", "ray_node_gpus_utilization",
                        "ray_appliance_gpu_memory_allocated_bytes", "ray_node_gram_used",
                        "ray_node_cpu_utilization", "ray_object_store_memory"],
        "step-time": ["ray_appliance_phase_seconds_total", "data_wait", "h2d_stall"],
        "data": ["ray_appliance_tokenizer_tokens_total", "ray_appliance_batches_in_flight"],
    }  # fmt: skip
    for stem, names in wanted.items():
        for name in names:
            assert name in text[stem], f"{stem}.json does not use {name}"
    step_time = load(DASHBOARDS / "step-time.json")
    stacked = [
        p
        for p in step_time["panels"]
        if p["type"] == "timeseries"
        and p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
        and any("by (phase)" in t["expr"] for t in p["targets"])
    ]
    assert stacked, "no stacked per-phase panel in step-time.json"
    titles = " ".join(p["title"].lower() for p in step_time["panels"])
    assert "data wait" in titles and "h2d stall" in titles  # called out on their own
    for panel in stacked:  # ... and in their own colours wherever phases are stacked
        colored = {o["matcher"]["options"] for o in panel["fieldConfig"]["overrides"]}
        assert {"data_wait", "h2d_stall"} <= colored, panel["title"]
    # busy (CUDA events) and NVML utilization in one panel, to read side by side
    utilization = load(DASHBOARDS / "utilization.json")["panels"]
    assert any(
        {"ray_appliance_gpu_busy_ratio", "ray_appliance_gpu_nvml_utilization_ratio"}
        <= {n for t in p.get("targets", []) for n in metric_names(t["expr"])}
        for p in utilization
    ), "no panel shows GPU busy beside NVML utilization"


def test_every_selector_filters_by_cluster_and_appliance_ones_by_run():
    """Two releases scraped by one Prometheus must not mix (ray_io_cluster, which the chart's
    PodMonitor sets), nor two runs on one cluster (the appliance's `run` label: every RayJob on
    a cluster shares one Ray SessionName)."""
    for p in DASHBOARD_FILES:
        d = load(p)
        variables = {v["name"]: v for v in d["templating"]["list"]}
        for name, label in (("cluster", "ray_io_cluster"), ("run", "run")):
            assert variables[name]["query"]["query"].endswith(f", {label})"), p.name
            assert variables[name]["allValue"] == ".*", p.name  # All matches an absent label
        for expr in expressions(d):
            for selector in re.findall(r"\b(ray_\w+)(\{[^}]*\})?", expr):
                name, matchers = selector
                if name in {"ray_appliance_steps_total", "ray_io_cluster"} and not matchers:
                    continue  # a variable's label_values() query
                assert 'ray_io_cluster=~"$cluster"' in matchers, (p.name, expr)
                if name.startswith("ray_appliance_"):
                    assert 'run=~"$run"' in matchers, (p.name, expr)
        assert not [e for e in expressions(d) if "SessionName" in e], p.name
    podmonitor = (ROOT / "helm/appliance/templates/podmonitor.yaml").read_text()
    assert "targetLabel: ray_io_cluster" in podmonitor
    assert N.RUN_TAG == "run"


# ---------------------------------------------------------------------- PromQL


def test_metric_name_extraction():
    assert metric_names(
        'sum by (phase) (rate(a_total{x="b{c}", rank!="driver"}[1m])) / ignoring(phase) '
        "group_left sum(rate(b_total[5m])) * 1e3"
    ) == {"a_total", "b_total"}
    assert metric_names("topk(8, sum by (Component) (c)) or vector(0)") == {"c"}
    assert metric_names("histogram_quantile(0.9, sum by (le) (rate(h_bucket[1m])))") == {"h_bucket"}


def test_every_expression_parses_with_promtool(tmp_path):
    """promtool has no per-expression check: the expressions become recording rules."""
    if shutil.which("promtool") is None:
        pytest.skip("promtool not installed: run scripts/install-prometheus.sh")
    assert len(ALL_EXPRESSIONS) > 20
    rules = [
        {"record": f"dashboard:{Path(name).stem.replace('-', '_')}:expr{i}", "expr": substitute(e)}
        for i, (name, e) in enumerate(ALL_EXPRESSIONS)
    ]
    path = tmp_path / "dashboards.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout + out.stderr


def test_gpu_only_metrics_are_rays_own():
    """The GPU-only names are Ray's (its reporter agent declares them), not made up here."""
    spec = find_spec("ray.dashboard.modules.reporter.reporter_agent")
    assert spec is not None and spec.origin
    source = Path(spec.origin).read_text()
    for name in GPU_ONLY_METRICS:
        assert f'"{name.removeprefix("ray_")}": Gauge(' in source, name


@pytest.fixture(scope="module")
def live_sample_names() -> Iterator[set[str]]:
    """Sample names served by embedded Ray after every appliance metric was recorded once."""
    used = {n for _, e in ALL_EXPRESSIONS for n in metric_names(e)}
    with embedded_ray() as port:
        record_everything_and_scrape(port)
        # Ray's node metrics arrive with the agent's next report: wait for the ones we use
        text = scrape_until(port, used - GPU_ONLY_METRICS)
        yield {name for name, _, _ in samples(text)}


def split_selector(selector: str) -> tuple[str, list[str]]:
    """`name{a="x", b!="y"}` → ("name", ['a="x"', 'b!="y"']) (no commas inside label values)."""
    name, _, matchers = selector.partition("{")
    return name, [m.strip() for m in matchers.rstrip("}").split(",") if m.strip()]


def appliance_selectors(expr: str) -> set[str]:
    """The `ray_appliance_*` selectors of a (substituted) expression, label matchers included."""
    return {m.group(0) for m in re.finditer(r"\bray_appliance_[a-zA-Z0-9_]+(\{[^}]*\})?", expr)}


def gpu_only(selector: str) -> bool:
    """Whether a selector only matches series a GPU run records (APPLIANCE_GPU_ONLY_SERIES)."""
    name, matchers = split_selector(selector)
    for key in APPLIANCE_GPU_ONLY_SERIES:
        key_name, key_matchers = split_selector(key)
        if key_name == name and set(key_matchers) <= set(matchers):
            return True
    return False


def test_selector_helpers():
    expr = (
        'sum(rate(ray_appliance_phase_seconds_total{SessionName=~".+", phase="h2d_stall"}[1m])) '
        '/ sum(rate(ray_appliance_steps_total{SessionName=~".+"}[1m])) + ray_appliance_loss'
    )
    found = appliance_selectors(expr)
    assert found == {
        'ray_appliance_phase_seconds_total{SessionName=~".+", phase="h2d_stall"}',
        'ray_appliance_steps_total{SessionName=~".+"}',
        "ray_appliance_loss",
    }
    assert [s for s in sorted(found) if gpu_only(s)] == [
        'ray_appliance_phase_seconds_total{SessionName=~".+", phase="h2d_stall"}'
    ]
    assert not gpu_only('ray_appliance_phase_seconds_total{phase="data_wait"}')


def test_gpu_only_appliance_series_are_real_and_used():
    """Each GPU-only entry names a declared metric, says why, and some dashboard selects it."""
    declared = {n for spec in N.REGISTRY for n in spec.sample_names}
    used = {sel for _, e in ALL_EXPRESSIONS for sel in appliance_selectors(substitute(e))}
    for key, reason in APPLIANCE_GPU_ONLY_SERIES.items():
        name, _ = split_selector(key)
        assert name in declared, key
        assert reason.strip(), key
        assert any(gpu_only(sel) and split_selector(sel)[0] == name for sel in used), (
            f"{key} is listed as GPU-only but no dashboard selects it"
        )


@pytest.mark.integration
def test_every_metric_the_dashboards_use_is_declared_and_served(live_sample_names):
    """Names only: an actor that records every declared metric (RecordEverything) makes them
    appear. That real code records them is tests/e2e/test_prometheus_e2e.py's question."""
    appliance = {n for spec in N.REGISTRY for n in spec.sample_names}
    missing = {}
    for name, expr in ALL_EXPRESSIONS:
        for metric in metric_names(expr):
            if metric.startswith("ray_appliance_"):
                ok = metric in appliance and metric in live_sample_names
            else:
                ok = metric in live_sample_names or metric in GPU_ONLY_METRICS
            if not ok:
                missing.setdefault(name, set()).add(metric)
    assert not missing, f"dashboards use metrics nobody exports: {missing}"


# ---------------------------------------------------------------------- deploy/compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((COMPOSE_DIR / "docker-compose.yml").read_text())


def compose_comment() -> str:
    """The compose file's leading comment (how to run your own job with it)."""
    lines = (COMPOSE_DIR / "docker-compose.yml").read_text().splitlines()
    return "\n".join(line for line in lines if line.startswith("#"))


def bind_mounts(service: dict) -> list[tuple[Path, str]]:
    """(host path resolved against the compose dir, container path) of a service's bind mounts."""
    mounts = []
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith((".", "/")):
            mounts.append(((COMPOSE_DIR / source).resolve(), target))
    return mounts


def test_compose_services_gpu_and_shm(compose):
    services = compose["services"]
    assert set(services) == {"appliance", "prometheus", "grafana"}
    app = services["appliance"]
    devices = app["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": "all", "capabilities": ["gpu"]}]
    assert app["shm_size"]
    # SIGTERM's step and checkpoint get the chart's grace, not compose's 10 s; an init reaps
    grace = re.fullmatch(r"(\d+)m", app["stop_grace_period"])
    assert grace and int(grace.group(1)) * 60 >= CHART_VALUES["gracefulStopSeconds"]
    assert app["init"] is True
    assert "--auto-resume" in compose_comment()  # the documented own run survives a stop
    assert (COMPOSE_DIR / app["build"]["context"] / app["build"]["dockerfile"]).is_file()
    named = set(compose.get("volumes", {}))
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith((".", "/")) or source in named, f"undeclared volume {source}"


def test_compose_mounts_point_at_real_files(compose):
    for name, service in compose["services"].items():
        for host, _ in bind_mounts(service):
            assert host.exists(), f"{name}: mount source {host} does not exist"
    grafana = dict((t, h) for h, t in bind_mounts(compose["services"]["grafana"]))
    dashboards = grafana["/var/lib/grafana/dashboards/appliance"]
    assert dashboards == DASHBOARDS.resolve(), "Grafana must mount the Helm chart's dashboards"
    env = compose["services"]["grafana"]["environment"]
    home = Path(env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])
    assert (dashboards / home.relative_to("/var/lib/grafana/dashboards/appliance")).is_file()
    provisioning = grafana["/etc/grafana/provisioning"]
    provider = yaml.safe_load((provisioning / "dashboards" / "appliance.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/appliance"
    datasource = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    (ds,) = datasource["datasources"]
    prometheus_port = compose["services"]["prometheus"]["ports"][0].split(":")[1]
    assert ds["type"] == "prometheus" and ds["url"] == f"http://prometheus:{prometheus_port}"


def test_compose_prometheus_scrapes_the_appliance_metrics_port(compose):
    services = compose["services"]
    prom_mounts = {t: h for h, t in bind_mounts(services["prometheus"])}
    config_path = prom_mounts["/etc/prometheus/prometheus.yml"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    config = yaml.safe_load(config_path.read_text())
    jobs = config["scrape_configs"]
    targets = [t for job in jobs for sc in job["static_configs"] for t in sc["targets"]]
    app = services["appliance"]
    port = re.search(r"--metrics-port[ =](\d+)", app["command"]).group(1)
    assert targets == [f"appliance:{port}"]
    assert f"127.0.0.1:{port}:{port}" in app["ports"]  # loopback only (issue 44, item 11)
    if shutil.which("promtool"):
        out = subprocess.run(
            ["promtool", "check", "config", str(config_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr


def test_metrics_port_defaults_to_8080_where_compose_and_kuberay_scrape(compose):
    """`appliance train` without --metrics-port serves where deploy/compose's Prometheus and the
    chart's PodMonitor (KubeRay's metrics-export-port) look, and where docs/metrics.md says."""
    assert DEFAULT_METRICS_PORT == 8080  # --metrics-port unset: 8080 when free
    config = yaml.safe_load((COMPOSE_DIR / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["static_configs"][0]["targets"] == ["appliance:8080"]
    assert "--metrics-port 8080" in compose["services"]["appliance"]["command"]
    raycluster = (ROOT / "helm" / "appliance" / "templates" / "raycluster.yaml").read_text()
    assert raycluster.count('"metrics-export-port" "8080"') == 2  # head and workers
    assert "http://127.0.0.1:8080/metrics" in (ROOT / "docs" / "metrics.md").read_text()


# ------------------------------------------------- deploy/compose/dashboards.yml (a native run)


@pytest.fixture(scope="module")
def native() -> dict:
    """`make dashboards`: Prometheus and Grafana for an `appliance train` run on the host."""
    return yaml.safe_load((COMPOSE_DIR / "dashboards.yml").read_text())


def test_native_dashboards_need_no_gpu_and_listen_on_loopback_only(native):
    services = native["services"]
    assert set(services) == {"prometheus", "grafana"}  # no appliance container, no GPU
    for name, service in services.items():
        assert service["network_mode"] == "host", name  # reaches the run's loopback endpoint
        assert "ports" not in service and "deploy" not in service, name
    assert "--web.listen-address=127.0.0.1:9090" in services["prometheus"]["command"]
    env = services["grafana"]["environment"]
    assert env["GF_SERVER_HTTP_ADDR"] == "127.0.0.1"
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^$]+\}", env["GF_SECURITY_ADMIN_PASSWORD"])
    assert str(env["GF_AUTH_ANONYMOUS_ENABLED"]).lower() == "false"
    named = set(native.get("volumes", {}))
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            assert source.startswith((".", "/")) or source in named, f"{name}: {source}"
        for host, _ in bind_mounts(service):
            assert host.exists(), f"{name}: mount source {host} does not exist"
    makefile = (ROOT / "Makefile").read_text()
    assert "docker compose -f deploy/compose/dashboards.yml" in makefile
    assert (
        re.search(r"^dashboards:", makefile, re.M)
        and "make dashboards" in (ROOT / "docs" / "metrics.md").read_text()
    )


def test_native_prometheus_scrapes_where_appliance_train_serves_and_validates(native):
    from appliance.config import FIELDS

    mounts = {t: h for h, t in bind_mounts(native["services"]["prometheus"])}
    config_path = mounts["/etc/prometheus/prometheus.yml"]
    config = yaml.safe_load(config_path.read_text())
    targets = [t for job in config["scrape_configs"] for s in job["static_configs"] for t in s["targets"]]  # fmt: skip
    # the run's defaults: --metrics-host 127.0.0.1, --metrics-port 8080
    assert targets == [f"{FIELDS['metrics_host'].default}:{DEFAULT_METRICS_PORT}"]
    if shutil.which("promtool"):
        out = subprocess.run(
            ["promtool", "check", "config", str(config_path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stdout + out.stderr
    compose = shutil.which("docker")
    if (
        compose
        and subprocess.run([compose, "compose", "version"], capture_output=True).returncode == 0
    ):
        out = subprocess.run(
            [compose, "compose", "-f", str(COMPOSE_DIR / "dashboards.yml"), "config", "-q"],
            capture_output=True,
            text=True,
            timeout=60,
            env={"GRAFANA_ADMIN_PASSWORD": "x", "PATH": "/usr/bin:/bin"},
        )
        assert out.returncode == 0, out.stderr


def test_native_grafana_provisions_the_charts_dashboards_on_its_prometheus(native):
    grafana = {t: h for h, t in bind_mounts(native["services"]["grafana"])}
    dashboards = grafana["/var/lib/grafana/dashboards/appliance"]
    assert dashboards == DASHBOARDS.resolve(), "Grafana must mount the Helm chart's dashboards"
    home = Path(native["services"]["grafana"]["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"])  # fmt: skip
    assert (dashboards / home.relative_to("/var/lib/grafana/dashboards/appliance")).is_file()
    provider = yaml.safe_load(
        (grafana["/etc/grafana/provisioning/dashboards"] / "appliance.yml").read_text()
    )
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards/appliance"
    sources = grafana["/etc/grafana/provisioning/datasources"]
    (ds,) = yaml.safe_load((sources / "prometheus.yml").read_text())["datasources"]
    listen = next(
        a.split("=", 1)[1]
        for a in native["services"]["prometheus"]["command"]
        if a.startswith("--web.listen-address=")
    )
    assert ds["url"] == f"http://{listen}" and ds["isDefault"] is True
    for p in DASHBOARD_FILES:  # every dashboard's datasource variable takes this one's type
        variables = {v["name"]: v for v in load(p)["templating"]["list"]}
        assert variables["datasource"]["query"] == ds["type"] == "prometheus", p.name
