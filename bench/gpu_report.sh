#!/usr/bin/env bash
# Everything a GPU must show, in one command (docs/gpu.md):
#
#   bash bench/gpu_report.sh OUT_DIR          # on a CUDA machine: budgets add up to 585 s
#   bash bench/gpu_report.sh --dry OUT_DIR    # the same sections on CPU, tiny shapes, reference and
#                                             # interpreter paths (what CI runs)
#
# Sections: environment (imports, versions, nvidia-smi), compiled Triton kernel tests, kernel
# microbenchmarks (top-1 GB/s against HBM bandwidth; shared-prefix attention against SDPA
# variants at LLaDA-8B and Dream-7B head shapes; draft assembly; the MoE routed experts at
# LLaDA2.0-mini's expert shapes against the grouped torch path and a dense loop, with their
# fraction of the card's roofline), `bench.speed --cost-curve` at
# the llada-8b and dream-7b shapes in bf16, `bench.profile_call` (where one verification call's time
# goes), `bench.speed` end to end on the shipped model, and
# (GPU only) eager against --cuda-graphs replay of the verification calls on one GPU.
# Each section runs under its own time budget (`timeout`); a failed or timed-out section is
# recorded in OUT_DIR/summary.md and the others still run; the exit status is non-zero if any
# section failed. Needs only the project's source tree (PYTHONPATH is set here; nothing is
# installed) and python with torch, triton, safetensors, tokenizers, pytest and tqdm.
#
# Environment: PYTHON (interpreter, default python), BUDGET_SCALE (multiplies every section's
# time budget, default 1), ONLY (space-separated section names: run these alone, e.g. to rerun
# the ones that failed; environment always runs), CUDA_VISIBLE_DEVICES as usual.
set -u

usage() { echo "usage: bash bench/gpu_report.sh [--dry] OUT_DIR" >&2; exit 2; }
DRY=0
case "${1:-}" in
    --dry) DRY=1; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    -*) echo "error: unknown option $1" >&2; usage ;;
esac
[[ $# -eq 1 && -n "$1" ]] || usage
mkdir -p "$1" || { echo "error: cannot create $1" >&2; exit 2; }
OUT=$(cd "$1" && pwd)
REPO=$(cd "$(dirname "$0")/.." && pwd)
cd "$REPO"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python}
SCALE=${BUDGET_SCALE:-1}
START=$(date +%s)
mkdir -p "$OUT/logs"
SECTIONS="$OUT/sections.tsv"
printf 'section\tstatus\trc\tseconds\tbudget\tlog\tcommand\n' > "$SECTIONS"
if [[ $DRY -eq 1 ]]; then
    export CUDA_VISIBLE_DEVICES=""          # CPU even on a GPU machine
    export TRITON_INTERPRET=1
    export PSD_BENCH_THREADS=${PSD_BENCH_THREADS:-1}   # a check of the machinery, not a measurement
    MODE="dry (CPU, tiny shapes, reference and interpreter paths)"
else
    unset TRITON_INTERPRET                  # the kernel tests must run compiled
    MODE="GPU"
fi

# section NAME BUDGET_SECONDS COMMAND...: runs COMMAND under `timeout`, output to logs/NAME.log
section() {
    local name=$1 budget=$2; shift 2
    [[ -n "${ONLY:-}" && $name != environment && " $ONLY " != *" $name "* ]] && return 0
    budget=$(awk -v b="$budget" -v s="$SCALE" 'BEGIN { printf "%d", b * s }')
    local log="$OUT/logs/$name.log" t0 rc status
    t0=$(date +%s)
    echo "== $name (budget ${budget}s)" >&2
    timeout --kill-after=10 "$budget" bash -c '"$@"' "$name" "$@" > "$log" 2>&1
    rc=$?
    case $rc in
        0) status=ok ;;
        124|137) status=timeout ;;
        *) status=failed ;;
    esac
    local secs=$(( $(date +%s) - t0 ))
    echo "   $status (rc $rc, ${secs}s)" >&2
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$rc" "$secs" "$budget" "logs/$name.log" "$*" >> "$SECTIONS"
}

