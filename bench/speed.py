"""`python -m bench.speed`: wall-clock speed of decoding methods, and the cost of one model call.

    python -m bench.speed                                        # shipped model, this machine
    python -m bench.speed --methods greedy confidence psd:policy=confidence,d=3 spiffy:d=3 \\
        --batch-sizes 1 32 --num-prompts 16 32 --cache none dual --gen-length 64 --repeats 3
    python -m bench.speed --shape llada-8b --dtype bfloat16 --cost-curve     # random weights, GPU
    python -m bench.speed --model DIR --prompts prompts.txt ...              # any checkpoint

End to end: every configuration (gen length x prompt length x cache mode x batch size) decodes
the same prompts with every method; each repeat runs every method once, in an order rotated
by one per repeat, so ratios against greedy and against the same policy without drafts
(psd(confidence) vs confidence, spiffy vs greedy) are measured side by side, per repeat, and
reported as min and median. Both baselines are added when not listed. Per method: tokens/s,
ms per model call (wall time / batched model calls, the loop's own work included), rows per
call, calls, TPF, peak memory (CUDA max_memory_allocated, or the process's peak RSS on CPU).

`--cost-curve`: the latency of ONE model call as a function of its query rows: R draft blocks
of the block length per sequence over one cached prefix of 512/1024/4096 tokens, through the
engine's own cache modes (dual by default: the cache is built once, then `CACHE_MODES[mode].call`
runs the rows over it with every row mapped to its sequence's cache row). Writes a cost
profile (JSON, docs/gpu.md) that tools read to choose draft budgets.

A uniform-noise model (DiffusionGemma: `--shape diffusiongemma-26b-a4b`, `tiny-diffusiongemma`, or
its checkpoint) has no mask and no cache modes: its cost curve times the decoder call of a
denoising step (R canvases of its canvas length per sequence, bidirectional, each over its
sequence's encoder KV of the prefix, with the previous step's logits as self-conditioning input;
bench/workload.py `UniformCalls`, the engine's own calls); its decodes run in bench.eval and
engine.generate, and `--simulate` projects them from a DiffusionGemma `--model` of the shape's
canvas length.

`--simulate CARD [CARD ...]` (bench/simulate.py) prints a PROJECTION, not a measurement: the
methods decode here with the acceptance model, every model call is recorded, and each call is
costed on the card by a roofline at `--shape` (HBM bandwidth and dense bf16 FLOP/s from the
vendor datasheets) or by a measured `--cost-profile`; docs/gpu.md gives the formula.

`--shape NAME` builds random weights at a real shape in memory, on the target device and in
the target dtype (nothing touches the disk): acceptance is meaningless there, so only the call
cost side (ms per call against rows per call) is reported.

Output (`--out DIR`, default a fresh runs/speed-<time>/): CSV with the device, torch/triton
versions and the command line on every row, a Markdown table (printed too), a JSON file, and
one final JSON line on stdout; a file of an earlier run in --out is replaced only with --overwrite.
Bad input: one `error:` line, exit status 2.
"""
from __future__ import annotations

import datetime
import json
import os
import re
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from engine import CACHE_MODES, DecodeConfig, Decoder, InputError, aggregate, graphs
from engine.frontend import (DEFAULT_MODEL_DIR, DTYPE_CHOICES, Parser, add_gemm_flag, add_plugin_flag, add_threads_flag,
                             checked_gemm, guarded, plugins_loaded, progress, resolve_device)
from engine.config import check_prompts
from engine.errors import check_regular
from engine.methods import METHODS
from engine.options import OPTIONS, RUNTIME
from models import DTYPES, CheckpointError, ModelConfig, Tokenizer, Transformer, load_model
from models.checkpoint import available_memory

from . import simulate
from ._common import THREADS_HELP, bench_threads, device_name, versions, write_rows
from .eval import check_distinct, method_config, parse_method, spec_label, spec_text
from .workload import (SHAPES, build_random, cached_block, call_mode, checkpoint_prompts, fit_length, kv_width,
                       param_count, random_prompts, settle_run, shape_config, verification_call)

PROFILE_FORMAT = "psd-cost-profile/1"
DEFAULT_METHODS = ["greedy", "confidence", "psd:policy=confidence,d=3"]
RANDOM_NOTE = ("random weights (--shape): acceptance, TPF and tokens/s mean nothing here; read the call cost "
               "(ms per call against rows per call)")

