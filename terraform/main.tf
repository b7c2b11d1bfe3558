# AWS for the appliance: a VPC, an EKS cluster with a CPU system node group and a GPU node group
# (A10-class g5.* or 4090-class g6e.*), the NVIDIA device plugin, and (storage.tf) an S3 bucket
# with an IRSA role scoped to it plus an ECR repository for the image.
#
#   make deploy GPU_CLASS=a10      # terraform apply here, then KubeRay + the Helm chart
#
# Naming follows terraform-aws-modules: a resource that is the only one of its type in this module
# is named `this`; several of one type are named for what they are (system/gpu, public/private).

data "aws_partition" "current" {}
data "aws_caller_identity" "current" {}

data "aws_availability_zones" "available" {
  #checkov:skip=CKV_AWS_394:Two zones are picked below (GPU-offering ones first) and var.availability_zones pins them, so the subnets never move.
  state = "available"

  filter {
    name   = "opt-in-status"
    values = ["opt-in-not-required"]
  }
}

# The zones that offer the GPU instance type: g5 and g6e are not in every zone of a region, and a
# node group in a zone without its type never gets a node.
data "aws_ec2_instance_type_offerings" "gpu" {
  location_type = "availability-zone"

  filter {
    name   = "instance-type"
    values = [local.gpu_instance_type]
  }
}

# vCPUs per GPU node, for the quota check on the GPU node group.
data "aws_ec2_instance_type" "gpu" {
  instance_type = local.gpu_instance_type
}

# "Running On-Demand G and VT instances": the vCPUs of g5/g6e instances the account may run in the
# region. New accounts have 0, and the node group then never gets a node (the apply hangs for
# ~20 minutes before it fails), so the plan checks it first (aws_eks_node_group.gpu).
data "aws_servicequotas_service_quota" "gpu_vcpus" {
  service_code = "ec2"
  quota_code   = "L-DB2E81BA"
}

locals {
  cluster_name = "${var.name}-${var.gpu_class}"
  partition    = data.aws_partition.current.partition
  account_id   = data.aws_caller_identity.current.account_id

  # GPU class -> default EC2 instance type: one 24 GB-class GPU, 32 vCPU and enough host RAM for
  # the /dev/shm weight store. helm/appliance/values.yaml (gpuClasses) sizes pods for these.
  gpu_instance_types = {
    a10    = "g5.8xlarge"  # 1x NVIDIA A10G 24 GB, 128 GiB
    "4090" = "g6e.8xlarge" # 1x NVIDIA L40S 48 GB (AD102, the RTX 4090's die), 256 GiB
  }
  gpu_instance_type = coalesce(var.gpu_instance_type, local.gpu_instance_types[var.gpu_class])

  # EKS wants subnets in two zones: the zones that offer the GPU type first, then any other, unless
  # var.availability_zones names them. The GPU nodes go only where their type is offered.
  gpu_zones      = sort(setintersection(data.aws_availability_zones.available.names, data.aws_ec2_instance_type_offerings.gpu.locations))
  azs            = var.availability_zones != null ? var.availability_zones : slice(distinct(concat(local.gpu_zones, sort(data.aws_availability_zones.available.names))), 0, 2)
  gpu_subnet_ids = [for i, az in local.azs : aws_subnet.private[i].id if contains(local.gpu_zones, az)]
  gpu_vcpus      = var.gpu_node_count * data.aws_ec2_instance_type.gpu.default_vcpus
  oidc_issuer    = replace(aws_eks_cluster.this.identity[0].oidc[0].issuer, "https://", "")
}

################################################################################
# Network: two AZs, public subnets for the NAT gateway, private subnets for the nodes
################################################################################

resource "aws_vpc" "this" {
  cidr_block           = var.vpc_cidr
  enable_dns_support   = true
  enable_dns_hostnames = true

  tags = { Name = local.cluster_name }
}

# The default security group allows nothing; EKS creates the groups the cluster uses.
resource "aws_default_security_group" "this" {
  vpc_id = aws_vpc.this.id
}

resource "aws_subnet" "public" {
  count = length(local.azs)

  vpc_id            = aws_vpc.this.id
  availability_zone = local.azs[count.index]
  cidr_block        = cidrsubnet(var.vpc_cidr, 4, count.index) # /20s at the start of the range

  tags = {
    Name                     = "${local.cluster_name}-public-${local.azs[count.index]}"
    "kubernetes.io/role/elb" = "1"
  }
}

