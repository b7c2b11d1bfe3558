#!/usr/bin/env bash
# Deploy the appliance to AWS, or tear it down. Called by deploy.mk:
#
#   make deploy  GPU_CLASS=a10|4090 [GPU_INSTANCE_TYPE=g5.12xlarge] [DRY_RUN=1] [MODEL=s3://...]
#                [DATA=s3://...] [OUTPUT=s3://...] [STEPS=N] [TRAIN_CONFIG=path.yaml]
#                [CHART_VALUES=extra-values.yaml] [IMAGE=repo:tag] [AUTO_APPROVE=1] [MONITORING=0]
#                [RELEASE=appliance] [RERUN=1] [REPLACE_RUNNING=1]
#   (the options of the last successful deploy of the GPU class are reused for each one not
#   given: see "the settings of the last deploy" below; STEPS= given empty drops one)
#   make destroy GPU_CLASS=a10|4090 [DRY_RUN=1] [FORCE=1] [AUTO_APPROVE=1]
#
# GPU_INSTANCE_TYPE (or TF_VAR_gpu_instance_type): another instance type of the class's family
# (g5.* for a10, g6e.* for 4090) from the table below; terraform gets it, and the chart gets the
# matching gpuClassOverrides (GPUs, CPUs, memory, /dev/shm per worker pod).
#
# deploy:  terraform apply in the workspace named after the GPU class (one state per class: the
#          a10 and 4090 stacks never replace or destroy each other)
#          -> aws eks update-kubeconfig into a kubeconfig of its own, $OUT_DIR/kubeconfig (context
#             alias = the cluster name): every kubectl/helm call names that file and context, so
#             the user's ~/.kube/config and its current context are never touched or used
#          -> docker build --platform linux/amd64 + push to ECR, unless IMAGE is given or the tag
#             is already in ECR (the repository is IMMUTABLE: a second push of a tag is refused).
#             The tag is the commit; when the build context differs from it (an edit, a new file
#             not yet added), plus a hash of the context's files: `scripts/deploy.sh image-tag`
#             prints it.
#          -> KubeRay's CRDs (deploy/kuberay/crds, server-side apply) and operator $KUBERAY_VERSION
#          -> kube-prometheus-stack (pinned; Prometheus on a volume; MONITORING=0 skips)
#             (before each `helm upgrade --install`, a release left pending-* by an interrupted
#             deploy is rolled back to its last deployed revision, or uninstalled if it never
#             deployed: helm refuses to upgrade it otherwise)
#          -> the appliance chart, with values written from the terraform outputs (the first
#             release in the stack creates the IRSA ServiceAccount and the Grafana dashboards;
#             another, RELEASE=foo, reuses them: see shared_objects); a finished RayJob whose
#             spec changed (its checksum/job annotation) is deleted first so that the new one
#             runs (KubeRay never resubmits a finished job); RERUN=1 deletes a finished one
#             anyway, to train again. A RayJob still running is never deleted (the deploy stops,
#             saying what changed) unless REPLACE_RUNNING=1
#          -> prints the port-forward commands for Grafana and the Ray dashboard.
# destroy: every step before terraform destroy is best-effort: a missing output, a cluster that is
#          already gone or a release that was never installed is reported and skipped.
#          helm uninstall (chart, monitoring, KubeRay) -> terraform destroy. The image repository
#          goes with its images (they can be rebuilt); FORCE=1 also lets terraform empty the
#          bucket, which holds the checkpoints.
#
# DRY_RUN=1 touches no cloud: every command is printed (prefixed "+ "), terraform outputs are
# replaced by placeholders, queries (is the image in ECR? what does the live RayJob say?) are
# printed and answered "no", and the chart is rendered with `helm template` into
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
FORCE="${FORCE:-}"
RERUN="${RERUN:-}"
REPLACE_RUNNING="${REPLACE_RUNNING:-}"
OUT_DIR="${DEPLOY_OUT_DIR:-build/deploy/$GPU_CLASS}"
# This class's cluster only, written by `aws eks update-kubeconfig --kubeconfig`.
KUBECONFIG_FILE="$OUT_DIR/kubeconfig"
TF_DIR=terraform
CHART_DIR=helm/appliance
# KubeRay >= 1.6 for RayCluster upgradeStrategy; the CRDs in deploy/kuberay/crds are this release's.
KUBERAY_VERSION="${KUBERAY_VERSION:-1.7.0}"
KUBERAY_CRDS=deploy/kuberay/crds
# Pinned: an unpinned chart changes Prometheus, Grafana and their CRDs under a redeploy.
KUBE_PROMETHEUS_STACK_VERSION="${KUBE_PROMETHEUS_STACK_VERSION:-81.6.2}"
# Prometheus keeps its data on an EBS volume (gp2: the StorageClass every EKS cluster has; the
# EBS CSI driver add-on from terraform provisions it), so a pod restart loses no history.
PROMETHEUS_STORAGE_GI="${PROMETHEUS_STORAGE_GI:-50}"
MONITORING_NAMESPACE=prometheus-system