# ---------------------------------------------------------------------- measuring
class CallCounter:
    """Counts the model's forward calls and their rows (a pre-hook: no host sync)."""

    def __init__(self, model: Transformer):
        self.calls = self.rows = 0
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        if graphs.active():          # --cuda-graphs: a warm-up or capture inside one call, counted from its stats
            return
        ids = args[0] if args else kwargs["ids"]
        self.calls += 1
        self.rows += ids.shape[0]

    def reset(self) -> None:
        self.calls = self.rows = 0

    def remove(self) -> None:
        self.handle.remove()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:                                    # Linux: "5" resets the process's peak RSS (VmHWM)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_memory_mib(device: torch.device) -> float | None:
    """CUDA: max_memory_allocated since the last reset; CPU: the process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            m = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
        if m:
            return int(m.group(1)) / 1024
    except OSError:
        pass
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    except (ImportError, OSError):
        return None


def time_call(fn, device: torch.device, reps: int, warmup: int = 2) -> tuple[float, float]:
    """(median, min) milliseconds of `fn()`: CUDA events on GPU, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    times = []
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), min(times)


# ---------------------------------------------------------------------- methods and baselines
def method_label(name: str, opts: dict) -> str:
    return spec_label(DecodeConfig(method=name, **opts).validate(), opts)


def no_draft_baseline(name: str, opts: dict) -> tuple[str, dict] | None:
    """The same stage-1 policy without drafts (psd(confidence, τ) -> confidence(τ), spiffy and
    fdm -> greedy, lopa -> confidence), or None for a method that runs no drafts."""
    cfg = DecodeConfig(method=name, **opts).validate()
    if cfg.spec.graph is None:
        return None
    pol = cfg.spec.policy_class(cfg)
    for mname, m in METHODS.items():
        if m.is_policy and m.policy is pol:     # its parameters, how its calls run (--compile, --static-rows)
            # and the general options the spec gave (its own cache, temperature, ...): decoded alike
            return mname, {o: v for o, v in cfg.given.items() if o in (*pol.params, *RUNTIME) or OPTIONS[o].general}
    return None


def method_plan(specs: list[str]) -> list[dict]:
    """Methods to run, in order: greedy first, each method's no-draft baseline before it (added
    where not listed; one that is listed runs once). Specs listed twice, or two under one label, are an
    error (`check_distinct`). Each: name, opts, label, and the labels of its two baselines (greedy, and
    the same policy without drafts or None)."""
    parsed = [parse_method(s) for s in specs]
    cfgs = [DecodeConfig(method=name, **opts).validate() for name, opts in parsed]
    labels = [spec_label(cfg, opts) for cfg, (_, opts) in zip(cfgs, parsed)]
    check_distinct([(spec_text(name, opts), cfg, label) for (name, opts), cfg, label in zip(parsed, cfgs, labels)])
    listed = set(labels)               # (listed twice, or two rows merged under one label: refused above)
    plan, seen = [], {}

    def add(name, opts):
        label = method_label(name, opts)
        if label not in seen:
            seen[label] = {"name": name, "opts": opts, "label": label, "added": label not in listed, "base": None}
            plan.append(seen[label])
        return seen[label]

    greedy = add("greedy", {})
    for name, opts in parsed:
        base = no_draft_baseline(name, opts)
        base_label = add(*base)["label"] if base is not None else None
        add(name, opts)["base"] = base_label
    for e in plan:
        e["greedy"] = greedy["label"]
    return plan


# ---------------------------------------------------------------------- end to end
def _merge(hists: list[dict]) -> dict:
    out: dict[str, int] = {}
    for h in hists:
        for k, v in h.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


def _graphed(dec) -> tuple[int, int]:
    """Calls and rows a --cuda-graphs decoder served through graphs (their forwards are replays)."""
    stats = getattr(dec.cache_mode, "stats", None)
    return (stats["calls"], stats["rows"]) if stats else (0, 0)


