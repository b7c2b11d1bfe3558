# Provider configuration lives in this root module because `make deploy` applies it directly
# (terraform -chdir=terraform apply). The examples call it as a module; Terraform allows that as
# long as they do not use count/for_each/depends_on on it.

provider "aws" {
  region = var.region

  default_tags {
    tags = merge({ "app.kubernetes.io/part-of" = "appliance", "appliance/name" = var.name }, var.tags)
  }
}

# The NVIDIA device plugin goes in with Helm, straight after the cluster exists.
# Credentials: the caller's AWS identity, which the cluster grants admin (see access_config).
provider "helm" {
  kubernetes = {
    host                   = aws_eks_cluster.this.endpoint
    cluster_ca_certificate = base64decode(aws_eks_cluster.this.certificate_authority[0].data)
    exec = {
      api_version = "client.authentication.k8s.io/v1beta1"
      command     = "aws"
      args        = ["eks", "get-token", "--cluster-name", aws_eks_cluster.this.name, "--region", var.region]
    }
  }
}
