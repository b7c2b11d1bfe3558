#!/usr/bin/env bash
# The Ray-free tests on the GPU image's Python stack, on a CPU: what benchmarks/gpu_proof.sh will
# meet there, checked before a GPU is lent. Not part of `make test` (it downloads torch 2.11's
# CUDA build, about 3 GB, from PyPI).
#
#   bash scripts/gpu-image-stack.sh            # builds .venv-gpu-image once, then runs the tests
#
# The device image (the device tool's KINDS.md, 2026-11): Python 3.12, torch 2.11.0+cu130,
# transformers 5.17.0, numpy 2.5.2, safetensors 0.8.0, triton, no Ray, no boto3. The test files
# below import neither; any test that reaches for Ray fails here as it would there.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-gpu-image
is_312() {  # a Python 3.12 that runs (a pyenv shim for a version not installed is found, and fails)
    [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' 2>/dev/null
}
PY=${PYTHON312:-}
for candidate in "$(command -v python3.12 || true)" "$HOME/.pyenv/versions/3.12.1/bin/python"; do
    if [ -z "$PY" ] && is_312 "$candidate"; then PY=$candidate; fi
done
if [ ! -x "$VENV/bin/python" ]; then
    if ! is_312 "$PY"; then
        echo "no Python 3.12 found (the GPU image's): set PYTHON312=/path/to/python3.12" >&2
        exit 2
    fi
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q torch==2.11.0 numpy==2.5.2 transformers==5.17.0 safetensors==0.8.0 \
        peft tokenizers click rich pyyaml jinja2 pyarrow prometheus-client psutil huggingface_hub \
        nvidia-ml-py pytest setuptools
fi
"$VENV/bin/python" setup.py -q build_ext --inplace  # the C quantizers, as gpu_proof.sh builds them
"$VENV/bin/python" -c "import importlib.util as u, sys; \
bad = [m for m in ('ray', 'boto3') if u.find_spec(m)]; sys.exit(f'{bad} installed in $VENV') if bad else None"
PYTHONPATH=$PWD exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" \
    tests/bench/test_bench.py tests/bench/test_block_step.py tests/data/test_chat.py tests/engine/test_compiled_blocks.py \
    tests/config/test_config.py \
    tests/data/test_data.py tests/engine/test_data_parallel_engine.py tests/engine/test_engine_gpu.py \
    tests/engine/test_engine_parity.py tests/engine/test_engine_step.py tests/adapter/test_evaluate.py \
    tests/adapter/test_export.py tests/engine/test_loss_scale.py tests/models/test_model_families.py \
    tests/data/test_packing.py tests/bench/test_peer_bench.py tests/plan/test_plan.py tests/quant/test_quant.py \
    tests/quant/test_quant_gpu.py tests/quant/test_quant_parity.py tests/engine/test_streaming_slots.py \
    tests/run/test_validation.py
