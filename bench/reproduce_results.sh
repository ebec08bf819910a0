#!/usr/bin/env bash
# Regenerates every table, figure and result file behind docs/results.md and the model card.
#
#   bash bench/reproduce_results.sh            # all of it, on the shipped model
#   NPROC=4 DTYPE=float32 bash bench/reproduce_results.sh
#   STEPS="4 5" bash bench/reproduce_results.sh   # only some of the numbered steps below
#
# NPROC ranks share the problems (torchrun, gloo on CPU, one device per rank on GPUs), each
# with OMP_NUM_THREADS intra-op threads. DTYPE is the inference dtype (bfloat16: the dtype the
# model was trained in, and 2x faster than float32 on CPUs with AMX). Every method of a table
# runs in the same invocation, so the speedup column compares like with like.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${MODEL:-models/default}
NPROC=${NPROC:-2}
DTYPE=${DTYPE:-bfloat16}
BATCH=${BATCH:-50}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
STEPS=${STEPS:-1 2 3 4 5 6}
want() { [[ " $STEPS " == *" $1 "* ]]; }
METHODS=(greedy confidence:tau=0.9 confidence:tau=0.5 topk:steps=16 localleap spiffy:d=3
         psd:policy=confidence,d=3 psd:policy=localleap,d=3 lopa:k=3 ete:k=2 fdm:k=3)

eval_run() {
    python -m torch.distributed.run --nproc-per-node "$NPROC" --master-port "${MASTER_PORT:-29561}" \
        -m bench.eval --model "$MODEL" --dtype "$DTYPE" --batch-size "$BATCH" --overwrite "$@"
}

# 1. every method of the paper on both held-out files (300 problems each)
if want 1; then
    for task in code math; do
        eval_run --task "$task" --methods "${METHODS[@]}" \
            --out "bench/results/eval_${task}.jsonl" --plot "docs/figures/${task}" | tee "bench/results/eval_${task}.txt"
    done
    python -m bench.code_breakdown bench/results/eval_code.jsonl | tee bench/results/code_breakdown.txt
fi

# 2. PSD depth sweep (math, all 300 problems)
if want 2; then
    eval_run --task math --methods greedy confidence:tau=0.9 spiffy:d=3 \
        psd:policy=confidence,d=0 psd:policy=confidence,d=1 psd:policy=confidence,d=3 \
        psd:policy=confidence,d=5 psd:policy=confidence,d=7 \
        --out bench/results/eval_math_psd_depth.jsonl | tee bench/results/eval_math_psd_depth.txt
fi

# 3. calibrated draft graph vs the chain with the same number of rows (math, all 300 problems)
if want 3; then
    python -m engine.calibrate --model "$MODEL" --policy greedy --depth 4 --nodes 8 \
        --prompts "$MODEL/calibration_prompts.jsonl" --out "$MODEL/graph_greedy_d4_n8.json" \
        --gen-length 64 --block-length 32 --dtype "$DTYPE" --overwrite
    eval_run --task math --methods greedy "spiffy:graph=$MODEL/graph_greedy_d4_n8.json" spiffy:d=7 \
        --out bench/results/eval_math_calibrated.jsonl | tee bench/results/eval_math_calibrated.txt
fi

# 4. the same greedy decoding in float32 (the CLI's default dtype), to show what the dtype changes
if want 4; then
    for task in code math; do
        eval_run --task "$task" --methods greedy --dtype float32 \
            --out "bench/results/eval_${task}_fp32_greedy.jsonl" | tee "bench/results/eval_${task}_fp32_greedy.txt"
    done
fi

# 5. how aggressive spatial decoding can get before accuracy drops (the suites' discrimination)
if want 5; then
    for task in code math; do
        eval_run --task "$task" --methods greedy topk:steps=8 topk:steps=4 topk:steps=2 confidence:tau=0.3 \
            confidence:tau=0.1 --out "bench/results/eval_${task}_aggressive.jsonl" | tee "bench/results/eval_${task}_aggressive.txt"
    done
    python -m bench.code_breakdown bench/results/eval_code_aggressive.jsonl | tee bench/results/code_breakdown_aggressive.txt
fi

# 6. arithmetic with operands given: result digits masked, one call (teacher-forced, no decoding)
if want 6; then
    python -m bench.arith_probe --model "$MODEL" | tee bench/results/arith_probe.txt
fi
