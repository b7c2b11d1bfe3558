#!/usr/bin/env bash
# Install the Prometheus server and promtool (Debian package `prometheus`), idempotently.
# Used by tests/metrics/test_dashboards.py (promtool checks the dashboards' PromQL) and
# tests/e2e/test_prometheus_e2e.py (a real Prometheus scrapes a real `appliance train`).
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
# A fresh cloud machine often runs apt at boot (unattended-upgrades, cloud-init) and holds
# its locks for a few minutes: wait for them rather than fail the install. `install` waits on
# dpkg's lock itself (DPkg::Lock::Timeout); `update` does not wait on the lists lock (apt 2.6),
# so it is tried again until the same deadline.
timeout="${APT_LOCK_TIMEOUT:-600}"
wait_lock=(-o DPkg::Lock::Timeout="$timeout")
deadline=$((SECONDS + timeout))
until apt-get "${wait_lock[@]}" update -qq; do
  if ((SECONDS >= deadline)); then
    log "apt-get update kept failing for ${timeout}s (APT_LOCK_TIMEOUT): see its error above"
    exit 1
  fi
  log "apt-get update failed (another apt running?): trying again in 10 s"
  sleep 10
done
# --no-install-recommends: the server and promtool only, not node-exporter and friends.
apt-get "${wait_lock[@]}" install -y -qq --no-install-recommends prometheus >/dev/null
# The package's postinst may start a service on :9090 where an init system runs; the tests
# start their own server on a free port, so a running one does no harm.
log "$(prometheus --version 2>&1 | head -n1) installed"