die() {
  echo "deploy.sh: $*" >&2
  exit 1
}

# The settings of the last deploy: load_settings, save_settings, print_reused_settings.
# shellcheck source=scripts/deploy-settings.sh
source "$ROOT/scripts/deploy-settings.sh"

if [[ -z "${GPU_INSTANCE_TYPE+set}" && -n "${TF_VAR_gpu_instance_type+set}" ]]; then
  GPU_INSTANCE_TYPE="$TF_VAR_gpu_instance_type"
fi
if [[ "$ACTION" == deploy ]]; then
  load_settings "$SETTINGS_FILE" "${STACK_SETTINGS[@]}"
fi
RELEASE="${RELEASE:-}"
GIVEN[RELEASE]="$RELEASE"
RELEASE="${RELEASE:-appliance}"
# The chart names its objects RELEASE, or RELEASE-appliance when the release name lacks the
# chart's: a DNS label of at most 40 characters (helm/appliance/templates/_helpers.tpl), checked
# here too so that a deploy stops before terraform, not at the chart
FULLNAME="$RELEASE"
[[ "$RELEASE" == *appliance* ]] || FULLNAME="$RELEASE-appliance"
[[ "$RELEASE" =~ ^[a-z]([-a-z0-9]*[a-z0-9])?$ && ${#FULLNAME} -le 40 ]] \
  || die "RELEASE=$RELEASE: the chart's objects would be named $FULLNAME: a release name is lower-case letters, digits and '-', starting with a letter, and its objects' name at most 40 characters"
if [[ "$ACTION" == deploy ]]; then
  load_settings "$(release_settings_file "$RELEASE")" "${RELEASE_SETTINGS[@]}"
fi
for setting in GPU_INSTANCE_TYPE MONITORING "${RELEASE_SETTINGS[@]}"; do
  printf -v "$setting" '%s' "${!setting-}"
  [[ "${!setting}" != *$'\n'* ]] || die "$setting must be one line"
  GIVEN[$setting]="${!setting}"
done
MONITORING="${MONITORING:-1}"

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

# A read-only query whose answer decides what runs next (is the tag in ECR? what does the live
# RayJob carry?): printed, then run; a dry run prints it and answers with a failure and no output.
# The command line goes to stderr: its stdout is the answer (callers use "$(query ...)").
# `query --status CMD...`: only the exit status matters; the command's output is dropped.
# `query --quiet CMD...`: its stderr is dropped (a failure is an answer, not an error).
query() {
  local status_only="" quiet=""
  while [[ "$1" == --status || "$1" == --quiet ]]; do
    if [[ "$1" == --status ]]; then status_only=1; else quiet=1; fi
    shift
  done
  {
    printf '+'
    printf ' %q' "$@"
    if [[ -n "$DRY_RUN" ]]; then printf '   # dry run: not asked\n'; else printf '\n'; fi
  } >&2
  [[ -z "$DRY_RUN" ]] || return 1
  if [[ -n "$status_only" ]]; then
    "$@" >/dev/null 2>&1
  elif [[ -n "$quiet" ]]; then
    "$@" 2>/dev/null
  else
    "$@"
  fi
}

# The terraform stack: tf_workspace, tf_vars, pin_zones, tf_apply, tf_output, read_outputs.
# shellcheck source=scripts/deploy-terraform.sh
source "$ROOT/scripts/deploy-terraform.sh"

# A kubeconfig of this class's cluster alone ($OUT_DIR/kubeconfig, context alias = the cluster
# name). Every kubectl and helm call names that file and context ("${KUBECTL[@]}",
# "${HELM_KUBE[@]}"): a deploy or destroy never acts on another cluster that happens to be the
# current context, and leaves the user's ~/.kube/config (and its current context) as it was.
kube_context() {
  KUBE_CONTEXT="$CLUSTER"
  KUBECTL=(kubectl --kubeconfig "$KUBECONFIG_FILE" --context "$KUBE_CONTEXT")
  HELM_KUBE=(--kubeconfig "$KUBECONFIG_FILE" --kube-context "$KUBE_CONTEXT")
  mkdir -p "$OUT_DIR"
  run aws eks update-kubeconfig --name "$CLUSTER" --region "$REGION" --alias "$KUBE_CONTEXT" \
    --kubeconfig "$KUBECONFIG_FILE"
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

# The image's tag: image_tag (the commit, plus a hash of the build context when it differs).
# shellcheck source=scripts/deploy-image-tag.sh
source "$ROOT/scripts/deploy-image-tag.sh"

write_monitoring_values() {
  # kube-prometheus-stack: scrape every PodMonitor, load dashboards from labelled ConfigMaps in any
  # namespace into the folder their grafana_folder annotation names, allow the Ray dashboard to
  # embed Grafana panels.
  # Prometheus keeps its data on a volume (retention by age, and by size at 80% of the volume so
  # that a full disk never stops it). Its claim goes with the Prometheus that made it
  # (whenDeleted: Delete): `helm uninstall` would otherwise leave the EBS volume behind, outside
  # any state, billed after `make destroy`.
  cat >"$OUT_DIR/kube-prometheus-stack.values.yaml" <<EOF
prometheus:
  prometheusSpec:
    podMonitorSelectorNilUsesHelmValues: false
    serviceMonitorSelectorNilUsesHelmValues: false
    retention: 30d
    retentionSize: $((PROMETHEUS_STORAGE_GI * 8 / 10))GB
    persistentVolumeClaimRetentionPolicy:
      whenDeleted: Delete
    storageSpec:
      volumeClaimTemplate:
        spec:
          storageClassName: gp2
          accessModes: [ReadWriteOnce]
          resources:
            requests:
              storage: ${PROMETHEUS_STORAGE_GI}Gi
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
    echo "  create: $SA_CREATE"
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
    echo "  dashboards:"
    echo "    enabled: $DASHBOARDS"
    echo "  podMonitor:"
    if [[ "$MONITORING" == "0" ]]; then echo "    enabled: auto"; else echo "    enabled: true"; fi
  } >"$OUT_DIR/values.generated.yaml"
}

# The IRSA ServiceAccount (terraform's service_account_name: the one name its role trusts) is
# shared by every release in the namespace, and so are the Grafana dashboards (they filter by
# cluster and run, and their uids are fixed: two copies would clash in Grafana). The first
# release deployed creates both and owns them; another release (RELEASE=foo) reuses the
# ServiceAccount and installs no dashboards: Helm refuses to install an object that another
# release owns ("exists and cannot be imported into the current release").
shared_objects() {
  local owner
  SA_CREATE=true DASHBOARDS=true
  # "" (no such ServiceAccount, or a dry run), "owner:" (made outside Helm) or "owner:<release>"
  owner="$(query "${KUBECTL[@]}" get serviceaccount "$SERVICE_ACCOUNT" --namespace "$NAMESPACE" \
    --ignore-not-found -o 'go-template=owner:{{with .metadata.annotations}}{{with index . "meta.helm.sh/release-name"}}{{.}}{{end}}{{end}}')" \
    || owner=""
  case "$owner" in
    "" | "owner:$RELEASE") ;;
    owner:)
      SA_CREATE=false
      echo "ServiceAccount $SERVICE_ACCOUNT exists and no Helm release owns it: release $RELEASE uses it as it is"
      ;;
    *)
      SA_CREATE=false DASHBOARDS=false
      echo "ServiceAccount $SERVICE_ACCOUNT and the Grafana dashboards belong to release ${owner#owner:}: release $RELEASE uses them and installs neither"
      ;;
  esac
}

