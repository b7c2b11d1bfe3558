#!/usr/bin/env bash
# The GPU proof of issues 10 and 13, in stages that each fit one device call (≤ 10 minutes).
#
#   benchmarks/gpu_proof.sh tests     # pytest -m gpu, the dequant kernels' bench, bench 1b
#   benchmarks/gpu_proof.sh block     # 7B's block: eager (fused primitives) vs torch.compile
#   benchmarks/gpu_proof.sh 7b        # appliance streamed + resident, FSDP2 offload, HF+PEFT
#   benchmarks/gpu_proof.sh 13b       # the same at 13b, streamed under a 24 GiB budget
#   benchmarks/gpu_proof.sh 70b-nf4   # 70b with an NF4 base under 24 GiB: floor, dequant share
#
# Run from the repository root on the GPU machine (its image has torch, transformers, peft,
# triton and pytest; no Ray or boto3: nothing here needs them). Every JSON, table and log
# goes to $OUT (default /tmp/gpu_proof), each step's whole output to $OUT/<step>.log; the exit
# status is 1 if any step failed. docs/benchmarks.md says how the numbers are recorded.
# Estimated device time on an H100 (read from the code, not yet measured): tests 4-5 min,
# block 3-4, 7b 3.5-4.5, 13b 5-7 (FSDP2 offload is most of it), 70b-nf4 5-6: about 25 minutes
# for all five, so a 30-minute device budget runs them once each. Before any of them,
# `bash scripts/gpu-image-stack.sh` checks the same code on the image's software, on a CPU.
set -uo pipefail
stage=${1:?"stage: tests | block | 7b | 13b | 70b-nf4"}
OUT=${OUT:-/tmp/gpu_proof}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=python3

nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv >"$OUT/gpu-$stage.csv" 2>&1
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
# Triton builds each kernel's launcher with the host's C compiler at its first launch
echo "C compilers: $(command -v gcc cc clang | tr '\n' ' ')"
# The CPU quantizers (appliance/_quantize.c) where this machine can compile them: the copied tree
# has no built library, and 70b-nf4 quantizes its synthetic blocks on the CPU. Without a
# compiler the PyTorch functions code the same values, more slowly.
$py setup.py -q build_ext --inplace >"$OUT/build-ext-$stage.log" 2>&1 \
    || echo "no C quantizers here (see $OUT/build-ext-$stage.log): PyTorch quantizes"

rc=0
step() {  # $1 a name; the rest a command: its output (stderr too) also goes to $OUT/$1.log
    local name=$1
    shift
    if ! "$@" 2>&1 | tee "$OUT/$name.log"; then
        echo "FAILED: $name (exit status above; log: $OUT/$name.log)" >&2
        rc=1
    fi
}

peers() {  # $1 preset, $2 appliance bench flags
    # shellcheck disable=SC2086  # $2 is several flags, split on purpose
    step "appliance-$1" $py -m appliance.bench --preset "$1" $2 --json "$OUT/appliance-$1.json"
    step "hf-$1" $py -m benchmarks.peer_hf_peft --preset "$1" --json "$OUT/hf-$1.json"
    step "fsdp2-$1" $py -m benchmarks.peer_fsdp2_offload --preset "$1" --json "$OUT/fsdp2-$1.json"
    step "compare-$1" $py -m benchmarks.compare --appliance "$OUT/appliance-$1.json" \
        --peer "$OUT/fsdp2-$1.json" --peer "$OUT/hf-$1.json" --out "$OUT/compare-$1.md"
}

case $stage in
tests)
    step pytest-gpu $py -m pytest -m gpu -q -rs -p no:cacheprovider tests/
    step dequant $py benchmarks/dequant.py --json "$OUT/dequant.json"
    step appliance-1b $py -m appliance.bench --preset 1b --json "$OUT/appliance-1b.json"
    ;;
block)  # issue 10 item 3: whichever of the two measures faster is the one to keep
    step block-compile $py benchmarks/block_step.py --device cuda --dtype bfloat16 --hidden 4096 \
        --heads 32 --kv-heads 32 --seq 2048 --reps 10 --compile --families llama,llama+dropout \
        --json "$OUT/block-compile.json"
    ;;
7b)  # 7B's 13.5 GB fit a 24 GiB budget whole: the preset's default budget streams half of it
    peers 7b "--profile"
    ;;
13b)
    peers 13b "--gpu-memory-budget 24GiB --profile"
    ;;
70b-nf4)
    step appliance-70b-nf4 $py -m appliance.bench --preset 70b --base-quant nf4 \
        --gpu-memory-budget 24GiB --steps 2 --profile --json "$OUT/appliance-70b-nf4.json"
    ;;
*)
    echo "unknown stage $stage: tests | block | 7b | 13b | 70b-nf4" >&2
    exit 2
    ;;
esac
# the stage fails if any step did (a peer's crash is not hidden behind compare's success)
exit $rc