# a kernel microbenchmark whose CSV lands in OUT/kernels/<dir> instead of bench/results/
bench_kernel() {
    local dir=$1 module=$2; shift 2
    mkdir -p "$OUT/kernels/$dir"
    "$PY" -c 'import importlib, sys
from pathlib import Path
import bench._common as common
common.RESULTS = Path(sys.argv[1])
sys.exit(importlib.import_module(sys.argv[2]).main(sys.argv[3:]))' "$OUT/kernels/$dir" "$module" "$@"
}

# ---------------------------------------------------------------- 0. environment
env_check() {
    "$PY" - "$OUT/environment.json" <<'EOF'
import importlib, json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform(), "modules": {}, "missing": []}
for name in ("torch", "triton", "safetensors", "tokenizers", "pytest", "tqdm"):
    try:
        mod = importlib.import_module(name)
        info["modules"][name] = getattr(mod, "__version__", "?")
    except Exception as e:                      # noqa: BLE001 - report whatever breaks the import
        info["modules"][name] = None
        info["missing"].append(f"{name} ({type(e).__name__}: {e})")
try:
    import torch
    info["cuda_available"] = torch.cuda.is_available()
    info["torch_cuda"] = torch.version.cuda
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=torch.cuda.get_device_name(0), capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                    memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count)
        clock, bus = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)   # kHz, bits
        if clock and bus:
            info["hbm_gbps_nominal"] = round(2 * clock * 1e3 * bus / 8 / 1e9)
        else:
            known = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100 NVL": 3900,
                     "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555, "A100-PCIE-40GB": 1555}
            info["hbm_gbps_nominal"] = next((v for k, v in known.items() if k in info["device"]), None)
    else:
        from bench._common import device_name
        info["device"] = device_name(torch.device("cpu"))
except Exception as e:                          # noqa: BLE001
    info["torch_error"] = f"{type(e).__name__}: {e}"
json.dump(info, open(sys.argv[1], "w"), indent=1)
print(json.dumps(info, indent=1))
sys.exit(1 if info["missing"] or "torch_error" in info else 0)
EOF
}
export PY OUT
export -f bench_kernel env_check
section environment 15 env_check
if command -v nvidia-smi > /dev/null 2>&1; then
    nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1
else
    echo "nvidia-smi: not found on this machine" > "$OUT/nvidia-smi.txt"
fi

if [[ $DRY -eq 0 ]] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' > /dev/null 2>&1; then
    printf '%s\t%s\t%s\t%s\t%s\t%s\t%s\n' cuda failed 1 0 0 "-" \
        "no CUDA device visible to torch: nothing was measured (bash bench/gpu_report.sh --dry OUT checks the report on CPU)" >> "$SECTIONS"
    SKIP_ALL=1
else
    SKIP_ALL=0
fi

METHODS=(greedy confidence psd:policy=confidence,d=1 psd:policy=confidence,d=3 spiffy:d=3)
if [[ $SKIP_ALL -eq 1 ]]; then
    :