resource "aws_subnet" "private" {
  count = length(local.azs)

  vpc_id            = aws_vpc.this.id
  availability_zone = local.azs[count.index]
  cidr_block        = cidrsubnet(var.vpc_cidr, 2, count.index + 1) # /18s: the VPC CNI gives every pod an IP

  tags = {
    Name                              = "${local.cluster_name}-private-${local.azs[count.index]}"
    "kubernetes.io/role/internal-elb" = "1"
  }
}

resource "aws_internet_gateway" "this" {
  vpc_id = aws_vpc.this.id

  tags = { Name = local.cluster_name }
}

resource "aws_eip" "this" {
  domain = "vpc"

  tags       = { Name = "${local.cluster_name}-nat" }
  depends_on = [aws_internet_gateway.this]
}

# One NAT gateway (not one per AZ): the nodes only pull images and reach S3/ECR through it.
resource "aws_nat_gateway" "this" {
  allocation_id = aws_eip.this.id
  subnet_id     = aws_subnet.public[0].id

  tags       = { Name = local.cluster_name }
  depends_on = [aws_internet_gateway.this]
}

resource "aws_route_table" "public" {
  vpc_id = aws_vpc.this.id

  route {
    cidr_block = "0.0.0.0/0"
    gateway_id = aws_internet_gateway.this.id
  }

  tags = { Name = "${local.cluster_name}-public" }
}

resource "aws_route_table" "private" {
  vpc_id = aws_vpc.this.id

  route {
    cidr_block     = "0.0.0.0/0"
    nat_gateway_id = aws_nat_gateway.this.id
  }

  tags = { Name = "${local.cluster_name}-private" }
}

# S3 through a gateway endpoint (free), not the NAT gateway (charged per GB): model downloads and
# checkpoints are tens to hundreds of GB per run.
resource "aws_vpc_endpoint" "this" {
  vpc_id            = aws_vpc.this.id
  service_name      = "com.amazonaws.${var.region}.s3"
  vpc_endpoint_type = "Gateway"
  route_table_ids   = [aws_route_table.private.id]

  tags = { Name = "${local.cluster_name}-s3" }
}

resource "aws_route_table_association" "public" {
  count = length(local.azs)

  subnet_id      = aws_subnet.public[count.index].id
  route_table_id = aws_route_table.public.id
}

resource "aws_route_table_association" "private" {
  count = length(local.azs)

  subnet_id      = aws_subnet.private[count.index].id
  route_table_id = aws_route_table.private.id
}

resource "aws_flow_log" "this" {
  vpc_id               = aws_vpc.this.id
  traffic_type         = "ALL"
  log_destination_type = "cloud-watch-logs"
  log_destination      = aws_cloudwatch_log_group.flow_log.arn
  iam_role_arn         = aws_iam_role.flow_log.arn
}

resource "aws_cloudwatch_log_group" "flow_log" {
  name              = "/aws/vpc/${local.cluster_name}/flow-logs"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
}

data "aws_iam_policy_document" "flow_log_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["vpc-flow-logs.amazonaws.com"]
    }
  }
}

data "aws_iam_policy_document" "flow_log" {
  statement {
    actions   = ["logs:CreateLogStream", "logs:PutLogEvents", "logs:DescribeLogStreams"]
    resources = ["${aws_cloudwatch_log_group.flow_log.arn}:*"]
  }
}

resource "aws_iam_role" "flow_log" {
  name_prefix        = "${local.cluster_name}-flow-log-"
  assume_role_policy = data.aws_iam_policy_document.flow_log_assume.json
}

resource "aws_iam_role_policy" "flow_log" {
  name   = "write-flow-logs"
  role   = aws_iam_role.flow_log.id
  policy = data.aws_iam_policy_document.flow_log.json
}

################################################################################
# KMS key: EKS secrets, CloudWatch log groups, ECR images
################################################################################

data "aws_iam_policy_document" "kms" {
  #checkov:skip=CKV_AWS_109:A key policy's Resource "*" means this key only; the account root statement is AWS's required default.
  #checkov:skip=CKV_AWS_111:A key policy's Resource "*" means this key only; the account root statement is AWS's required default.
  #checkov:skip=CKV_AWS_356:A key policy's Resource "*" means this key only.
  statement {
    sid       = "AccountAdministers"
    actions   = ["kms:*"]
    resources = ["*"]

    principals {
      type        = "AWS"
      identifiers = ["arn:${local.partition}:iam::${local.account_id}:root"]
    }
  }

  statement {
    sid       = "CloudWatchLogsEncrypt"
    actions   = ["kms:Encrypt*", "kms:Decrypt*", "kms:ReEncrypt*", "kms:GenerateDataKey*", "kms:Describe*"]
    resources = ["*"]

    principals {
      type        = "Service"
      identifiers = ["logs.${var.region}.amazonaws.com"]
    }

    condition {
      test     = "ArnLike"
      variable = "kms:EncryptionContext:aws:logs:arn"
      values   = ["arn:${local.partition}:logs:${var.region}:${local.account_id}:log-group:*"]
    }
  }
}

