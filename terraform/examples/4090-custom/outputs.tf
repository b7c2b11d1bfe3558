output "cluster_name" {
  description = "EKS cluster name."
  value       = module.appliance.cluster_name
}

output "bucket_name" {
  description = "S3 bucket for models, data and checkpoints."
  value       = module.appliance.bucket_name
}

output "irsa_role_arn" {
  description = "IAM role for the chart's serviceAccount.roleArn."
  value       = module.appliance.irsa_role_arn
}

output "configure_kubectl" {
  description = "Command that points kubectl at the cluster."
  value       = module.appliance.configure_kubectl
}