def measure_config(model, counter, device, plan, prompts, batch_size, cache, gen_length, block_length,
                   repeats, warmup, pbar) -> list[dict]:
    """Decode `prompts` with every method of `plan`, repeats interleaved in rotating order."""
    decs = {e["label"]: Decoder(model, method_config(e["name"], e["opts"], model.config, gen_length=gen_length,
                                                     block_length=block_length, cache=cache))
            for e in plan}
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    labels = [e["label"] for e in plan]
    for label in labels if warmup else ():
        decs[label].generate(batches[0])            # first-call allocations, kernel compilation
    runs: dict[str, list[dict]] = {lab: [] for lab in labels}
    for r in range(repeats):
        k = r % len(labels)
        for label in labels[k:] + labels[:k]:
            _sync(device)
            _reset_peak(device)
            counter.reset()
            served = _graphed(decs[label])
            results = []
            t0 = time.perf_counter()
            for b in batches:
                results += decs[label].generate(b)
            _sync(device)
            seconds = time.perf_counter() - t0
            served = [a - b for a, b in zip(_graphed(decs[label]), served)]      # replayed calls (--cuda-graphs)
            runs[label].append({"seconds": seconds, "calls": counter.calls + served[0], "rows": counter.rows + served[1],
                                "agg": aggregate(results), "peak": peak_memory_mib(device)})
            if pbar is not None:
                pbar.update(1)
    out = []
    for e in plan:
        rs = runs[e["label"]]
        secs = [x["seconds"] for x in rs]
        med = statistics.median(secs)
        agg, calls, rows = rs[0]["agg"], rs[0]["calls"], rs[0]["rows"]

        def ratio(other):
            if other is None:
                return None, None
            q = [o["seconds"] / m["seconds"] for o, m in zip(runs[other], rs)]    # same repeat, side by side
            return min(q), statistics.median(q)

        g_min, g_med = ratio(e["greedy"])
        b_min, b_med = ratio(e["base"])
        peaks = [x["peak"] for x in rs if x["peak"] is not None]
        out.append({
            "method": e["label"], "spec": spec_text(e["name"], e["opts"]), "added_baseline": e["added"], "batch": batch_size,
            "cache": cache, "gen_length": gen_length, "block_length": block_length, "prompts": len(prompts),
            "prompt_tokens": round(statistics.mean(len(p) for p in prompts), 1), "repeats": len(rs),
            "tokens": agg["tokens"], "seconds_median": med, "seconds_min": min(secs),
            "tokens_per_s": agg["tokens"] / med, "calls": calls, "ms_per_call": 1e3 * med / max(calls, 1),
            "rows_per_call": rows / max(calls, 1), "ms_per_row": 1e3 * med / max(rows, 1),
            "seq_calls": agg["calls"], "tpf": agg["tpf"], "rows_per_seq_call": agg["rows_per_call"],
            "draft_token_share": agg["draft_token_share"], "peak_mib": max(peaks) if peaks else None,
            # graph nodes verified per verification call, every repeat (--draft-budget auto: its choices)
            "draft_nodes": json.dumps(_merge([x["agg"]["draft_nodes"] for x in rs])),
            "vs_greedy_min": g_min, "vs_greedy_median": g_med, "baseline": e["base"],
            "vs_baseline_min": b_min, "vs_baseline_median": b_med,
        })
    return out


# ---------------------------------------------------------------------- cost curve
def cost_curve(model, device, cache: str, prefixes, rows_list, batch_sizes, block_length, reps, warmup, seed,
               pbar) -> list[dict]:
    """ms of one model call of R draft blocks per sequence over one cached prefix per sequence."""
    mc = model.config
    mode = call_mode(model, cache)          # a uniform-noise model: its encoder, then decoder calls
    L = block_length
    curves = []
    for S in prefixes:
        for B in batch_sizes:
            block = cached_block(mode, mc, B, S, L, seed, device)       # the block's first call builds the cache
            gen = torch.Generator().manual_seed(seed + 1)
            ms, ms_min = [], []
            for R in rows_list:
                seq_rows = torch.arange(B, device=device).repeat_interleave(R)
                call = verification_call(mode, mc, block, seq_rows, gen)    # drafts: half the block filled in
                med, low = time_call(call, device, reps, warmup)
                ms.append(med)
                ms_min.append(low)
                if pbar is not None:
                    pbar.update(1)
            curves.append({"prefix": S, "batch": B, "rows": list(rows_list), "ms": ms, "ms_min": ms_min})
            block = call = None                # the cache goes before the next prefix is built
    return curves


# ---------------------------------------------------------------------- output
def default_out_dir() -> Path:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("runs") / f"speed-{stamp}"
    out, n = base, 1
    while out.exists():
        n += 1
        out = base.with_name(f"{base.name}-{n}")
    return out


def _f(v, fmt="{:.2f}") -> str:
    return "-" if v is None else fmt.format(v)


def _pair(lo, med) -> str:
    return "-" if med is None else f"{med:.2f}x ({lo:.2f}x)"