# metadata.name of the first object in a rendered manifest ("" when the file is absent).
rendered_name() {
  local file="$OUT_DIR/manifests/appliance/templates/$1"
  [[ -f "$file" ]] || return 0
  sed -n 's/^  name: //p' "$file" | head -n 1
}

# The value of annotation $2 on the first object of rendered manifest $1 ("" when absent).
rendered_annotation() {
  local file="$OUT_DIR/manifests/appliance/templates/$1"
  [[ -f "$file" ]] || return 0
  sed -n "s|^    $2: ||p" "$file" | head -n 1 | tr -d '"'
}

# Whether the image tag is already in the ECR repository. The repository is IMMUTABLE, so a
# second `docker push` of the same tag (a redeploy of the same commit) would be refused.
image_in_ecr() {
  local repo="$1" tag="$2"
  query --status aws ecr describe-images --region "$REGION" --repository-name "${repo#*/}" \
    --image-ids "imageTag=$tag"
}

# KubeRay never resubmits a RayJob whose spec changed, nor one that finished: the live job is
# deleted when its checksum/job annotation differs from the one just rendered (its arguments,
# config, image, or the pods it runs on), or when RERUN=1 asks to train again; `helm upgrade` then
# creates it afresh. An unchanged job, running or finished, is left alone. A job still running
# (not Complete, Failed, ValidationFailed or Suspended) is deleted only with REPLACE_RUNNING=1:
# deleting it stops the run, and upgrading it in place instead would leave KubeRay running the
# old spec under the new checksum; so without it the deploy stops here, before the chart changes.
replace_changed_job() {
  local job want answer have state reason
  job="$(rendered_name rayjob.yaml)"
  [[ -n "$job" ]] || return 0
  want="$(rendered_annotation rayjob.yaml checksum/job)"
  # "found:<checksum/job>:<jobDeploymentStatus>", or "" when there is no such RayJob
  answer="$(query "${KUBECTL[@]}" get rayjob "$job" --namespace "$NAMESPACE" --ignore-not-found \
    -o 'go-template=found:{{with .metadata.annotations}}{{with index . "checksum/job"}}{{.}}{{end}}{{end}}:{{with .status}}{{with .jobDeploymentStatus}}{{.}}{{end}}{{end}}')" \
    || answer=""
  if [[ -z "$answer" ]]; then
    echo "(RayJob $job: none yet; helm creates it)"
    return 0
  fi
  IFS=: read -r _ have state <<<"$answer"
  if [[ "$have" != "$want" ]]; then
    reason="its spec changed (checksum/job ${have:-none} -> $want: its arguments, config, image or the pods it runs on)"
  elif [[ -n "$RERUN" ]]; then
    reason="RERUN=1 runs it again"
  else
    echo "RayJob $job: unchanged, left as it is (${state:-starting}; RERUN=1 runs it again once it has finished)"
    return 0
  fi
  case "$state" in
    Complete | Failed | ValidationFailed | Suspended)
      echo "RayJob $job: $reason; it has finished ($state): deleting it so that the new one runs"
      ;;
    *)
      [[ -n "$REPLACE_RUNNING" ]] || die "RayJob $job is still running (${state:-starting}) and this deploy would replace it: $reason. Replacing it stops the run, so the deploy stops here, before upgrading release $RELEASE. Compare the new job ($OUT_DIR/manifests/appliance/templates/rayjob.yaml) with the live one (KUBECONFIG=$KUBECONFIG_FILE kubectl get rayjob $job -n $NAMESPACE -o yaml); then wait for the run to finish and deploy again, or deploy again with REPLACE_RUNNING=1 to stop it now and start the new job (with the chart's --auto-resume, a job with the same OUTPUT continues that run from its last checkpoint)."
      echo "RayJob $job: $reason; it is still running (${state:-starting}), REPLACE_RUNNING=1: deleting it (this stops the run) so that the new one runs"
      stop_jobs_gracefully "$NAMESPACE" "$RELEASE"
      ;;
  esac
  run "${KUBECTL[@]}" delete rayjob "$job" --namespace "$NAMESPACE" --wait
}

