#!/usr/bin/env bash
# The GPU proof of issues 10, 13 and 49, in stages that each fit one device call.
#
# A task lent a GPU has 15 minutes of device time, all calls together, the machine's start and
# its idle time included; a machine stays warm 30 s after a call. The first session with a GPU
# (2026-11-27, an H100: docs/benchmarks.md, docs/results/2026-11-27-h100/) ran the GPU tests, 7b
# (appliance streamed and resident, HF+PEFT, FSDP2) and 70b NF4. Its start took about 30 s, and
# it measured what the steps take: `pytest -m gpu` 84 s; `appliance bench --preset 7b` (both
# rows, no profile) with 7b FSDP2 about 130 s; HF+PEFT 7b about 45 s; 70b NF4, one timed step,
# 88 s; a `--profile` run takes far longer (the 7b resident row and the 70b one ran out of 130
# and 150 s with it), so no stage profiles but `profile`.
#
# A step's worst case is its limit plus the 20 s `timeout` waits after its SIGINT before the
# SIGKILL (--kill-after): a stage's budget below counts every step's worst case. The whole
# proof does not fit one session's 15 minutes, so the next session lent a GPU runs these two
# calls back to back on the warm machine (issue 49 first: the block stage's rows side by side,
# the eager one measured on the same machine and code as the others):
#
#   benchmarks/gpu_proof.sh block     # ≤ 460 s: 7b streamed eager, compiled, and at 2 and 4
#                                     #   sequences a micro-batch (the same 16384 tokens a
#                                     #   step); 7B's block alone, eager vs compiled
#   benchmarks/gpu_proof.sh tests     # ≤ 250 s: pytest -m gpu, the dequant bench
#
# and the session after, one call each:
#
#   benchmarks/gpu_proof.sh 13b       # appliance, HF+PEFT, FSDP2 at 13b (24 GiB budget)
#   benchmarks/gpu_proof.sh 7b        # all three 7b rows in one call
#   benchmarks/gpu_proof.sh 70b-nf4   # the 70b NF4 row, two timed steps
#   benchmarks/gpu_proof.sh profile   # 7b streamed, one step under torch.profiler
#
# Run from the repository root on the GPU machine (its image has torch, transformers, peft,
# triton and pytest; no Ray or boto3: nothing here needs them). Every JSON and table goes to
# $OUT (default /tmp/gpu_proof), and every step's whole output to one log, $OUT/<stage>.log:
# at most 6 files a stage, as the device tool brings back at most 8. Each step runs under a
# time limit of its own (`timeout`), so that one slow step cannot use up the call and leave the
# others unrun, and its log says how long it took; the worst cases of a stage add up to its
# budget above, and the call's timeout_s should be that plus a minute. The exit status is 1 if any step
# failed or ran out of time. docs/benchmarks.md says how the numbers are recorded. Before any of
# them, `bash scripts/gpu-image-stack.sh` checks the same code on the image's software, on a CPU.
set -uo pipefail
stage=${1:?"stage: 13b | block | tests | 7b | 70b-nf4 | profile"}
OUT=${OUT:-/tmp/gpu_proof}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
py=${PROOF_PYTHON:-python3}  # (tests run the stages with a stand-in that only says what it ran)

log="$OUT/$stage.log"
: >"$log"
rc=0
KILL_AFTER=20  # seconds `timeout` waits after a step's SIGINT before its SIGKILL
step() {  # $1 a name, $2 its time limit in seconds; the rest a command, its output (stderr
    # too) shown and appended to the stage's log under a header
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit} s, then ${KILL_AFTER} s to stop): $*" | tee -a "$log"
    local started=$SECONDS
    "$@" 2>&1 | tee -a "$log"  # (timeout is in the command: its status is the pipe's first)
    local status=${PIPESTATUS[0]}
    echo "=== $name took $((SECONDS - started)) s" | tee -a "$log"
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
    step "$name" "$limit" timeout --signal=INT --kill-after="$KILL_AFTER" "$limit" "$@"
}

nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv 2>&1 | tee -a "$log"
"$py" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))" 2>&1 \
    | tee -a "$log"
