#!/usr/bin/env bash
# Deploy the appliance to AWS, or tear it down. Called by deploy.mk:
#
#   make deploy  GPU_CLASS=a10|4090 [GPU_INSTANCE_TYPE=g5.12xlarge] [DRY_RUN=1] [MODEL=s3://...]
#                [DATA=s3://...] [OUTPUT=s3://...] [STEPS=N] [TRAIN_CONFIG=path.yaml]
#                [CHART_VALUES=extra-values.yaml] [IMAGE=repo:tag] [AUTO_APPROVE=1] [MONITORING=0]
#                [RELEASE=appliance]
#   make destroy GPU_CLASS=a10|4090 [DRY_RUN=1] [FORCE=1] [AUTO_APPROVE=1]
#
# GPU_INSTANCE_TYPE (or TF_VAR_gpu_instance_type): another instance type of the class's family
# (g5.* for a10, g6e.* for 4090) from the table below; terraform gets it, and the chart gets the
# matching gpuClassOverrides (GPUs, CPUs, memory, /dev/shm per worker pod).
#
# deploy:  terraform apply (VPC, EKS + GPU node group, device plugin, S3, IRSA, ECR)
#          -> aws eks update-kubeconfig -> docker build + push to ECR (unless IMAGE is given)
#          -> KubeRay operator -> kube-prometheus-stack (Prometheus + Grafana; MONITORING=0 skips)
#          -> the appliance chart, with values written from the terraform outputs
#          -> prints the port-forward commands for Grafana and the Ray dashboard.
# destroy: helm uninstall (chart, monitoring, KubeRay) -> terraform destroy.
#          FORCE=1 first lets terraform delete a non-empty bucket and image repository.
#
# DRY_RUN=1 touches no cloud: every command is printed (prefixed "+ "), terraform outputs are
# replaced by placeholders, and the chart is rendered with `helm template` into
# $DEPLOY_OUT_DIR/manifests (default build/deploy/<gpu class>/). Needs only helm
# (.tools/bin/helm from `make deploy-tools`, or helm on PATH).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" # printed commands use repo-relative paths
ACTION="${1:-}"
GPU_CLASS="${GPU_CLASS:-a10}"
DRY_RUN="${DRY_RUN:-}"
[[ "$DRY_RUN" == "0" ]] && DRY_RUN=""
AUTO_APPROVE="${AUTO_APPROVE:-}"
MONITORING="${MONITORING:-1}"
FORCE="${FORCE:-}"
RELEASE="${RELEASE:-appliance}"
OUT_DIR="${DEPLOY_OUT_DIR:-build/deploy/$GPU_CLASS}"
TF_DIR=terraform
CHART_DIR=helm/appliance
KUBERAY_VERSION="${KUBERAY_VERSION:-1.4.2}"
KUBE_PROMETHEUS_STACK_VERSION="${KUBE_PROMETHEUS_STACK_VERSION:-}"
MONITORING_NAMESPACE=prometheus-system
GPU_INSTANCE_TYPE="${GPU_INSTANCE_TYPE:-${TF_VAR_gpu_instance_type:-}}"

die() {
  echo "deploy.sh: $*" >&2
  exit 1
}

case "$GPU_CLASS" in
  a10) INSTANCE_FAMILY=g5 DEFAULT_INSTANCE_TYPE=g5.8xlarge ;;
  4090) INSTANCE_FAMILY=g6e DEFAULT_INSTANCE_TYPE=g6e.8xlarge ;;
  *) die "GPU_CLASS must be a10 or 4090 (got '$GPU_CLASS')" ;;
esac