elif [[ $DRY -eq 0 ]]; then
    # ------------------------------------------------------------ GPU: budgets sum to 585 s (the H200 run of 2026-11-26 took 438 s, before profile_call)
    # (MoE: the Triton-vs-reference cases and the model-sized ones; its other tests check inputs)
    # about 490 tests, most compiling their own kernel specialisation: compile in parallel where xdist is there
    XDIST=$("$PY" -c 'import xdist' > /dev/null 2>&1 && echo "-n 8" || true)
    section kernel_tests 135 "$PY" -m pytest $XDIST tests/test_top1.py tests/test_draft.py tests/test_sparse_attn.py \
        tests/test_moe.py::test_matches_reference tests/test_moe.py::test_model_sized_bf16 \
        -q -o addopts= -p no:cacheprovider --junitxml="$OUT/kernel_tests.xml"
    section bench_top1 15 bench_kernel top1 bench.bench_top1 --rows 32 256 1024 --vocab 126464 152064 \
        --dtype bfloat16
    section bench_draft 15 bench_kernel draft bench.bench_draft --rows 1 64 512 --nodes 8 32
    # FlexAttention compiles per shape (about 7 s each on an H200): it is timed while its 10 s last
    section sparse_attn_llada_8b 60 bench_kernel sparse_attn_llada_8b bench.bench_sparse_attn --flex-budget 10 \
        --drafts 1 2 4 8 16 --shared 1024 4096 --heads 32 --kv-heads 32 --head-dim 128 --block 32 --dtype bfloat16
    section sparse_attn_dream_7b 60 bench_kernel sparse_attn_dream_7b bench.bench_sparse_attn --flex-budget 10 \
        --drafts 1 2 4 8 16 --shared 1024 4096 --heads 28 --kv-heads 4 --head-dim 128 --block 32 --dtype bfloat16
    section bench_moe 20 bench_kernel moe bench.bench_moe --shape llada2-mini --tokens 1 64 2048 --dtype bfloat16
    for shape in llada-8b dream-7b; do
        section "cost_curve_${shape//-/_}" 45 "$PY" -m bench.speed --cost-curve --shape "$shape" --dtype bfloat16 \
            --prefix 512 1024 4096 --rows 1 2 4 8 16 32 --block-length 32 --out "$OUT/cost_${shape//-/_}" --overwrite --quiet
    done
    # where one verification call's time goes: host issue, kernels, launches, CUDA-graph replay (docs/gpu.md)
    section profile_call 35 "$PY" -m bench.profile_call --shape llada-8b --prefix 512 --rows 1 16 --reps 20
    section end_to_end 80 "$PY" -m bench.speed --model models/default --methods "${METHODS[@]}" \
        psd:policy=confidence,d=3,draft_budget=auto --batch-sizes 1 8 --num-prompts 4 8 --cache none dual \
        --gen-length 64 --repeats 2 --dtype bfloat16 \
        --out "$OUT/end_to_end" --overwrite --quiet
    # one GPU (TP=1): the same static-rows PSD eager and replayed from CUDA graphs (engine/graphs.py, never
    # run on a GPU before this report); the confidence policy and its static-rows/graphs twin are the baselines.
    # GPU only: --cuda-graphs is an error on CPU (its padding path runs on CPU in tests/test_cuda_graphs.py)
    section cuda_graphs 60 "$PY" -m bench.speed --model models/default --methods confidence \
        psd:policy=confidence,d=3,static_rows=true psd:policy=confidence,d=3,static_rows=true,cuda_graphs=true \
        --batch-sizes 1 8 --num-prompts 4 8 --cache none dual --gen-length 64 --repeats 3 --dtype bfloat16 \
        --out "$OUT/cuda_graphs" --overwrite --quiet
else
    # ------------------------------------------------------------ dry: same sections, tiny shapes, CPU
    # a sample of every kernel's tests, reference and interpreter (about 40 tests; the whole files take minutes)
    DRY_K="tie_rule_example or rank_positions_naive or position_ranks_naive or assemble_drafts_naive"
    DRY_K="$DRY_K or merge_attention or head_layouts or shared_mask or drafts_are_independent or exclude_and_ties"
    DRY_K="$DRY_K or reference_prob_is_naive or margin_and_entropy_naive or reference_row_map_matches_naive"
    DRY_K="$DRY_K or (test_matches_reference and prob-1023)"
    DRY_K="$DRY_K or (row_map_triton and (dtype0-both-interleaved or dtype1-none-uneven))"
    DRY_K="$DRY_K or (test_matches_reference and (dtype0-70-48-5-40-2-one_expert or dtype1-37-32-7-24-4-ties))"
    DRY_K="$DRY_K or (reference_matches_dense_oracle and 13-24-6-20-3) or launches_read_nothing_back"
    section kernel_tests 100 "$PY" -m pytest tests/test_top1.py tests/test_draft.py tests/test_sparse_attn.py \
        tests/test_moe.py -q -o addopts= -p no:cacheprovider --junitxml="$OUT/kernel_tests.xml" -k "$DRY_K"
    section bench_top1 30 bench_kernel top1 bench.bench_top1 --rows 4 --vocab 4096 --dtype float32
    section bench_draft 30 bench_kernel draft bench.bench_draft --rows 1 --nodes 8
    section sparse_attn_llada_8b 30 bench_kernel sparse_attn_llada_8b bench.bench_sparse_attn \
        --drafts 1 2 --shared 64 --heads 4 --kv-heads 4 --head-dim 16 --block 8 --dtype float32
    section sparse_attn_dream_7b 30 bench_kernel sparse_attn_dream_7b bench.bench_sparse_attn \
        --drafts 1 2 --shared 64 --heads 7 --kv-heads 1 --head-dim 16 --block 8 --dtype float32
    section bench_moe 30 bench_kernel moe bench.bench_moe --quick
    for shape in llada-8b dream-7b; do     # tiny shapes of the same families stand in
        tiny=$([[ $shape == llada-8b ]] && echo tiny || echo tiny-dream)
        section "cost_curve_${shape//-/_}" 60 "$PY" -m bench.speed --cost-curve --shape "$tiny" --dtype float32 \
            --prefix 32 64 --rows 1 2 4 --block-length 8 --cost-reps 2 --out "$OUT/cost_${shape//-/_}" --overwrite --quiet
    done
    section profile_call 60 "$PY" -m bench.profile_call --shape tiny --prefix 32 --block-length 8 --rows 1 4 --reps 2
    # float32: it checks the section and its CSV; bfloat16 matmuls are 4x slower on a CPU without bf16
    # instructions (tests/test_engine.py and tests/test_models.py decode bfloat16)
    section end_to_end 180 "$PY" -m bench.speed --model models/default --methods "${METHODS[@]}" \
        --batch-sizes 1 4 --num-prompts 2 4 --cache none dual --gen-length 16 --block-length 16 --repeats 1 \
        --dtype float32 \
        --out "$OUT/end_to_end" --overwrite --quiet