resource "aws_kms_key" "this" {
  description             = "${local.cluster_name}: EKS secrets, logs and images"
  enable_key_rotation     = true
  deletion_window_in_days = 7
  policy                  = data.aws_iam_policy_document.kms.json
}

resource "aws_kms_alias" "this" {
  name          = "alias/${local.cluster_name}"
  target_key_id = aws_kms_key.this.key_id
}

################################################################################
# EKS cluster
################################################################################

data "aws_iam_policy_document" "cluster_assume" {
  statement {
    actions = ["sts:AssumeRole", "sts:TagSession"]

    principals {
      type        = "Service"
      identifiers = ["eks.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "cluster" {
  name_prefix        = "${local.cluster_name}-cluster-"
  assume_role_policy = data.aws_iam_policy_document.cluster_assume.json
}

resource "aws_iam_role_policy_attachment" "cluster" {
  role       = aws_iam_role.cluster.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/AmazonEKSClusterPolicy"
}

# Created before the cluster so that Terraform owns (and destroys) it, with our retention and key.
# EKS may re-create it after a destroy (its last logs): make deploy then imports it (deploy.sh's
# tf_apply).
resource "aws_cloudwatch_log_group" "cluster" {
  name              = "/aws/eks/${local.cluster_name}/cluster"
  retention_in_days = var.log_retention_days
  kms_key_id        = aws_kms_key.this.arn
}

resource "aws_eks_cluster" "this" {
  #checkov:skip=CKV_AWS_39:Public access is off by default (var.cluster_endpoint_public_access_cidrs is empty); it is on only for the CIDR blocks the operator names, for make deploy from outside the VPC.
  #checkov:skip=CKV_AWS_38:No default CIDR: the endpoint is private unless var.cluster_endpoint_public_access_cidrs names the operator's addresses (validated as CIDR blocks).
  name                      = local.cluster_name
  version                   = var.kubernetes_version
  role_arn                  = aws_iam_role.cluster.arn
  enabled_cluster_log_types = ["api", "audit", "authenticator", "controllerManager", "scheduler"]

  # Standard support only: when it ends, EKS upgrades the control plane instead of moving the
  # cluster to extended support, which costs six times as much per hour.
  upgrade_policy {
    support_type = "STANDARD"
  }

  access_config {
    authentication_mode                         = "API"
    bootstrap_cluster_creator_admin_permissions = true
  }

  vpc_config {
    subnet_ids              = aws_subnet.private[*].id
    endpoint_private_access = true
    # private by default: public only for the CIDR blocks given (make deploy from outside the VPC)
    endpoint_public_access = length(var.cluster_endpoint_public_access_cidrs) > 0
    public_access_cidrs    = length(var.cluster_endpoint_public_access_cidrs) > 0 ? var.cluster_endpoint_public_access_cidrs : null
  }

  encryption_config {
    resources = ["secrets"]

    provider {
      key_arn = aws_kms_key.this.arn
    }
  }

  depends_on = [aws_iam_role_policy_attachment.cluster, aws_cloudwatch_log_group.cluster]
}

# IRSA: lets a Kubernetes ServiceAccount assume an IAM role (storage.tf).
data "tls_certificate" "this" {
  url = aws_eks_cluster.this.identity[0].oidc[0].issuer
}

resource "aws_iam_openid_connect_provider" "this" {
  url             = aws_eks_cluster.this.identity[0].oidc[0].issuer
  client_id_list  = ["sts.amazonaws.com"]
  thumbprint_list = [data.tls_certificate.this.certificates[0].sha1_fingerprint]
}

################################################################################
# Node groups: CPU "system" nodes (Ray head, KubeRay, Prometheus/Grafana) and GPU nodes
################################################################################

data "aws_iam_policy_document" "node_assume" {
  statement {
    actions = ["sts:AssumeRole"]

    principals {
      type        = "Service"
      identifiers = ["ec2.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "node" {
  name_prefix        = "${local.cluster_name}-node-"
  assume_role_policy = data.aws_iam_policy_document.node_assume.json
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset(["AmazonEKSWorkerNodePolicy", "AmazonEKS_CNI_Policy", "AmazonEC2ContainerRegistryReadOnly"])

  role       = aws_iam_role.node.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/${each.value}"
}

resource "aws_eks_node_group" "system" {
  cluster_name           = aws_eks_cluster.this.name
  node_group_name_prefix = "system-"
  node_role_arn          = aws_iam_role.node.arn
  subnet_ids             = aws_subnet.private[*].id
  ami_type               = "AL2023_x86_64_STANDARD"
  instance_types         = [var.system_instance_type]

  scaling_config {
    desired_size = var.system_node_count
    min_size     = 1
    max_size     = max(var.system_node_count, 1)
  }

  update_config {
    max_unavailable = 1
  }

  labels = { "appliance.dev/node-role" = "system" }

  depends_on = [aws_iam_role_policy_attachment.node]
}

resource "aws_eks_node_group" "gpu" {
  cluster_name           = aws_eks_cluster.this.name
  node_group_name_prefix = "gpu-${var.gpu_class}-"
  node_role_arn          = aws_iam_role.node.arn
  subnet_ids             = local.gpu_subnet_ids
  ami_type               = "AL2023_x86_64_NVIDIA" # NVIDIA driver and container toolkit preinstalled
  instance_types         = [local.gpu_instance_type]
  disk_size              = var.gpu_node_disk_size

  scaling_config {
    desired_size = var.gpu_node_count
    min_size     = 0
    max_size     = max(var.gpu_node_count, 1)
  }

  update_config {
    max_unavailable = 1
  }

  # The chart selects these nodes by instance type (or by appliance.dev/gpu-class), and tolerates
  # the taint; nvidia.com/gpu.present lets the device plugin's default affinity match them.
  labels = {
    "appliance.dev/gpu-class" = var.gpu_class
    "nvidia.com/gpu.present"  = "true"
  }

  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }

  lifecycle {
    precondition {
      condition     = length(local.gpu_subnet_ids) > 0
      error_message = "No availability zone of ${var.region} used here offers ${local.gpu_instance_type} (zones offering it: ${jsonencode(local.gpu_zones)}): pick another region, another instance type, or set availability_zones to zones that offer it."
    }
    precondition {
      condition     = data.aws_servicequotas_service_quota.gpu_vcpus.value >= local.gpu_vcpus
      error_message = "The account's quota \"Running On-Demand G and VT instances\" in ${var.region} is ${data.aws_servicequotas_service_quota.gpu_vcpus.value} vCPUs; ${var.gpu_node_count} x ${local.gpu_instance_type} needs ${local.gpu_vcpus}. New accounts have 0. Ask for more (approval can take a day): aws service-quotas request-service-quota-increase --service-code ec2 --quota-code L-DB2E81BA --desired-value ${local.gpu_vcpus} --region ${var.region}"
    }
  }

  depends_on = [aws_iam_role_policy_attachment.node]
}

################################################################################
# EBS CSI driver: Prometheus (make deploy) keeps its data on an EBS volume
################################################################################

data "aws_iam_policy_document" "ebs_csi_assume" {
  statement {
    actions = ["sts:AssumeRoleWithWebIdentity"]

    principals {
      type        = "Federated"
      identifiers = [aws_iam_openid_connect_provider.this.arn]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:sub"
      values   = ["system:serviceaccount:kube-system:ebs-csi-controller-sa"]
    }

    condition {
      test     = "StringEquals"
      variable = "${local.oidc_issuer}:aud"
      values   = ["sts.amazonaws.com"]
    }
  }
}

resource "aws_iam_role" "ebs_csi" {
  name_prefix        = "${local.cluster_name}-ebs-csi-"
  assume_role_policy = data.aws_iam_policy_document.ebs_csi_assume.json
}

resource "aws_iam_role_policy_attachment" "ebs_csi" {
  role       = aws_iam_role.ebs_csi.name
  policy_arn = "arn:${local.partition}:iam::aws:policy/service-role/AmazonEBSCSIDriverPolicy"
}

resource "aws_eks_addon" "this" {
  cluster_name             = aws_eks_cluster.this.name
  addon_name               = "aws-ebs-csi-driver"
  service_account_role_arn = aws_iam_role.ebs_csi.arn

  depends_on = [aws_eks_node_group.system, aws_iam_role_policy_attachment.ebs_csi]
}

################################################################################
# NVIDIA device plugin: advertises nvidia.com/gpu on the GPU nodes
################################################################################

resource "helm_release" "this" {
  name             = "nvidia-device-plugin"
  repository       = "https://nvidia.github.io/k8s-device-plugin"
  chart            = "nvidia-device-plugin"
  version          = var.nvidia_device_plugin_version
  namespace        = "nvidia-device-plugin"
  create_namespace = true

  values = [yamlencode({
    nodeSelector = { "nvidia.com/gpu.present" = "true" }
    tolerations  = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
  })]

  # Installed once CoreDNS and the VPC CNI have nodes to run on.
  depends_on = [aws_eks_node_group.system]
}