# Stop release $2's running Ray jobs (namespace $1) the graceful way before its RayJob or the
# release is deleted: `python -m appliance.cluster.jobstop` in the head pod asks Ray's job supervisor to
# stop each job (SIGTERM to the driver, which finishes its step and writes a checkpoint; the chart
# gives it gracefulStopSeconds) and waits until they have ended. Deleting a running RayJob alone
# would stop it too, but returns before the driver has written that checkpoint. Best effort: with
# no head pod (no cluster, or pods still starting) there is nothing to stop.
stop_jobs_gracefully() {
  local namespace="$1" release="$2" pod
  pod="$(query "${KUBECTL[@]}" get pods --namespace "$namespace" \
    -l "app.kubernetes.io/instance=$release,ray.io/node-type=head" -o name)" || pod=""
  pod="${pod%%$'\n'*}"
  [[ -n "$pod" || -z "$DRY_RUN" ]] || pod="pod/$release-head-dry-run"
  if [[ -z "$pod" ]]; then
    echo "(no Ray head pod of release $release: no running job to stop)"
    return 0
  fi
  echo "Stopping release $release's running job gracefully: its step finishes and a checkpoint is written (up to the chart's gracefulStopSeconds)"
  best_effort "${KUBECTL[@]}" exec --namespace "$namespace" "$pod" -c ray-head -- \
    python -m appliance.cluster.jobstop
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
  echo "then run the job again: make deploy GPU_CLASS=$GPU_CLASS RERUN=1 (or pass MODEL=/DATA=, which replaces it)."
}

