# shellcheck shell=bash
# Sourced by scripts/deploy.sh (which defines TF_DIR, OUT_DIR, GPU_CLASS, DRY_RUN, AUTO_APPROVE,
# run, query and die first): the terraform stack of one GPU class, in its own workspace.

# One state per GPU class: the terraform workspace named after it (state in
# terraform/terraform.tfstate.d/<class>/), so the a10 and 4090 stacks never plan over each other.
# The state is a file in this checkout (terraform/terraform.tfstate.d/<class>/terraform.tfstate,
# ignored by git): keep it, as docs/deploy.md says; `make destroy` needs it.
tf_workspace() {
  if ! run terraform -chdir="$TF_DIR" init -input=false; then
    if [[ "$ACTION" == destroy && ! -e "$TF_DIR/terraform.tfstate.d/$GPU_CLASS" ]]; then
      echo "Nothing deployed for GPU class $GPU_CLASS from this checkout (no terraform state in $TF_DIR/terraform.tfstate.d/$GPU_CLASS): nothing to destroy."
      exit 0
    fi
    die "terraform init failed (above): it fetches the AWS, Kubernetes and Helm providers from registry.terraform.io, so this machine needs to reach it (check its network or proxy), or a provider mirror (TF_CLI_CONFIG_FILE)"
  fi
  run terraform -chdir="$TF_DIR" workspace select -or-create=true "$GPU_CLASS"
}

# `terraform output -raw NAME`, or a placeholder in a dry run. BEST_EFFORT=1 (destroy): a missing
# output (nothing deployed, or a half-destroyed stack) gives "" instead of stopping the script.
tf_output() {
  local name="$1" placeholder="$2"
  if [[ -n "$DRY_RUN" ]]; then
    printf '+ terraform -chdir=%s output -raw %s   # dry run: %s\n' "$TF_DIR" "$name" "$placeholder" >&2
    echo "$placeholder"
  elif [[ -n "${BEST_EFFORT:-}" ]]; then
    terraform -chdir="$TF_DIR" output -raw "$name" 2>/dev/null || true
  else
    terraform -chdir="$TF_DIR" output -raw "$name"
  fi
}

approve_flag() {
  [[ -n "$AUTO_APPROVE" ]] && echo "-auto-approve" || true
}

# The -var arguments of every terraform apply/destroy.
tf_vars() {
  TF_VARS=(-var "gpu_class=$GPU_CLASS")
  if [[ -n "$GPU_INSTANCE_TYPE" ]]; then TF_VARS+=(-var "gpu_instance_type=$GPU_INSTANCE_TYPE"); fi
}

# `terraform apply` of the stack. EKS can write its control-plane log group once more after
# `terraform destroy` has deleted it, and so re-create it outside any state; the next apply then
# fails on CreateLogGroup with ResourceAlreadyExistsException. That group is this stack's by its
# name (/aws/eks/<cluster>/cluster): it is imported into the state, and the apply runs again.
# terraform's stderr is kept in a file to read that error, and shown as well.
tf_apply() {
  local errors="$OUT_DIR/terraform-apply.stderr" group
  # shellcheck disable=SC2046  # approve_flag is empty or one word
  if run terraform -chdir="$TF_DIR" apply -input=false $(approve_flag) "${TF_VARS[@]}" 2>"$errors"; then
    cat "$errors" >&2
    return 0
  fi
  cat "$errors" >&2
  group="$(grep -o '/aws/eks/[A-Za-z0-9-]*/cluster' "$errors" | head -n 1 || true)"
  if [[ -z "$group" ]] || ! grep -q ResourceAlreadyExistsException "$errors"; then
    die "terraform apply failed (see above); every step is safe to repeat: fix the cause and run make deploy GPU_CLASS=$GPU_CLASS again"
  fi
  echo "The EKS log group $group exists outside terraform's state (EKS wrote to it after the last destroy): importing it, then applying again"
  run terraform -chdir="$TF_DIR" import -input=false "${TF_VARS[@]}" aws_cloudwatch_log_group.cluster "$group"
  # shellcheck disable=SC2046
  run terraform -chdir="$TF_DIR" apply -input=false $(approve_flag) "${TF_VARS[@]}"
}

# The subnets' zones, once the stack exists: the ones it has (output availability_zones), passed
# back on every later apply. Left to terraform, they would be recomputed on each plan from where
# AWS offers the GPU type today, and a change there would replace the subnets, the node groups
# and the cluster. The first apply (no stack yet, or a dry run) lets terraform choose them.
pin_zones() {
  local zones
  zones="$(query --quiet terraform -chdir="$TF_DIR" output -json availability_zones)" || return 0
  [[ "$zones" == "["*"]" ]] || return 0
  TF_VARS+=(-var "availability_zones=$zones")
  echo "Subnet zones: $zones (the stack's own, kept)"
}

# The stack's outputs, as deploy.sh's globals (placeholders in a dry run).
# shellcheck disable=SC2034  # the globals are deploy.sh's
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