fi

# ---------------------------------------------------------------- summary (stdlib only)
TOTAL=$(( $(date +%s) - START ))
"$PY" - "$OUT" "$MODE" "$TOTAL" "bash bench/gpu_report.sh $([[ $DRY -eq 1 ]] && echo '--dry ')$1" <<'EOF'
import csv, json, sys
import xml.etree.ElementTree as ET
from pathlib import Path

out, mode, total, command = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
sections = list(csv.DictReader(open(out / "sections.tsv"), delimiter="\t"))
env = json.loads((out / "environment.json").read_text()) if (out / "environment.json").is_file() else {}
L = [f"# GPU report ({mode})", "", f"- command: `{command}`", f"- total: {total} s",
     f"- device: {env.get('device', '?')}" + (f" (compute capability {env['capability']}, {env['memory_gib']} GiB, "
                                            f"{env['sms']} SMs)" if env.get("capability") else ""),
     f"- python {env.get('python', '?')}, " + ", ".join(f"{k} {v or 'MISSING'}" for k, v in env.get("modules", {}).items())
     + (f", CUDA {env['torch_cuda']}" if env.get("torch_cuda") else ""),
     f"- missing imports: {', '.join(env['missing']) if env.get('missing') else 'none'}",
     f"- nominal HBM bandwidth: {env['hbm_gbps_nominal']} GB/s" if env.get("hbm_gbps_nominal") else
     "- nominal HBM bandwidth: unknown (GB/s figures below compare with the measured copy bandwidth)", ""]
failed = [s for s in sections if s["status"] != "ok"]
L += ["## Sections", "", "| section | status | seconds | budget | log |", "|---|---|---|---|---|"]
L += [f"| {s['section']} | {'**' + s['status'].upper() + '**' if s['status'] != 'ok' else 'ok'} (rc {s['rc']}) | "
      f"{s['seconds']} | {s['budget']} | {s['log']} |" for s in sections]
L += ["", f"**{len(failed)} of {len(sections)} sections failed.**" if failed else "All sections passed.", ""]


def table(rows, cols):
    if not rows:
        return ["(no rows)"]
    def fmt(v):
        try:
            f = float(v)
            return v if f.is_integer() and "." not in v else f"{f:.4g}"
        except (TypeError, ValueError):
            return v if v not in (None, "") else "-"
    return ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)] + \
        ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]


def read_csvs(folder):
    rows = []
    for f in sorted(Path(folder).glob("*.csv")):
        rows += list(csv.DictReader(open(f)))
    return rows

