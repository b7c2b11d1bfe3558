variable "name" {
  description = "Name prefix of every resource (EKS cluster, bucket, roles). The cluster is named <name>-<gpu_class>."
  type        = string
  default     = "appliance"

  validation {
    condition     = can(regex("^[a-z][a-z0-9-]{1,20}$", var.name))
    error_message = "name must be 2-21 lowercase letters, digits or dashes, starting with a letter."
  }
}

variable "region" {
  description = "AWS region. g5 and g6e instances are not offered in every region or zone: us-east-1, us-east-2 and us-west-2 have both."
  type        = string
  default     = "us-east-1"
}

variable "gpu_class" {
  description = "GPU class of the worker node group: a10 (g5.*, NVIDIA A10G 24 GB) or 4090 (g6e.*, NVIDIA L40S: the RTX 4090's AD102 die)."
  type        = string
  default     = "a10"

  validation {
    condition     = contains(["a10", "4090"], var.gpu_class)
    error_message = "gpu_class must be \"a10\" or \"4090\"."
  }
}

variable "gpu_instance_type" {
  description = "Explicit EC2 instance type of the GPU nodes, overriding the gpu_class default (g5.8xlarge for a10, g6e.8xlarge for 4090). make deploy GPU_INSTANCE_TYPE=... sets it and sizes the chart to match; otherwise size the chart's gpuClassOverrides yourself."
  type        = string
  default     = null
}

variable "gpu_node_count" {
  description = "Number of GPU nodes (one Ray GPU worker each)."
  type        = number
  default     = 1

  validation {
    condition     = var.gpu_node_count >= 0 && var.gpu_node_count <= 16
    error_message = "gpu_node_count must be between 0 and 16."
  }
}

variable "gpu_node_disk_size" {
  description = "Root volume size of the GPU nodes in GiB: the image (~10 GiB) and an s3:// model's download (its S3 cache, e.g. ~130 GiB for 70B bf16; the weight store itself lives in /dev/shm)."
  type        = number
  default     = 200
}

variable "system_instance_type" {
  description = "EC2 instance type of the CPU node group that runs the Ray head, KubeRay and monitoring."
  type        = string
  default     = "m6i.xlarge"
}

variable "system_node_count" {
  description = "Number of CPU system nodes."
  type        = number
  default     = 2
}

variable "kubernetes_version" {
  description = "EKS Kubernetes version. Keep it in EKS standard support (the cluster's upgrade policy is STANDARD: when support ends, EKS upgrades it): EKS gives each version 14 months of standard support; 1.35 (on EKS since early 2026) has it into 2027."
  type        = string
  default     = "1.35"
}

variable "availability_zones" {
  description = "The two availability zones of the subnets; null picks zones that offer the GPU instance type first. Set it to keep the subnets where they are should the offerings change."
  type        = list(string)
  default     = null

  validation {
    condition     = var.availability_zones == null ? true : length(var.availability_zones) == 2
    error_message = "availability_zones must name exactly two zones (or be null)."
  }
}

variable "vpc_cidr" {
  description = "CIDR block of the VPC; split into two public and two private subnets."
  type        = string
  default     = "10.42.0.0/16"
}

variable "cluster_endpoint_public_access_cidrs" {
  description = "CIDR blocks allowed to reach the EKS API endpoint from the internet (kubectl/helm in make deploy), e.g. [\"203.0.113.10/32\"]. Empty (the default): the endpoint is private, reachable only from inside the VPC (a bastion, a VPN)."
  type        = list(string)
  default     = []

  validation {
    condition     = alltrue([for cidr in var.cluster_endpoint_public_access_cidrs : can(cidrnetmask(cidr))])
    error_message = "Each of cluster_endpoint_public_access_cidrs must be an IPv4 CIDR block, e.g. 203.0.113.10/32."
  }
}

variable "run_noncurrent_version_days" {
  description = "Days S3 keeps a noncurrent version under runs/ (an overwritten or deleted run.json, adapter or checkpoint) before it expires: how long an accidental overwrite of a run can be undone. Each pruned checkpoint is kept that long too, so a large model's runs cost that much more storage."
  type        = number
  default     = 7

  validation {
    condition     = var.run_noncurrent_version_days >= 1 && floor(var.run_noncurrent_version_days) == var.run_noncurrent_version_days
    error_message = "run_noncurrent_version_days must be a whole number of days, 1 or more."
  }
}

variable "bucket_name" {
  description = "Name of the S3 bucket for data, models and checkpoints; null picks a unique name starting with <name>-."
  type        = string
  default     = null
}

variable "force_destroy" {
  description = "Allow terraform destroy to delete the bucket with its contents, checkpoints included. Set by make destroy FORCE=1. (The image repository is always deleted with its images.)"
  type        = bool
  default     = false
}

variable "kubernetes_namespace" {
  description = "Namespace the Helm chart is installed in; part of the IRSA trust policy."
  type        = string
  default     = "appliance"
}

variable "service_account_name" {
  description = "Name of the chart's ServiceAccount (serviceAccount.name); the only identity that may assume the bucket role."
  type        = string
  default     = "appliance"
}

variable "log_retention_days" {
  description = "Retention of the EKS control-plane and VPC flow logs in CloudWatch, in days."
  type        = number
  default     = 365
}

variable "nvidia_device_plugin_version" {
  description = "Version of the nvidia-device-plugin Helm chart, which advertises nvidia.com/gpu on the GPU nodes."
  type        = string
  default     = "0.17.1"
}

variable "tags" {
  description = "Extra tags on every resource."
  type        = map(string)
  default     = {}
}
