"""deploy/compose binds loopback only and has no default Grafana password (issue 44, item 11):
Grafana listened on 0.0.0.0:3000 with anonymous access and admin/admin; Prometheus and the
metrics endpoint on every interface."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

COMPOSE = Path(__file__).parents[2] / "deploy" / "compose" / "docker-compose.yml"


def services() -> dict:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def test_every_published_port_is_on_loopback():
    published = [(name, p) for name, s in services().items() for p in s.get("ports", [])]
    assert published  # Grafana, Prometheus, the metrics endpoint
    for name, port in published:
        spec = port if isinstance(port, str) else f"{port.get('host_ip')}:{port.get('published')}"
        assert spec.startswith("127.0.0.1:"), f"{name} publishes {spec} on every interface"


def test_grafana_needs_an_admin_password_and_has_no_anonymous_access():
    env = services()["grafana"]["environment"]
    password = env["GF_SECURITY_ADMIN_PASSWORD"]
    # compose's `${VAR:?message}`: `up` stops with the message when the variable is unset
    m = re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?(.+)\}", password)
    assert m and "GRAFANA_ADMIN_PASSWORD" in m.group(1) and "$" not in m.group(1)
    assert str(env.get("GF_AUTH_ANONYMOUS_ENABLED", "false")).lower() == "false"
    assert "GF_AUTH_ANONYMOUS_ORG_ROLE" not in env
    assert "GRAFANA_ADMIN_PASSWORD" in COMPOSE.read_text().split("services:")[0]  # the comment


def test_the_appliance_listens_where_its_prometheus_can_scrape_it():
    """Inside its container the endpoint must listen beyond loopback for the Prometheus
    container to reach it (the host publishes it on loopback only)."""
    command = services()["appliance"]["command"]
    assert "--metrics-host 0.0.0.0" in command
    assert "--metrics-host 0.0.0.0" in COMPOSE.read_text().split("services:")[0]  # own runs