# kernel tests
xml = out / "kernel_tests.xml"
if xml.is_file():
    try:
        cases = []
        for tc in ET.parse(xml).getroot().iter("testcase"):
            outcome = "passed"
            for child in tc:
                if child.tag in ("failure", "error", "skipped"):
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
            cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "outcome": outcome,
                          "seconds": tc.get("time")})
        with open(out / "kernel_tests.csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["test", "outcome", "seconds"])
            w.writeheader()
            w.writerows(cases)
        counts = {k: sum(c["outcome"] == k for c in cases) for k in ("passed", "failed", "error", "skipped")}
        L += ["## Kernel tests", "", ", ".join(f"{v} {k}" for k, v in counts.items()) + " (kernel_tests.csv)", ""]
        L += [f"- FAILED {c['test']}" for c in cases if c["outcome"] in ("failed", "error")][:30]
        L += [""]
    except ET.ParseError as e:
        L += ["## Kernel tests", "", f"unreadable junit file: {e}", ""]

# top-1
rows = read_csvs(out / "kernels" / "top1")
if rows:
    hbm = env.get("hbm_gbps_nominal")
    for r in rows:
        r["hbm_frac"] = f"{float(r['gbps']) / hbm:.3f}" if hbm else ""
    L += ["## top-1 over the vocabulary", "", "GB/s: the bytes one pass must move / time; peak_frac: of the measured "
          "copy bandwidth; hbm_frac: of the nominal HBM bandwidth.", ""]
    L += table(rows, ["provider", "rows", "vocab", "dtype", "ms", "gbps", "peak_frac", "hbm_frac"]) + [""]
rows = read_csvs(out / "kernels" / "draft")
if rows:
    L += ["## Draft assembly and rankings", ""] + table(rows, ["bench", "provider", "rows", "nodes", "us", "gbps"]) + [""]
for shape in ("llada_8b", "dream_7b"):
    rows = read_csvs(out / "kernels" / f"sparse_attn_{shape}")
    if rows:
        L += [f"## Shared-prefix attention, {shape.replace('_', '-')} head shape", ""]
        cols = [c for c in ["provider", "drafts", "shared", "heads", "kv_heads", "head_dim", "ms", "tflops", "mem_mb",
                            "max_err"] if c in rows[0]]
        L += table(rows, cols) + [""]
rows = read_csvs(out / "kernels" / "moe")
if rows:
    r0 = rows[0]
    L += [f"## MoE routed experts (hidden {r0['hidden']}, expert inter {r0['inter']}, {r0['experts']} experts, "
          f"top-{r0['topk']})", "", "tflops / gbps: the routed slots' FLOPs and the used experts' weights (read "
          "once) over the time; tc_frac: of the dense 16-bit tensor-core peak; roof_frac: the roofline time "
          "max(bytes / HBM, FLOPs / peak) over the time; max_err: against the fp32 reference.", ""]
    L += table(rows, ["provider", "tokens", "used_experts", "dtype", "ms", "tflops", "gbps", "hbm_frac", "tc_frac",
                      "roof_frac", "max_err"]) + [""]
for shape in ("llada_8b", "dream_7b"):
    md = out / f"cost_{shape}" / "cost_curve.md"
    if md.is_file():
        L += [f"## Cost of one model call, {shape.replace('_', '-')} shape (random weights)", "", md.read_text(), ""]
log = out / "logs" / "profile_call.log"
if log.is_file() and "| rows | event ms" in log.read_text(errors="replace"):
    text = log.read_text(errors="replace")
    L += ["## One verification call: host issue, kernels, replay (bench.profile_call)", "",
          text[text.index("one model call"):text.rindex("\n{")].strip(), ""]
md = out / "end_to_end" / "speed.md"
if md.is_file():
    L += ["## End to end on the shipped model", "", md.read_text(), ""]
md = out / "cuda_graphs" / "speed.md"
if md.is_file():
    L += ["## CUDA graphs: eager against --cuda-graphs (static rows, one GPU)", "", md.read_text(), ""]
L += ["## nvidia-smi", "", "```", (out / "nvidia-smi.txt").read_text().rstrip() if (out / "nvidia-smi.txt").is_file()
      else "(not captured)", "```", ""]
for s in failed:
    log = out / s["log"]
    tail = log.read_text(errors="replace").splitlines()[-25:] if log.is_file() else [s.get("command", "")]
    L += [f"## {s['section']}: {s['status']} (last lines of {s['log']})", "", "```", *tail, "```", ""]
(out / "summary.md").write_text("\n".join(L) + "\n")
print(f"summary: {out / 'summary.md'}; {len(failed)} of {len(sections)} sections failed")
EOF
SUMMARY_RC=$?
FAILED=$(awk -F'\t' 'NR > 1 && $2 != "ok"' "$SECTIONS" | wc -l)
echo "report: $OUT/summary.md (${TOTAL}s, $FAILED failed section(s))" >&2
[[ $FAILED -eq 0 && $SUMMARY_RC -eq 0 ]]
