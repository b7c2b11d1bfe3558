#!/usr/bin/env bash
# Install the Prometheus server and promtool (Debian package `prometheus`), idempotently.
# Used by tests/test_dashboards.py (promtool checks the dashboards' PromQL) and
# tests/test_prometheus_e2e.py (a real Prometheus scrapes a real `appliance train`).
#
# Usage:   bash scripts/install-prometheus.sh     (called by `make test`)
# Needs:   apt-get and root, only when prometheus/promtool are missing. Returns at once when
#          both are on PATH; without root it says what to run and exits 0 (the tests skip).
set -euo pipefail

log() { printf '[install-prometheus] %s\n' "$*" >&2; }

if command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1; then
  log "$(prometheus --version 2>&1 | head -n1) already installed"
  exit 0
fi

if [[ "$(id -u)" != "0" ]]; then
  log "prometheus/promtool missing and not root: run 'sudo apt-get install -y prometheus'"
  exit 0
fi

command -v apt-get >/dev/null || { log "apt-get not found: install Prometheus by hand"; exit 1; }
export DEBIAN_FRONTEND=noninteractive
log "apt-get install prometheus"
apt-get update -qq
# --no-install-recommends: the server and promtool only, not node-exporter and friends.
apt-get install -y -qq --no-install-recommends prometheus >/dev/null
# The package's postinst may start a service on :9090 where an init system runs; the tests
# start their own server on a free port, so a running one does no harm.
log "$(prometheus --version 2>&1 | head -n1) installed"