def e2e_markdown(rows: list[dict], header: str, random_weights: bool) -> str:
    if random_weights:
        lines = [header, "", f"*{RANDOM_NOTE}*", "",
                 "| batch | cache | prompt | method | calls | rows/call | ms/call | ms/row | peak MiB |",
                 "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['batch']} | {r['cache']} | {r['prompt_tokens']:g} | {r['method']} | {r['calls']} | "
                         f"{r['rows_per_call']:.2f} | {r['ms_per_call']:.2f} | {r['ms_per_row']:.3f} | "
                         f"{_f(r['peak_mib'], '{:.0f}')} |")
        return "\n".join(lines)
    lines = [header, "",
             "Ratios are wall-clock speedups (baseline seconds / method seconds) measured in the same run, "
             "per repeat: median (min). `*`: added as a baseline.", "",
             "| batch | cache | method | tokens/s | ms/call | rows/call | calls | TPF | peak MiB | vs greedy | "
             "vs no drafts |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        star = "*" if r["added_baseline"] else ""
        lines.append(f"| {r['batch']} | {r['cache']} | {r['method']}{star} | {r['tokens_per_s']:.0f} | "
                     f"{r['ms_per_call']:.2f} | {r['rows_per_call']:.2f} | {r['calls']} | {r['tpf']:.2f} | "
                     f"{_f(r['peak_mib'], '{:.0f}')} | {_pair(r['vs_greedy_min'], r['vs_greedy_median'])} | "
                     f"{_pair(r['vs_baseline_min'], r['vs_baseline_median'])} |")
    return "\n".join(lines)


def cost_markdown(curves: list[dict], header: str) -> str:
    lines = [header, "", "ms of one model call (median); `x1` = the cost relative to one row.", "",
             "| prefix | batch | rows | ms | ms (min) | x1 |", "|---|---|---|---|---|---|"]
    for c in curves:
        for R, ms, lo in zip(c["rows"], c["ms"], c["ms_min"]):
            lines.append(f"| {c['prefix']} | {c['batch']} | {R} | {ms:.3f} | {lo:.3f} | {ms / c['ms'][0]:.2f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def build_parser() -> Parser:
    p = Parser(prog="python -m bench.speed", description=__doc__.split("\n")[0])
    add_plugin_flag(p)
    p.add_argument("--model", help="checkpoint directory (default: the shipped models/default); with --simulate the "
                                    "acceptance model whose calls --shape's roofline costs")
    p.add_argument("--shape", choices=list(SHAPES),
                   help="random weights at a real shape, built in memory (no acceptance: call cost only); not with "
                        "--model, except under --simulate")
    p.add_argument("--methods", nargs="+",
                   help="method specs as bench.eval takes them (name[:key=value,...]); greedy and each "
                        f"method's no-draft baseline are added (default: {' '.join(DEFAULT_METHODS)}; with "
                        f"--simulate: {' '.join(simulate.DEFAULT_METHODS)}, nothing added)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1])
    p.add_argument("--num-prompts", type=int, nargs="+",
                   help="prompts per configuration: one value, or one per batch size "
                        "(default: 8 for batches below 8, else one batch)")
    p.add_argument("--cache", nargs="+", choices=list(CACHE_MODES),
                   help="default none; a uniform-noise model (diffusion_gemma) takes none: its encoder's cache")
    p.add_argument("--prompt-length", type=int, nargs="+",
                   help="prompt tokens (default: 64 with --shape; a checkpoint's prompts as they are); with a "
                        "checkpoint each prompt is cut to / filled up to this length with other prompts' tokens")
    p.add_argument("--gen-length", type=int, nargs="+", default=[64])
    p.add_argument("--block-length", type=int, help="default 32; a uniform-noise model's is its canvas length")
    p.add_argument("--task", default="math", choices=["math", "code"],
                   help="held-out prompts of a checkpoint (default: math)")
    p.add_argument("--prompts", help="prompt file: one prompt per line, or JSONL with a \"prompt\" field")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats (ratios: min and median)")
    p.add_argument("--no-warmup", action="store_true", help="skip the untimed first batch of every method")
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    add_gemm_flag(p)
    add_threads_flag(p, THREADS_HELP)
    p.add_argument("--seed", type=int, default=0, help="seed of random weights and random prompts")
    p.add_argument("--cost-curve", action="store_true",
                   help="time ONE model call against its rows instead of decoding")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32],
                   help="--cost-curve: draft blocks per sequence in one call")
    p.add_argument("--prefix", type=int, nargs="+", default=[512, 1024, 4096],
                   help="--cost-curve: cached prefix tokens")
    p.add_argument("--cost-cache", default="dual", choices=list(CACHE_MODES),
                   help="--cost-curve: cache mode (a uniform-noise model: its decoder over the encoder's cache)")
    p.add_argument("--cost-reps", type=int, help="--cost-curve: timed calls per point (default: 20 GPU, 5 CPU)")
    p.add_argument("--cost-profile-out", help="--cost-curve: the cost profile JSON (default: OUT/cost_profile.json)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace existing output files: --cost-profile-out and what this run writes in --out")
    _add_simulate_flags(p)
    p.add_argument("--out", help="output directory (default: a fresh runs/speed-<time>/)")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr (a bar at a terminal, else a line "
                                                         "every 30 s, $PSD_PROGRESS_SECONDS)")
    return p


def _add_simulate_flags(p: Parser) -> None:
    """--simulate and the roofline's settings (bench/simulate.py)."""
    p.add_argument("--simulate", nargs="+", metavar="CARD",
                   help="a PROJECTION, not a measurement (bench/simulate.py): decode here, record every call, "
                        f"cost each call on CARD ({', '.join(simulate.CARDS)}) by a roofline at --shape (or "
                        "--cost-profile) and print projected tokens/s")
    p.add_argument("--cost-profile", metavar="PATH",
                   help="--simulate: cost of a call from a bench.speed --cost-curve profile instead of the roofline")
    p.add_argument("--call-overhead-ms", dest="overhead_ms", type=float,
                   help="--simulate: fixed cost added to every roofline call (default 1.0: CUDA-graph replay "
                        "beyond the kernels, measured on an H200)")
    p.add_argument("--kernel-efficiency", type=float,
                   help="--simulate: the fraction of the roofline the call's kernels reach (default 0.43, measured "
                        "on an H200)")
    p.add_argument("--host-ms-per-layer", type=float,
                   help="--simulate: host time to issue one layer of an eager call; the call takes the larger of "
                        "it and the kernels (default 0.87, measured on an H200's host; 0: CUDA-graph replay)")


def _positive(name: str, values) -> None:
    for v in values if isinstance(values, (list, tuple)) else [values]:
        if v is not None and v < 1:
            raise InputError(f"{name} must be >= 1, got {v}")


def _check_args(args) -> None:
    _positive("--batch-sizes", args.batch_sizes)
    _positive("--num-prompts", args.num_prompts or [])
    _positive("--prompt-length", args.prompt_length or [])
    _positive("--gen-length", args.gen_length)
    _positive("--block-length", args.block_length)
    _positive("--repeats", args.repeats)
    _positive("--rows", args.rows)
    _positive("--prefix", args.prefix)
    _positive("--cost-reps", args.cost_reps)
    if args.num_prompts and len(args.num_prompts) not in (1, len(args.batch_sizes)):
        raise InputError(f"--num-prompts takes one value or one per batch size ({len(args.batch_sizes)}), "
                         f"got {len(args.num_prompts)}")
    if args.shape and args.model and not args.simulate:
        raise InputError("give --model (a checkpoint) or --shape (random weights), not both; with --simulate, "
                         "--model decodes and --shape is the roofline's target")
    if args.shape and args.prompts:
        raise InputError("--prompts needs a checkpoint (--model); --shape decodes random prompts")
    if args.prompts:
        check_regular(args.prompts, "prompt file", InputError)
    if args.out and Path(args.out).exists() and not Path(args.out).is_dir():
        raise InputError(f"--out {args.out} exists and is not a directory")
    for flag, value in (("--cost-profile", args.cost_profile), ("--call-overhead-ms", args.overhead_ms),
                        ("--kernel-efficiency", args.kernel_efficiency), ("--host-ms-per-layer", args.host_ms_per_layer)):
        if value is not None and not args.simulate:
            raise InputError(f"{flag} applies to --simulate only")
    if args.cost_profile_out is not None:
        check_output_file(Path(args.cost_profile_out), "--cost-profile-out", args.overwrite, args.cost_curve)
    _check_out_files(args)


OUT_FILES = {"simulate": ("projection.md", "projection.csv", "projection.json"),
             "cost_curve": ("cost_profile.json", "cost_curve.csv", "cost_curve.md"),
             "end_to_end": ("speed.csv", "speed.md", "speed.json")}


def _check_out_files(args) -> None:
    """The files this run writes in an existing --out are checked like --cost-profile-out, before
    anything is measured: one that exists is replaced only with --overwrite (the default
    runs/speed-<time>/ is fresh)."""
    if not args.out or not Path(args.out).is_dir():
        return
    mode = "simulate" if args.simulate else "cost_curve" if args.cost_curve else "end_to_end"
    for name in OUT_FILES[mode]:
        if name != "cost_profile.json" or args.cost_profile_out is None:
            check_output_file(Path(args.out) / name, "--out", args.overwrite)


def check_output_file(path: Path, flag: str, overwrite: bool, applies: bool = True) -> None:
    """An output file is checked before anything is measured: a directory, an existing file
    without --overwrite or a directory that cannot be created or written is one error line."""
    if not applies:
        raise InputError(f"{flag} applies to --cost-curve only")
    if path.is_dir():
        raise InputError(f"{flag} {path} is a directory; give a file path")
    if os.path.lexists(path) and not overwrite:
        raise InputError(f"{flag} {path} exists; pass --overwrite to replace it")
    if os.path.lexists(path) and not path.is_file():
        raise InputError(f"{flag} {path} is not a regular file")
    parent = path.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{flag} {path}: cannot create its directory {parent} ({e.strerror})") from None
    if not os.access(parent, os.W_OK | os.X_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise InputError(f"{flag} {path}: not writable")


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_memory(mc: ModelConfig, name: str, dtype: torch.dtype, device: torch.device, tokens: int) -> None:
    """Random weights at a real shape are built in memory: the weights and the KV cache of the
    largest configuration (`tokens` positions, all sequences of a batch together) must fit the
    device's memory, else one error line before anything is allocated (an estimate from below:
    activations and logits come on top)."""
    size = torch.empty((), dtype=dtype).element_size()
    weights = mc.parameter_count() * size
    cache = tokens * kv_width(mc) * size
    have = available_memory(device)
    if weights + cache > have:
        where = "GPU" if device.type == "cuda" else "machine"
        raise InputError(f"--shape {name} needs at least {_gib(weights + cache)} ({_gib(weights)} of "
                         f"{str(dtype).removeprefix('torch.')} weights, {mc.parameter_count() / 1e9:.2f}B parameters, "
                         f"+ {_gib(cache)} of KV cache for {tokens} positions), more than this {where}'s "
                         f"{_gib(have)} of memory; use a smaller shape, a GPU with more memory or --model DIR")


def _largest_tokens(args, plan, mc: ModelConfig) -> int:
    """Positions held at once by the largest configuration (a lower bound: every sequence of the
    batch, its prompt, generation and, for a cost curve, every draft block of one call)."""
    if args.cost_curve and mc.mask_token_id is None:     # every canvas reads its own copy of its encoder cache
        return max(args.batch_sizes) * max(args.rows) * (max(args.prefix) + args.block_length)
    if args.cost_curve:
        return max(args.batch_sizes) * (max(args.prefix) + max(args.rows) * args.block_length)
    plen = max(args.prompt_length or [64])
    return max(args.batch_sizes) * (plen + max(args.gen_length))


def main(argv=None) -> int:
    if not plugins_loaded(sys.argv[1:] if argv is None else argv):   # a plugin's methods are method specs here
        return 2
    args = build_parser().parse_args(argv)
    return guarded(_run, args, sys.argv[1:] if argv is None else list(argv),
                   errors=(FileNotFoundError, ValueError))


def _run(args, argv) -> int:
    _check_args(args)
    command = "python -m bench.speed " + " ".join(shlex.quote(a) for a in argv)
    if args.simulate:                       # a projection: decode here, cost every call on the card
        bench_threads(args.threads)
        device = torch.device(resolve_device(args.device))
        return simulate.run(args, command, versions(), device, device_name(device))
    peeked = _settle_model(args)
    plan = [] if args.cost_curve else method_plan(args.methods or DEFAULT_METHODS)
    if not args.cost_curve:
        _check_method_options(args, plan, peeked)
    bench_threads(args.threads)
    device = torch.device(resolve_device(args.device))
    checked_gemm(args.gemm, device, args.dtype)
    dtype = DTYPES[args.dtype]
    random_weights = args.shape is not None
    mc, model_name, model_dir, tok = _model_source(args, dtype, device, plan)
    prompt_sets, source = {}, None
    if not args.cost_curve:
        prompt_sets, source = _prompt_sets(args, mc, tok)
    out = Path(args.out) if args.out else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)

    t_load = time.perf_counter()
    model = build_random(mc, device, dtype, args.seed) if random_weights else load_model(model_dir, dtype=args.dtype,
                                                                                          device=str(device))
    model.set_gemm(args.gemm)
    load_s = time.perf_counter() - t_load
    stamp, header, summary = _describe(args, model, model_name, device, command, out, load_s)
    if random_weights:
        print(f"note: {RANDOM_NOTE}", file=sys.stderr)
    if args.cost_curve:
        return _cost_curve_report(args, model, device, out, stamp, header, summary)
    return _end_to_end_report(args, model, device, plan, prompt_sets, source, out, stamp, header, summary)


def _peek_config(args) -> ModelConfig | None:
    """The config of --shape or --model if it reads now, else None (its error comes where the model is read)."""
    if args.shape is not None:
        return shape_config(args.shape)
    try:
        model_dir = Path(args.model or DEFAULT_MODEL_DIR)
        return ModelConfig.from_dir(model_dir) if model_dir.is_dir() else None
    except (CheckpointError, OSError, ValueError):
        return None


def _settle_model(args) -> ModelConfig | None:
    """--block-length and --cache for the model (`settle_run`); a uniform-noise model's speed here
    is its call's cost (--cost-curve) or its projection (--simulate): its decodes run in
    engine.generate and bench.eval, which count its calls. Returns the model's config (`_peek_config`)."""
    mc = _peek_config(args)
    settle_run(args, mc)
    if mc is not None and mc.mask_token_id is None and not args.cost_curve:
        raise InputError(f"bench.speed decodes masked models end to end; a {mc.family} model takes --cost-curve "
                         f"(its decoder call) or --simulate CARD (a projection); bench.eval and engine.generate "
                         f"decode it")
    return mc


def _check_method_options(args, plan, mc: ModelConfig | None) -> None:
    """Every method's options at every gen length and cache mode, checked before any weight is read,
    against the model's config where it reads (`engine.uniform.for_model`: what the model decodes,
    e.g. `--align auto` is `sequence` on a block-causal model, which takes any gen length); None: the
    model's own error comes where it is read, before anything is measured."""
    for gl in args.gen_length:
        for cache in args.cache:
            for e in plan:
                method_config(e["name"], e["opts"], mc, gen_length=gl, block_length=args.block_length, cache=cache)


def _model_source(args, dtype: torch.dtype, device: torch.device, plan):
    """(model config, model name, checkpoint directory or None, tokenizer or None): a real shape's
    config once its weights are known to fit (--shape), else the checkpoint's config and tokenizer."""
    if args.shape is not None:
        mc = shape_config(args.shape)
        check_memory(mc, args.shape, dtype, device, _largest_tokens(args, plan, mc))
        return mc, args.shape, None, None
    model_dir = Path(args.model or DEFAULT_MODEL_DIR)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist or is not a directory")
    return ModelConfig.from_dir(model_dir), str(model_dir), model_dir, Tokenizer(model_dir)


def _prompt_sets(args, mc: ModelConfig, tok):
    """({(batch size, number of prompts, prompt length): prompts}, where the prompts come from): random tokens
    for --shape, else the checkpoint's prompts fitted to each --prompt-length; every set checked
    against every gen length."""
    random_weights = args.shape is not None
    prompt_lengths = args.prompt_length or ([64] if random_weights else [None])
    nums = args.num_prompts or [max(8, b) if b < 8 else b for b in args.batch_sizes]
    if len(nums) == 1:
        nums = nums * len(args.batch_sizes)
    prompt_sets, source = {}, None
    for b, n in zip(args.batch_sizes, nums):
        for plen in prompt_lengths:
            if random_weights:
                prompts, source = random_prompts(mc, n, plen, args.seed), "random tokens"
            else:
                prompts, source = checkpoint_prompts(args, tok, n)
                prompts = fit_length(prompts, plen)
            for gl in args.gen_length:
                check_prompts(mc, DecodeConfig(gen_length=gl, block_length=args.block_length), prompts)
            prompt_sets[b, n, plen] = prompts
    return prompt_sets, source


def _describe(args, model, model_name: str, device: torch.device, command: str, out: Path, load_s: float):
    """(stamp on every CSV row, header line of the tables, summary JSON so far) of this run."""
    random_weights = args.shape is not None
    dev_name = device_name(device)
    stamp = {"device": dev_name, **versions(), "dtype": args.dtype, "gemm": args.gemm, "model": model_name,
             "random_weights": random_weights, "date": datetime.datetime.now().isoformat(timespec="seconds"),
             "command": command}
    header = (f"model={model_name} ({param_count(model) / 1e6:.1f}M parameters{', random weights' if random_weights else ''}) "
              f"dtype={args.dtype} gemm={args.gemm} device={dev_name} torch={stamp['torch']} triton={stamp['triton']}")
    summary = {"bench": "speed", "out_dir": str(out), "device": dev_name, **versions(), "dtype": args.dtype,
               "gemm": args.gemm,
               "model": model_name, "random_weights": random_weights, "load_seconds": round(load_s, 2),
               "command": command}
    return stamp, header, summary


def _cost_curve_report(args, model, device: torch.device, out: Path, stamp: dict, header: str, summary: dict) -> int:
    """--cost-curve: time one call per point, write the cost profile, CSV and Markdown, print the summary."""
    command = stamp["command"]
    reps = args.cost_reps or (20 if device.type == "cuda" else 5)
    total = len(args.prefix) * len(args.batch_sizes) * len(args.rows)
    with progress(total, "cost curve: points", args.quiet) as pbar:
        curves = cost_curve(model, device, args.cost_cache, args.prefix, args.rows, args.batch_sizes,
                            args.block_length, reps, 0 if args.no_warmup else 2, args.seed, pbar)
    cache = args.cost_cache if model.config.mask_token_id is not None else "encoder"   # uniform noise: its own
    meta = {"device": stamp["device"], "model": stamp["model"], "dtype": args.dtype, "cache": cache,
            "block_length": args.block_length}
    profile = {"format": PROFILE_FORMAT, **versions(), "command": command, "reps": reps,
               "curves": [{**meta, **c} for c in curves]}
    prof_path = Path(args.cost_profile_out) if args.cost_profile_out else out / "cost_profile.json"
    prof_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        prof_path.write_text(json.dumps(profile, indent=1) + "\n", encoding="utf-8")
    except OSError as e:                    # checked up front; a disk that filled up since is still one line
        raise InputError(f"--cost-profile-out {prof_path}: cannot write ({e.strerror})") from None
    flat = [{"prefix": c["prefix"], "batch": c["batch"], "rows": R, "block_length": args.block_length,
             "cache": cache, "ms": ms, "ms_min": lo, "x1": ms / c["ms"][0]}
            for c in curves for R, ms, lo in zip(c["rows"], c["ms"], c["ms_min"])]
    write_rows(out / "cost_curve.csv", flat, stamp)
    md = cost_markdown(curves, f"cost of one model call ({cache} cache, block {args.block_length}, "
                               f"{reps} timed calls per point): {header}\n\ncommand: `{command}`")
    (out / "cost_curve.md").write_text(md + "\n", encoding="utf-8")
    print(md)
    summary.update(mode="cost_curve", cost_profile=str(prof_path), csv=str(out / "cost_curve.csv"),
                   markdown=str(out / "cost_curve.md"),
                   curves=[{"prefix": c["prefix"], "batch": c["batch"], "rows": c["rows"],
                            "ms": [round(v, 4) for v in c["ms"]]} for c in curves])
    print(json.dumps(summary))
    return 0


def _measure_all(args, model, device: torch.device, plan, prompt_sets) -> list[dict]:
    """One row per method and configuration (gen length x prompt set x cache mode), calls counted."""
    counter = CallCounter(model)
    rows = []
    total = len(prompt_sets) * len(args.gen_length) * len(args.cache) * args.repeats * len(plan)
    with progress(total, "speed: decodes", args.quiet) as pbar:
        for gl in args.gen_length:
            for (b, n, plen), prompts in prompt_sets.items():
                for cache in args.cache:
                    rows += measure_config(model, counter, device, plan, prompts, b, cache, gl, args.block_length,
                                           args.repeats, not args.no_warmup, pbar)
    counter.remove()
    return rows


def _end_to_end_report(args, model, device: torch.device, plan, prompt_sets, source, out: Path, stamp: dict,
                       header: str, summary: dict) -> int:
    """Decode every configuration with every method, write CSV, Markdown and JSON, print the summary."""
    command = stamp["command"]
    random_weights = args.shape is not None
    rows = _measure_all(args, model, device, plan, prompt_sets)
    if random_weights:          # no tokens/s claim from random weights: what acceptance gives is meaningless
        for r in rows:
            r.update({k: None for k in ("tokens_per_s", "tpf", "draft_token_share", "vs_greedy_min",
                                         "vs_greedy_median", "vs_baseline_min", "vs_baseline_median")})
    write_rows(out / "speed.csv", rows, stamp)
    md = e2e_markdown(rows, f"{header}\n\nprompts: {source}; gen length {', '.join(map(str, args.gen_length))}, "
                            f"block {args.block_length}, {args.repeats} interleaved repeats\n\ncommand: `{command}`",
                      random_weights)
    (out / "speed.md").write_text(md + "\n", encoding="utf-8")
    (out / "speed.json").write_text(json.dumps({**summary, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    print(md)
    if random_weights:
        print(f"\nnote: {RANDOM_NOTE}")
    keep = ("method", "batch", "cache", "gen_length", "prompt_tokens", "calls", "rows_per_call", "ms_per_call",
            "peak_mib") + (() if random_weights else ("tokens_per_s", "tpf", "vs_greedy_min", "vs_greedy_median",
                                                      "vs_baseline_min", "vs_baseline_median"))
    summary.update(mode="end_to_end", csv=str(out / "speed.csv"), markdown=str(out / "speed.md"),
                   json=str(out / "speed.json"), rows=[{k: r[k] for k in keep} for r in rows])
    if random_weights:
        summary["note"] = RANDOM_NOTE
    print(json.dumps(summary))
    return 0

if __name__ == "__main__":
    sys.exit(main())