# Triton builds each kernel's launcher with the host's C compiler at its first launch
echo "C compilers: $(command -v gcc cc clang | tr '\n' ' ')" | tee -a "$log"
# The CPU quantizers (appliance/quant/_quantize.c) where this machine can compile them: the copied tree
# has no built library, and 70b-nf4 quantizes its synthetic blocks on the CPU. Without a
# compiler the PyTorch functions code the same values, more slowly.
"$py" setup.py -q build_ext --inplace >>"$log" 2>&1 \
    || echo "no C quantizers here (see $log): PyTorch quantizes" | tee -a "$log"

appliance() {  # $1 preset, $2 its time limit, $3 bench flags
    # shellcheck disable=SC2086  # $3 is several flags, split on purpose
    run "appliance-$1" "$2" "$py" -m appliance.bench --preset "$1" $3 --json "$OUT/appliance-$1.json"
}
hf() {  # $1 preset, $2 its time limit
    run "hf-$1" "$2" "$py" -m benchmarks.peer_hf_peft --preset "$1" --json "$OUT/hf-$1.json"
}
fsdp2() {  # $1 preset, $2 its time limit; then the side-by-side table of the three, unless $3
    run "fsdp2-$1" "$2" "$py" -m benchmarks.peer_fsdp2_offload --preset "$1" --json "$OUT/fsdp2-$1.json"
    [[ -n ${3:-} ]] && return
    run "compare-$1" 20 "$py" -m benchmarks.compare --appliance "$OUT/appliance-$1.json" \
        --peer "$OUT/fsdp2-$1.json" --peer "$OUT/hf-$1.json" --out "$OUT/compare-$1.md"
}
pytest_gpu() {  # $1 its time limit
    run pytest-gpu "$1" "$py" -m pytest -m gpu -q -rs -p no:cacheprovider tests/
}
dequant() {
    run dequant 60 "$py" benchmarks/dequant.py --json "$OUT/dequant.json"
}
nf4_70b() {  # $1 its time limit, $2 timed steps. The streamed row only: all 80 NF4 blocks fit
    # the card, a resident row would double the time for a row that says nothing new
    run appliance-70b-nf4 "$1" "$py" -m appliance.bench --preset 70b --base-quant nf4 \
        --gpu-memory-budget 24GiB --steps "$2" --modes streamed \
        --json "$OUT/appliance-70b-nf4.json"
}

case $stage in
13b)  # 13B's 26 GB stream under 24 GiB; the side-by-side table of the three
    appliance 13b 130 "--gpu-memory-budget 24GiB"
    hf 13b 100
    fsdp2 13b 150
    ;;
block)  # issue 49 items 2-4: whichever of eager and compiled blocks measures faster is the one
    # to keep, the eager row measured here beside it (same machine, same code); and whether
    # more sequences a micro-batch (the same 16384 tokens a step) close 7b's launch gaps. The
    # warm-up step compiles (tens of s).
    run appliance-7b-eager 55 "$py" -m appliance.bench --preset 7b --modes streamed \
        --json "$OUT/appliance-7b-eager.json"
    run appliance-7b-compiled 120 "$py" -m appliance.bench --preset 7b --modes streamed \
        --compile-blocks --json "$OUT/appliance-7b-compiled.json"
    for rows in 2 4; do
        run "appliance-7b-x$rows" 55 "$py" -m appliance.bench --preset 7b --modes streamed \
            --micro-batch-size "$rows" --micro-batches-per-step $((8 / rows)) \
            --json "$OUT/appliance-7b-x$rows.json"
    done
    run block-compile 70 "$py" benchmarks/block_step.py --device cuda --dtype bfloat16 \
        --hidden 4096 --heads 32 --kv-heads 32 --seq 2048 --reps 10 --compile \
        --families llama --json "$OUT/block-compile.json"
    ;;
tests)
    pytest_gpu 150
    dequant
    ;;
7b)
    appliance 7b 120 ""
    hf 7b 80
    fsdp2 7b 120
    ;;
70b-nf4)
    nf4_70b 200 2
    ;;
profile)
    appliance 7b 300 "--modes streamed --profile"
    ;;
*)
    echo "unknown stage $stage: 13b | block | tests | 7b | 70b-nf4 | profile" >&2
    exit 2
    ;;
esac
# the stage fails if any step did (a peer's crash is not hidden behind compare's success)
exit $rc