# GPU instance types the chart can be sized for: type, GPUs, then per worker pod: CPUs (vCPUs
# minus 4 for the node), memory (under EKS's allocatable) and /dev/shm. The weight store is one
# copy per node, so shm follows host RAM, not the GPU count; memory leaves shm 8Gi plus 4Gi per
# extra GPU (each GPU runs a trainer). The 8xlarge rows are the chart's gpuClasses presets.
GPU_INSTANCE_SIZES="
g5.2xlarge    1    4   27Gi   19Gi
g5.4xlarge    1   12   56Gi   44Gi
g5.8xlarge    1   28  116Gi  100Gi
g5.16xlarge   1   60  232Gi  200Gi
g5.12xlarge   4   44  176Gi  156Gi
g5.24xlarge   4   92  360Gi  320Gi
g5.48xlarge   8  188  720Gi  640Gi
g6e.2xlarge   1    4   56Gi   44Gi
g6e.4xlarge   1   12  116Gi  100Gi
g6e.8xlarge   1   28  232Gi  200Gi
g6e.16xlarge  1   60  470Gi  420Gi
g6e.12xlarge  4   44  360Gi  320Gi
g6e.24xlarge  4   92  720Gi  640Gi
g6e.48xlarge  8  188 1440Gi 1300Gi
"

known_instance_types() {
  awk -v family="$INSTANCE_FAMILY." 'index($1, family) == 1 {print $1}' <<<"$GPU_INSTANCE_SIZES" \
    | paste -sd ' ' -
}

# "GPUS CPU MEMORY SHM" of an instance type of this GPU class; fails for any other type.
instance_sizes() {
  awk -v type="$1" -v family="$INSTANCE_FAMILY." \
    '$1 == type && index($1, family) == 1 {print $2, $3, $4, $5; found = 1} END {exit !found}' \
    <<<"$GPU_INSTANCE_SIZES"
}

if [[ -n "$GPU_INSTANCE_TYPE" ]] && ! instance_sizes "$GPU_INSTANCE_TYPE" >/dev/null; then
  die "GPU_INSTANCE_TYPE=$GPU_INSTANCE_TYPE is not a GPU_CLASS=$GPU_CLASS instance type this script can size the chart for; known: $(known_instance_types)"
fi

# Print a command, then run it (DRY_RUN: only print it).
run() {
  printf '+'
  printf ' %q' "$@"
  printf '\n'
  [[ -n "$DRY_RUN" ]] || "$@"
}

# Same, for a pipeline given as one string.
run_sh() {
  printf '+ %s\n' "$1"
  [[ -n "$DRY_RUN" ]] || bash -o pipefail -c "$1"
}

# `terraform output -raw NAME`, or a placeholder in a dry run.
tf_output() {
  local name="$1" placeholder="$2"
  if [[ -n "$DRY_RUN" ]]; then
    printf '+ terraform -chdir=%s output -raw %s   # dry run: %s\n' "$TF_DIR" "$name" "$placeholder" >&2
    echo "$placeholder"
  else
    terraform -chdir="$TF_DIR" output -raw "$name"
  fi
}

# `helm`: $HELM if set, else .tools/bin/helm (make deploy-tools) if present, else the one on PATH.
HELM_BIN="${HELM:-}"
helm() {
  if [[ -z "$HELM_BIN" ]]; then
    if [[ -x "$ROOT/.tools/bin/helm" ]]; then
      HELM_BIN="$ROOT/.tools/bin/helm"
    elif HELM_BIN="$(type -P helm)"; then
      :
    else
      die "helm not found: run 'make deploy-tools' (installs .tools/bin/helm) or install helm"
    fi
  fi
  "$HELM_BIN" "$@"
}

