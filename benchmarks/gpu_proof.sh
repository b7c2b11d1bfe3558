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
# triton and pytest; no Ray or boto3: nothing here needs them). Every JSON and table goes to
# $OUT (default /tmp/gpu_proof), and every step's whole output to one log, $OUT/<stage>.log:
# at most 5 files a stage, as the device tool brings back at most 8. Each step runs under a
# time limit of its own (`timeout`), so that one slow step cannot use up the call's 10 minutes
# and leave the others unrun. The exit status is 1 if any step failed or ran out of time.
# docs/benchmarks.md says how the numbers are recorded.
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

log="$OUT/$stage.log"
: >"$log"
rc=0
step() {  # $1 a name, $2 its time limit in seconds; the rest a command, its output (stderr
    # too) shown and appended to the stage's log under a header
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit} s): $*" | tee -a "$log"
    "$@" 2>&1 | tee -a "$log"  # (timeout is in the command: its status is the pipe's first)
    local status=${PIPESTATUS[0]}
    if [[ $status -ne 0 ]]; then
        local why="exit status $status"
        [[ $status -eq 124 ]] && why="ran out of its ${limit} s"
        echo "FAILED: $name ($why; log: $log)" | tee -a "$log" >&2
        rc=1
    fi
}
run() {  # $1 a name, $2 its time limit; the rest the command: step, under `timeout`
    local name=$1 limit=$2
    shift 2
    step "$name" "$limit" timeout --signal=INT --kill-after=20 "$limit" "$@"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv 2>&1 | tee -a "$log"
$py -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" 2>&1 \
    | tee -a "$log"
# Triton builds each kernel's launcher with the host's C compiler at its first launch
echo "C compilers: $(command -v gcc cc clang | tr '\n' ' ')" | tee -a "$log"
# The CPU quantizers (appliance/_quantize.c) where this machine can compile them: the copied tree
# has no built library, and 70b-nf4 quantizes its synthetic blocks on the CPU. Without a
# compiler the PyTorch functions code the same values, more slowly.
$py setup.py -q build_ext --inplace >>"$log" 2>&1 \
    || echo "no C quantizers here (see $log): PyTorch quantizes" | tee -a "$log"

peers() {  # $1 preset, $2 3 4 the time limits of appliance, HF+PEFT, FSDP2; $5 bench flags
    # shellcheck disable=SC2086  # $5 is several flags, split on purpose
    run "appliance-$1" "$2" $py -m appliance.bench --preset "$1" $5 --json "$OUT/appliance-$1.json"
    run "hf-$1" "$3" $py -m benchmarks.peer_hf_peft --preset "$1" --json "$OUT/hf-$1.json"
    run "fsdp2-$1" "$4" $py -m benchmarks.peer_fsdp2_offload --preset "$1" --json "$OUT/fsdp2-$1.json"
    run "compare-$1" 30 $py -m benchmarks.compare --appliance "$OUT/appliance-$1.json" \
        --peer "$OUT/fsdp2-$1.json" --peer "$OUT/hf-$1.json" --out "$OUT/compare-$1.md"
}

case $stage in
tests)
    run pytest-gpu 330 $py -m pytest -m gpu -q -rs -p no:cacheprovider tests/
    run dequant 90 $py benchmarks/dequant.py --json "$OUT/dequant.json"
    run appliance-1b 120 $py -m appliance.bench --preset 1b --json "$OUT/appliance-1b.json"
    ;;
block)  # issue 10 item 3: whichever of the two measures faster is the one to keep
    run block-compile 500 $py benchmarks/block_step.py --device cuda --dtype bfloat16 \
        --hidden 4096 --heads 32 --kv-heads 32 --seq 2048 --reps 10 --compile \
        --families llama,llama+dropout --json "$OUT/block-compile.json"
    ;;
7b)  # 7B's 13.5 GB fit a 24 GiB budget whole: the preset's default budget streams half of it
    peers 7b 220 110 180 "--profile"
    ;;
13b)
    peers 13b 200 110 220 "--gpu-memory-budget 24GiB --profile"
    ;;
70b-nf4)  # the streamed row only: all 80 NF4 blocks fit the card, a resident row would double it
    run appliance-70b-nf4 500 $py -m appliance.bench --preset 70b --base-quant nf4 \
        --gpu-memory-budget 24GiB --steps 2 --modes streamed --profile \
        --json "$OUT/appliance-70b-nf4.json"
    ;;
*)
    echo "unknown stage $stage: tests | block | 7b | 13b | 70b-nf4" >&2
    exit 2
    ;;
esac
# the stage fails if any step did (a peer's crash is not hidden behind compare's success)
exit $rc