print_next_steps() {
  # The names the chart gave its objects (appliance.fullname in _helpers.tpl: <release>-appliance,
  # or the release alone when it contains "appliance"; fullnameOverride; ...), read back from the
  # rendered manifests so that they are right whatever RELEASE and CHART_VALUES were.
  local cluster_name
  cluster_name="$(rendered_name raycluster.yaml)"
  JOB_NAME="$(rendered_name rayjob.yaml)"
  [[ -n "$cluster_name" ]] || die "no RayCluster in $OUT_DIR/manifests: the chart rendered nothing?"
  # deploy.sh's own kubeconfig (the user's current context is left alone), by its absolute path
  # so that the commands work from any directory.
  local kubectl
  kubectl="KUBECONFIG=$(printf '%q' "$(cd "$(dirname "$KUBECONFIG_FILE")" && pwd)/$(basename "$KUBECONFIG_FILE")") kubectl"
  echo
  if [[ -n "$DRY_RUN" ]]; then
    echo "Dry run: nothing was changed. Rendered chart: $OUT_DIR/manifests. After a real deploy:"
  else
    echo "Deployed GPU class $GPU_CLASS to cluster $CLUSTER. Watch the run:"
  fi
  echo "  $kubectl get raycluster,rayjob,pods -n $NAMESPACE"
  if [[ -n "$JOB_NAME" ]]; then
    echo "  $kubectl logs -n $NAMESPACE -f job/$JOB_NAME"
  fi
  # the chart's rayTokenAuth: KubeRay keeps the token in a Secret named after the RayCluster
  local auth=""
  if grep -q '^  authOptions:' "$OUT_DIR/manifests/appliance/templates/raycluster.yaml"; then auth=1; fi
  echo "Ray dashboard (http://127.0.0.1:8265${auth:+; it asks for the token the second line prints}):"
  echo "  $kubectl port-forward -n $NAMESPACE svc/$cluster_name-head-svc 8265:8265"
  if [[ -n "$auth" ]]; then
    echo "  $kubectl get secret -n $NAMESPACE $cluster_name -o jsonpath='{.data.auth_token}' | base64 -d"
  fi
  cat <<EOF
Grafana (http://127.0.0.1:3000; dashboards in folders "Appliance" and "Ray"):
  $kubectl port-forward -n $MONITORING_NAMESPACE svc/prometheus-grafana 3000:80
  $kubectl get secret -n $MONITORING_NAMESPACE prometheus-grafana -o jsonpath='{.data.admin-password}' | base64 -d
EOF
  if [[ -n "$JOB_NAME" ]]; then print_uploads; fi
}

# The AWS account the credentials here reach, before terraform asks AWS anything: without working
# credentials terraform fails deep in its plan, with the provider's long error.
aws_account() {
  local account
  if ! account="$(query aws sts get-caller-identity --query Account --output text)"; then
    [[ -n "$DRY_RUN" ]] && return 0
    die "no working AWS credentials here (aws sts get-caller-identity failed, above): run aws configure or aws sso login, or set AWS_PROFILE (or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY); DRY_RUN=1 renders the deployment without AWS"
  fi
  echo "AWS account $account"
}

deploy() {
  require_tools terraform aws kubectl
  [[ -n "${IMAGE:-}" ]] || require_tools docker
  helm version >/dev/null # fail early when there is no helm
  aws_account
  mkdir -p "$OUT_DIR"
  print_reused_settings
  echo "== terraform (workspace $GPU_CLASS): VPC, EKS with the $GPU_CLASS GPU node group (${GPU_INSTANCE_TYPE:-$DEFAULT_INSTANCE_TYPE}), S3, IRSA, ECR"
  tf_vars
  tf_workspace
  pin_zones
  tf_apply
  read_outputs

  echo "== kubeconfig (context $CLUSTER)"
  kube_context

  local image_repo image_tag
  if [[ -n "${IMAGE:-}" ]]; then
    echo "== image: $IMAGE (given; not built)"
    image_repo="${IMAGE%:*}"
    image_tag="${IMAGE##*:}"
  else
    image_repo="$ECR_URL"
    image_tag="$(image_tag)"
    if image_in_ecr "$image_repo" "$image_tag"; then
      echo "== image: $image_repo:$image_tag is already in ECR (not rebuilt)"
    else
      echo "== image: build (linux/amd64, what the GPU nodes run) and push $image_repo:$image_tag"
      run_sh "aws ecr get-login-password --region $REGION | docker login --username AWS --password-stdin ${ECR_URL%%/*}"
      run docker build --platform linux/amd64 -t "$image_repo:$image_tag" .
      run docker push "$image_repo:$image_tag"
    fi
  fi

  echo "== KubeRay $KUBERAY_VERSION: its CRDs (Helm never upgrades a chart's CRDs), then the operator"
  run "${KUBECTL[@]}" apply --server-side --force-conflicts -f "$KUBERAY_CRDS"
  run helm repo add kuberay https://ray-project.github.io/kuberay-helm/ --force-update
  recover_pending_release kuberay-operator kuberay-system
  run helm upgrade --install kuberay-operator kuberay/kuberay-operator --version "$KUBERAY_VERSION" \
    --namespace kuberay-system --create-namespace --wait "${HELM_KUBE[@]}"

  if [[ "$MONITORING" != "0" ]]; then
    echo "== monitoring: kube-prometheus-stack $KUBE_PROMETHEUS_STACK_VERSION (Prometheus operator, Prometheus, Grafana)"
    write_monitoring_values
    run helm repo add prometheus-community https://prometheus-community.github.io/helm-charts --force-update
    recover_pending_release prometheus "$MONITORING_NAMESPACE"
    run helm upgrade --install prometheus prometheus-community/kube-prometheus-stack \
      --version "$KUBE_PROMETHEUS_STACK_VERSION" \
      --namespace "$MONITORING_NAMESPACE" --create-namespace --wait \
      -f "$OUT_DIR/kube-prometheus-stack.values.yaml" "${HELM_KUBE[@]}"
  fi

  echo "== appliance chart"
  shared_objects
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
  # before the RayJob is compared: a rollback puts back the last deployed revision's objects
  recover_pending_release "$RELEASE" "$NAMESPACE"
  replace_changed_job
  run helm upgrade --install "$RELEASE" "$CHART_DIR" --create-namespace "${chart_args[@]}" \
    "${HELM_KUBE[@]}"
  if [[ -z "$DRY_RUN" ]]; then save_settings; fi

  print_next_steps
}

# An interrupted deploy (Ctrl-C, a lost connection, a --wait that timed out and was killed)
# leaves its Helm release pending-install, pending-upgrade or pending-rollback, and every later
# `helm upgrade` of it fails with "another operation (install/upgrade/rollback) is in progress".
# Called before each `helm upgrade --install`: such a release is rolled back to its last deployed
# revision, or uninstalled when it never deployed (pending-install, nothing deployed before).
recover_pending_release() {
  local name="$1" namespace="$2" history latest status target
  history="$(query --quiet helm history "$name" --namespace "$namespace" --output json \
    "${HELM_KUBE[@]}")" || return 0 # no such release (or a dry run)
  # "REVISION STATUS" a line, oldest first. Only "revision" and "status" keys are read: a quote
  # inside a description is escaped (\"), so no description can pass for one.
  history="$(grep -oE '"(revision|status)": *("[^"]*"|[0-9]+)' <<<"$history" | tr -d '" ' \
    | awk -F: '$1 == "revision" {revision = $2} $1 == "status" {print revision, $2}' \
    | sort -n)" || true
  read -r latest status <<<"$(tail -n 1 <<<"$history")"
  [[ "$status" == pending-* ]] || return 0
  target="$(awk -v latest="$latest" '$1 < latest && $2 == "deployed" {t = $1} END {print t}' <<<"$history")"
  if [[ -n "$target" ]]; then
    echo "Helm release $name is $status at revision $latest (an earlier deploy was interrupted): rolling it back to revision $target, its last deployed one, before upgrading it"
    run helm rollback "$name" "$target" --namespace "$namespace" "${HELM_KUBE[@]}"
  elif [[ "$status" == pending-install ]] && ! grep -qvE "^$latest " <<<"$history"; then
    echo "Helm release $name is $status at revision $latest (an earlier deploy was interrupted) and never deployed: uninstalling it before installing it again"
    run helm uninstall "$name" --namespace "$namespace" --wait "${HELM_KUBE[@]}"
  else
    die "Helm release $name (namespace $namespace) is $status at revision $latest and has no deployed revision to roll back to; see: KUBECONFIG=$KUBECONFIG_FILE helm history $name -n $namespace, then helm rollback $name <revision> or helm uninstall $name"
  fi
}

# A step before terraform destroy that may fail because what it acts on is already gone.
best_effort() {
  run "$@" || echo "(skipped: the command above failed; what it acts on is probably gone already)"
}

destroy() {
  require_tools terraform aws
  helm version >/dev/null
  aws_account
  echo "== terraform state of GPU class $GPU_CLASS (workspace $GPU_CLASS)"
  tf_vars
  tf_workspace
  local resources
  if ! resources="$(query terraform -chdir="$TF_DIR" state list)"; then
    [[ -n "$DRY_RUN" ]] || die "terraform state list failed (see above)"
    resources="(dry run: assume a deployed stack)"
  fi
  if [[ -z "$resources" ]]; then
    echo "Nothing deployed for GPU class $GPU_CLASS (its terraform state is empty): nothing to destroy."
    return 0
  fi
  BEST_EFFORT=1 read_outputs

  if [[ -z "$CLUSTER" || -z "$REGION" ]]; then
    echo "== helm releases: skipped (no cluster_name/region output: the cluster is gone)"
  elif ! kube_context; then
    echo "== helm releases: skipped (cluster $CLUSTER does not answer: it is gone)"
  else
    echo "== helm releases (the RayClusters first, so their pods and volumes go before the nodes)"
    # every release in the chart's namespace, not only the last deploy's (RELEASE=foo installs
    # another beside it); a dry run, or a listing that fails, falls back to that one
    local namespace="${NAMESPACE:-appliance}" releases release
    releases="$(query helm list --namespace "$namespace" --short "${HELM_KUBE[@]}")" || releases=""
    for release in ${releases:-$RELEASE}; do
      stop_jobs_gracefully "$namespace" "$release"
      best_effort helm uninstall "$release" --namespace "$namespace" --ignore-not-found --wait \
        "${HELM_KUBE[@]}"
    done
    best_effort helm uninstall prometheus --namespace "$MONITORING_NAMESPACE" --ignore-not-found --wait \
      "${HELM_KUBE[@]}"
    # a Prometheus installed before its claim had whenDeleted: Delete leaves it: its EBS volume
    # would outlive the cluster, billed
    best_effort "${KUBECTL[@]}" delete pvc --all --namespace "$MONITORING_NAMESPACE" \
      --ignore-not-found --wait
    best_effort helm uninstall kuberay-operator --namespace kuberay-system --ignore-not-found --wait \
      "${HELM_KUBE[@]}"
  fi

  echo "== terraform destroy"
  if [[ -n "$FORCE" ]]; then
    if grep -qx 'aws_s3_bucket.this' <<<"$resources" || [[ -n "$DRY_RUN" ]]; then
      # force_destroy must be in the state before destroy honours it; -target on a bucket that
      # is not in the state would create one, hence the check.
      # shellcheck disable=SC2046
      run terraform -chdir="$TF_DIR" apply -input=false $(approve_flag) "${TF_VARS[@]}" \
        -var force_destroy=true -target=aws_s3_bucket.this
    fi
  fi
  # shellcheck disable=SC2046
  if ! run terraform -chdir="$TF_DIR" destroy -input=false $(approve_flag) "${TF_VARS[@]}"; then
    [[ -n "$FORCE" ]] || die "terraform destroy failed. If the bucket still holds objects (checkpoints!), copy what you want to keep and rerun with FORCE=1 to delete them too."
    die "terraform destroy failed; rerun make destroy GPU_CLASS=$GPU_CLASS (every step before it is safe to repeat)"
  fi
  if [[ -n "$DRY_RUN" ]]; then
    echo "Dry run: nothing was destroyed."
  else
    rm -f "$KUBECONFIG_FILE" # its cluster is gone
    echo "Destroyed GPU class $GPU_CLASS."
  fi
}

case "$ACTION" in
  deploy) deploy ;;
  destroy) destroy ;;
  image-tag) image_tag ;;
  *) die "usage: scripts/deploy.sh deploy|destroy|image-tag (see the header)" ;;
esac
