# 4090-class with an explicit instance type: two g6e.12xlarge nodes (4x L40S 48 GB, 384 GiB each)
# in us-west-2, a named bucket, and a bucket that terraform destroy may empty.
#
#   terraform -chdir=terraform/examples/4090-custom init
#   terraform -chdir=terraform/examples/4090-custom apply
#
# Size the chart to match (helm/appliance values):
#   gpuClass: "4090"
#   gpuClassOverrides: {instanceType: g6e.12xlarge, gpusPerNode: 4, cpu: "44", memory: 360Gi, shmSize: 320Gi}
#   worker: {replicas: 2}

module "appliance" {
  source = "../.."

  name              = "appliance"
  region            = "us-west-2"
  gpu_class         = "4090"
  gpu_instance_type = "g6e.12xlarge"
  gpu_node_count    = 2

  bucket_name   = "example-appliance-4090-checkpoints"
  force_destroy = true

  tags = { Environment = "example" }
}
