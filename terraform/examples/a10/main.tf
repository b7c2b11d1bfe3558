# The defaults: one A10G node (g5.8xlarge) and two m6i.xlarge system nodes in us-east-1.
#
#   terraform -chdir=terraform/examples/a10 init
#   terraform -chdir=terraform/examples/a10 apply
#
# `make deploy GPU_CLASS=a10` applies the root module (terraform/) with the same settings and then
# installs KubeRay and the Helm chart.

module "appliance" {
  source = "../.."

  name      = "appliance"
  region    = "us-east-1"
  gpu_class = "a10"

  # Narrow the EKS API endpoint to your own address.
  cluster_endpoint_public_access_cidrs = ["203.0.113.10/32"]

  tags = { Environment = "example" }
}