require_tools() {
  [[ -n "$DRY_RUN" ]] && return
  local missing=()
  for tool in "$@"; do command -v "$tool" >/dev/null || missing+=("$tool"); done
  ((${#missing[@]} == 0)) || die "missing on PATH: ${missing[*]} (DRY_RUN=1 shows what would run without them)"
}

approve_flag() {
  [[ -n "$AUTO_APPROVE" ]] && echo "-auto-approve" || true
}

# The -var arguments of every terraform apply/destroy.
tf_vars() {
  TF_VARS=(-var "gpu_class=$GPU_CLASS")
  if [[ -n "$GPU_INSTANCE_TYPE" ]]; then TF_VARS+=(-var "gpu_instance_type=$GPU_INSTANCE_TYPE"); fi
}

read_outputs() {
  CLUSTER="$(tf_output cluster_name "appliance-$GPU_CLASS")"
  REGION="$(tf_output region "us-east-1")"
  BUCKET="$(tf_output bucket_name "appliance-$GPU_CLASS-dry-run-bucket")"
  ROLE_ARN="$(tf_output irsa_role_arn "arn:aws:iam::000000000000:role/appliance-$GPU_CLASS-irsa-dry-run")"
  ECR_URL="$(tf_output ecr_repository_url "000000000000.dkr.ecr.us-east-1.amazonaws.com/appliance-$GPU_CLASS")"
  NODE_INSTANCE_TYPE="$(tf_output gpu_instance_type "${GPU_INSTANCE_TYPE:-$DEFAULT_INSTANCE_TYPE}")"
  GPU_NODE_COUNT="$(tf_output gpu_node_count 1)"
  NAMESPACE="$(tf_output kubernetes_namespace appliance)"
  SERVICE_ACCOUNT="$(tf_output service_account_name appliance)"
}

image_tag() {
  local tag
  tag="$(git -C "$ROOT" rev-parse --short=12 HEAD 2>/dev/null || echo dev)"
  # ECR tags are immutable: a dirty tree gets a unique tag.
  if [[ -n "$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null)" ]]; then
    tag="$tag-dirty-$(date +%Y%m%d%H%M%S)"
  fi
  echo "$tag"
}

write_monitoring_values() {
  # kube-prometheus-stack: scrape every PodMonitor, load dashboards from labelled ConfigMaps in any
  # namespace into the folder their grafana_folder annotation names, allow the Ray dashboard to
  # embed Grafana panels.
  cat >"$OUT_DIR/kube-prometheus-stack.values.yaml" <<'EOF'
prometheus:
  prometheusSpec:
    podMonitorSelectorNilUsesHelmValues: false
    serviceMonitorSelectorNilUsesHelmValues: false
grafana:
  sidecar:
    dashboards:
      enabled: true
      label: grafana_dashboard
      labelValue: "1"
      searchNamespace: ALL
      folderAnnotation: grafana_folder
      provider:
        foldersFromFilesStructure: true
  grafana.ini:
    security:
      allow_embedding: true
    auth.anonymous:
      enabled: true
      org_role: Viewer
EOF
}

job_paths() {
  JOB_MODEL="${MODEL:-s3://$BUCKET/models/base}"
  JOB_DATA="${DATA:-s3://$BUCKET/data}"
  JOB_OUTPUT="${OUTPUT:-s3://$BUCKET/runs/$RELEASE-$GPU_CLASS}"
}

write_chart_values() {
  local image_repo="$1" image_tag="$2" sizes gpus cpu memory shm
  sizes="$(instance_sizes "$NODE_INSTANCE_TYPE")" \
    || die "terraform's gpu_instance_type $NODE_INSTANCE_TYPE is not one this script can size the chart for (known: $(known_instance_types)); pass GPU_INSTANCE_TYPE= one of those"
  read -r gpus cpu memory shm <<<"$sizes"
  job_paths
  {
    echo "# Written by scripts/deploy.sh from the terraform outputs; helm -f uses it."
    echo "gpuClass: \"$GPU_CLASS\""
    echo "# Worker pods sized for $NODE_INSTANCE_TYPE (scripts/deploy.sh GPU_INSTANCE_SIZES)."
    echo "gpuClassOverrides:"
    echo "  instanceType: $NODE_INSTANCE_TYPE"
    echo "  gpusPerNode: $gpus"
    echo "  cpu: \"$cpu\""
    echo "  memory: $memory"
    echo "  shmSize: $shm"
    echo "image:"
    echo "  repository: $image_repo"
    echo "  tag: \"$image_tag\""
    echo "serviceAccount:"
    echo "  name: $SERVICE_ACCOUNT"
    echo "  roleArn: $ROLE_ARN"
    echo "worker:"
    echo "  replicas: $GPU_NODE_COUNT"
    echo "job:"
    echo "  model: $JOB_MODEL"
    echo "  data: $JOB_DATA"
    echo "  output: $JOB_OUTPUT"
    if [[ -n "${STEPS:-}" ]]; then echo "  steps: $STEPS"; fi
    echo "monitoring:"
    echo "  podMonitor:"
    if [[ "$MONITORING" == "0" ]]; then echo "    enabled: auto"; else echo "    enabled: true"; fi
  } >"$OUT_DIR/values.generated.yaml"
}

# metadata.name of the first object in a rendered manifest ("" when the file is absent).
rendered_name() {
  local file="$OUT_DIR/manifests/appliance/templates/$1"
  [[ -f "$file" ]] || return 0
  sed -n 's/^  name: //p' "$file" | head -n 1
}

# The job reads MODEL and DATA as soon as it starts: say what must be in the bucket by then.
print_uploads() {
  job_paths
  local uploads=()
  [[ -n "${MODEL:-}" ]] || uploads+=("aws s3 sync /path/to/base-model $JOB_MODEL   # config.json, *.safetensors, tokenizer.json")
  [[ -n "${DATA:-}" ]] || uploads+=("aws s3 sync /path/to/data-dir $JOB_DATA   # .jsonl/.txt files")
  ((${#uploads[@]} > 0)) || return 0
  echo
  echo "Before the training job can succeed, upload to the new bucket (or pass MODEL=/DATA=):"
  printf '  %s\n' "${uploads[@]}"
  echo "then start the job again: kubectl delete rayjob -n $NAMESPACE $JOB_NAME, and make deploy."
}

print_next_steps() {
  # The names the chart gave its objects (appliance.fullname in _helpers.tpl: <release>-appliance,
  # or the release alone when it contains "appliance"; fullnameOverride; ...), read back from the
  # rendered manifests so that they are right whatever RELEASE and CHART_VALUES were.
  local cluster_name
  cluster_name="$(rendered_name raycluster.yaml)"
  JOB_NAME="$(rendered_name rayjob.yaml)"
  [[ -n "$cluster_name" ]] || die "no RayCluster in $OUT_DIR/manifests: the chart rendered nothing?"
  echo
  if [[ -n "$DRY_RUN" ]]; then
    echo "Dry run: nothing was changed. Rendered chart: $OUT_DIR/manifests. After a real deploy:"
  else
    echo "Deployed GPU class $GPU_CLASS to cluster $CLUSTER. Watch the run:"
  fi
  echo "  kubectl get raycluster,rayjob,pods -n $NAMESPACE"
  if [[ -n "$JOB_NAME" ]]; then
    echo "  kubectl logs -n $NAMESPACE -f job/$JOB_NAME"
  fi
  cat <<EOF
Ray dashboard:
  kubectl port-forward -n $NAMESPACE svc/$cluster_name-head-svc 8265:8265      # http://127.0.0.1:8265
Grafana (dashboards in folder "Appliance"):
  kubectl port-forward -n $MONITORING_NAMESPACE svc/prometheus-grafana 3000:80   # http://127.0.0.1:3000
  kubectl get secret -n $MONITORING_NAMESPACE prometheus-grafana -o jsonpath='{.data.admin-password}' | base64 -d
EOF
  if [[ -n "$JOB_NAME" ]]; then print_uploads; fi
}

deploy() {
  require_tools terraform aws
  [[ -n "${IMAGE:-}" ]] || require_tools docker
  helm version >/dev/null # fail early when there is no helm
  mkdir -p "$OUT_DIR"
  echo "== terraform: VPC, EKS with the $GPU_CLASS GPU node group (${GPU_INSTANCE_TYPE:-$DEFAULT_INSTANCE_TYPE}), S3, IRSA, ECR"
  tf_vars
  run terraform -chdir="$TF_DIR" init -input=false
  # shellcheck disable=SC2046  # approve_flag is empty or one word
  run terraform -chdir="$TF_DIR" apply -input=false $(approve_flag) "${TF_VARS[@]}"
  read_outputs

  echo "== kubeconfig"
  run aws eks update-kubeconfig --name "$CLUSTER" --region "$REGION"

  local image_repo image_tag
  if [[ -n "${IMAGE:-}" ]]; then
    echo "== image: $IMAGE (given; not built)"
    image_repo="${IMAGE%:*}"
    image_tag="${IMAGE##*:}"
  else
    image_repo="$ECR_URL"
    image_tag="$(image_tag)"
    echo "== image: build and push $image_repo:$image_tag"
    run_sh "aws ecr get-login-password --region $REGION | docker login --username AWS --password-stdin ${ECR_URL%%/*}"
    run docker build -t "$image_repo:$image_tag" .
    run docker push "$image_repo:$image_tag"
  fi

  echo "== KubeRay operator $KUBERAY_VERSION"
  run helm repo add kuberay https://ray-project.github.io/kuberay-helm/ --force-update
  run helm upgrade --install kuberay-operator kuberay/kuberay-operator --version "$KUBERAY_VERSION" \
    --namespace kuberay-system --create-namespace --wait

  if [[ "$MONITORING" != "0" ]]; then
    echo "== monitoring: kube-prometheus-stack (Prometheus operator, Prometheus, Grafana)"
    write_monitoring_values
    run helm repo add prometheus-community https://prometheus-community.github.io/helm-charts --force-update
    run helm upgrade --install prometheus prometheus-community/kube-prometheus-stack \
      ${KUBE_PROMETHEUS_STACK_VERSION:+--version "$KUBE_PROMETHEUS_STACK_VERSION"} \
      --namespace "$MONITORING_NAMESPACE" --create-namespace --wait \
      -f "$OUT_DIR/kube-prometheus-stack.values.yaml"
  fi

  echo "== appliance chart"
  write_chart_values "$image_repo" "$image_tag"
  local chart_args=(--namespace "$NAMESPACE" -f "$OUT_DIR/values.generated.yaml")
  if [[ -n "${CHART_VALUES:-}" ]]; then
    [[ -f "$CHART_VALUES" ]] || die "CHART_VALUES=$CHART_VALUES: no such file"
    chart_args+=(-f "$CHART_VALUES")
  fi
  if [[ -n "${TRAIN_CONFIG:-}" ]]; then
    [[ -f "$TRAIN_CONFIG" ]] || die "TRAIN_CONFIG=$TRAIN_CONFIG: no such file"
    chart_args+=(--set-file "job.config=$TRAIN_CONFIG")
  fi
  rm -rf "$OUT_DIR/manifests"
  mkdir -p "$OUT_DIR/manifests"
  # Rendered for review in every run (and the only chart step of a dry run).
  DRY_RUN="" run helm template "$RELEASE" "$CHART_DIR" "${chart_args[@]}" --output-dir "$OUT_DIR/manifests"
  run helm upgrade --install "$RELEASE" "$CHART_DIR" --create-namespace "${chart_args[@]}"

  print_next_steps
}

destroy() {
  require_tools terraform aws
  helm version >/dev/null
  read_outputs
  tf_vars
  echo "== kubeconfig"
  run aws eks update-kubeconfig --name "$CLUSTER" --region "$REGION"
  echo "== helm releases (the RayCluster first, so its pods and volumes go before the nodes)"
  run helm uninstall "$RELEASE" --namespace "$NAMESPACE" --ignore-not-found --wait
  run helm uninstall prometheus --namespace "$MONITORING_NAMESPACE" --ignore-not-found --wait
  run helm uninstall kuberay-operator --namespace kuberay-system --ignore-not-found --wait
  echo "== terraform destroy"
  if [[ -n "$FORCE" ]]; then
    # force_destroy must be in the state before destroy honours it.
    # shellcheck disable=SC2046
    run terraform -chdir="$TF_DIR" apply -input=false $(approve_flag) "${TF_VARS[@]}" \
      -var force_destroy=true -target=aws_s3_bucket.this -target=aws_ecr_repository.this
  fi
  # shellcheck disable=SC2046
  run terraform -chdir="$TF_DIR" destroy -input=false $(approve_flag) "${TF_VARS[@]}"
  if [[ -z "$FORCE" ]]; then
    echo "(A bucket or image repository that still holds objects stops terraform destroy; rerun with FORCE=1 to delete them too.)"
  fi
}

case "$ACTION" in
  deploy) deploy ;;
  destroy) destroy ;;
  *) die "usage: scripts/deploy.sh deploy|destroy (see the header)" ;;
esac
