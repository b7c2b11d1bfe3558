# `make deploy` (scripts/deploy.sh) reads these with `terraform output -raw NAME`.

output "cluster_name" {
  description = "EKS cluster name (aws eks update-kubeconfig --name ...)."
  value       = aws_eks_cluster.this.name
}

output "region" {
  description = "AWS region of every resource."
  value       = var.region
}

output "bucket_name" {
  description = "S3 bucket for models, data and checkpoints (s3://<bucket_name>/...)."
  value       = aws_s3_bucket.this.id
}

output "irsa_role_arn" {
  description = "IAM role the chart's ServiceAccount assumes (serviceAccount.roleArn): read/write on the bucket only."
  value       = aws_iam_role.irsa.arn
}

output "ecr_repository_url" {
  description = "ECR repository for the appliance image (image.repository)."
  value       = aws_ecr_repository.this.repository_url
}

output "gpu_class" {
  description = "GPU class of the GPU node group (the chart's gpuClass)."
  value       = var.gpu_class
}

output "availability_zones" {
  description = "The subnets' two zones. make deploy passes them back (-var availability_zones=...) on every later apply, so a change in where AWS offers the GPU type never moves the subnets."
  value       = local.azs
}

output "gpu_instance_type" {
  description = "EC2 instance type of the GPU nodes (the chart's worker node selector)."
  value       = local.gpu_instance_type
}

output "gpu_node_count" {
  description = "Number of GPU nodes (the chart's worker.replicas)."
  value       = var.gpu_node_count
}

output "kubernetes_namespace" {
  description = "Namespace the chart must be installed in for IRSA to work."
  value       = var.kubernetes_namespace
}

output "service_account_name" {
  description = "ServiceAccount name the IRSA role trusts (the chart's serviceAccount.name)."
  value       = var.service_account_name
}

output "configure_kubectl" {
  description = "Command that points kubectl at the cluster."
  value       = "aws eks update-kubeconfig --name ${aws_eks_cluster.this.name} --region ${var.region}"
}
