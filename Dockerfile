# syntax=docker/dockerfile:1
# The appliance image: Ubuntu 24.04, torch 2.13.0 built for CUDA 12.6 (with its own CUDA runtime
# and libraries), Ray 2.60.0 and the appliance; the example configs at /opt/appliance/configs/ (`--config /opt/appliance/configs/...`).
#
#   make image          # docker build --platform linux/amd64 -t appliance:0.1.0 .
#   docker run --rm --gpus all --shm-size=64g -v "$PWD/models:/models" -v "$PWD/data:/data" \
#     appliance:0.1.0 train --model /models/llama-3.1-8b --data /data/train.jsonl --output /data/run1
#
# The same image runs the Ray head, the GPU workers and the RayJob submitter on Kubernetes
# (helm/appliance). See docs/deploy.md. Build it for linux/amd64 (make image does): on Apple
# silicon a plain `docker build` makes an arm64 image that dies with "exec format error" on the
# g5/g6e nodes.
#
# A plain Ubuntu base, not nvidia/cuda: torch's wheel brings its own CUDA runtime and libraries
# (the nvidia-*-cu12 wheels), so a CUDA base image only added a second copy of them, and its
# NVIDIA_REQUIRE_CUDA made the container refuse to start on a driver older than the image's CUDA,
# which is common on rented RTX 4090s. Torch's CUDA 12 runtime runs on any driver >= 525 (CUDA
# minor-version compatibility); the NVIDIA Container Toolkit (`--gpus all`, the device plugin)
# mounts the driver. The torch builds of 2.13.0 on the PyTorch index are cu126 (kept here: the
# widest range of drivers) and cu130 (needs a driver >= 580); cu129 is not published for 2.13.
# Move to cu130 when the PyTorch index drops cu126 (TORCH_CUDA=cu130).
ARG UBUNTU_VERSION=24.04

FROM ubuntu:${UBUNTU_VERSION} AS build
ARG TORCH_VERSION=2.13.0
ARG TORCH_CUDA=cu126
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_CUDA}
# Ray must be the version the Helm chart tells KubeRay (helm/appliance/values.yaml rayVersion),
# and the same on every pod of a cluster: pinned here, not left to pyproject's `ray>=`.
ARG RAY_VERSION=2.60.0
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
# The base image tag pins the distribution; pinning apt package versions on top only breaks
# the build whenever Ubuntu publishes a security update.
# gcc, libc6-dev and python3-dev build the appliance's one C extension (the fused CPU quantizers,
# appliance/quant/_quantize.c); the runtime stage needs them again, for Triton (below).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from the PyTorch CUDA index; the appliance's `torch>=...` is then already met.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}+${TORCH_CUDA}"
WORKDIR /src
COPY pyproject.toml setup.py README.md constraints.txt ./
COPY appliance ./appliance
# constraints.txt pins torch==2.13.0, which the +cu126 build satisfies: pip keeps it. The check
# fails the build if a CPU or another CUDA build of torch slipped in (cu126 -> torch.version.cuda
# 12.6).
RUN pip install --constraint constraints.txt . "ray[default]==${RAY_VERSION}" \
    && python -c "import torch, ray, appliance, appliance.quant._quantize; \
want = '${TORCH_CUDA}'[2:-1] + '.' + '${TORCH_CUDA}'[-1]; \
assert torch.version.cuda == want, (torch.version.cuda, want); \
assert ray.__version__ == '${RAY_VERSION}', (ray.__version__, '${RAY_VERSION}'); \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'ray', ray.__version__)"

FROM ubuntu:${UBUNTU_VERSION}
ENV DEBIAN_FRONTEND=noninteractive
# python3: the venv's interpreter (same Ubuntu release as the build stage).
# bash: KubeRay runs `ray start` under `bash -lc`. wget: KubeRay's default health probes.
# gcc, libc6-dev, python3-dev: Triton compiles its CUDA launcher (a small C module against
# Python.h) with the system compiler the first time it launches a kernel; without them every
# Triton kernel fails ("Failed to find C compiler"): the fused NF4/int8 dequant falls back to
# PyTorch, and torch.compile and flex_attention do not run.
# Versions are pinned by the base image tag, as above.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 bash wget ca-certificates \
       gcc libc6-dev python3-dev \
    && rm -rf /var/lib/apt/lists/* \
    && (userdel --remove ubuntu 2>/dev/null || true) \
    && useradd --create-home --uid 1000 --user-group --shell /bin/bash appliance \
    && install -d -m 1777 /var/cache/appliance
COPY --from=build /opt/venv /opt/venv
# The example configs at a path that does not depend on the Python version (they also ship inside
# the package): `--config /opt/appliance/configs/llama3-8b-4090.yaml` (chart value job.configFile).
COPY appliance/configs/ /opt/appliance/configs/
# NVIDIA_DRIVER_CAPABILITIES: what the NVIDIA Container Toolkit mounts from the host driver
# (compute: CUDA; utility: nvidia-smi, NVML). NVIDIA_DISABLE_REQUIRE: never refuse a driver for
# its CUDA version (this base sets no NVIDIA_REQUIRE_CUDA; this keeps it so on a base that does).
# NVIDIA_VISIBLE_DEVICES is left unset on purpose: on Kubernetes the device plugin sets it per
# pod, and `all` here would hand every GPU to pods that asked for none (the Ray head).
# Caches at paths any uid can write: `docker run --user <uid>` has HOME=/, so ~/.cache (the S3
# downloads) and ~/.triton/cache (the fused dequant kernels, flex_attention's compiled kernels)
# would be under an unwritable /. (torch.compile's own cache is /tmp/torchinductor_<user or uid>.)
# Ray's auth token, which ray.init would save in ~/.ray, is kept in the run's environment there.
# -v /srv/cache:/var/cache/appliance keeps the S3 downloads between `--rm` runs.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    APPLIANCE_S3_CACHE=/var/cache/appliance/s3 \
    TRITON_CACHE_DIR=/tmp/triton-cache \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_DISABLE_REQUIRE=1
# Numeric, so that Kubernetes can verify runAsNonRoot without a runAsUser.
USER 1000:1000
WORKDIR /home/appliance
# 8080: Ray's per-node metrics endpoint (Prometheus, ray_appliance_*). 8265: the Ray dashboard,
# served only where the image runs a cluster head (`ray start --head`, the chart's head pod);
# `appliance train` alone starts embedded Ray without a dashboard.
EXPOSE 8080 8265
ENTRYPOINT ["appliance"]
CMD ["--help"]
