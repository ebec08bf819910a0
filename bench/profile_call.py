"""Where the time of ONE model call goes: host issue time, device kernel time, launches, replay.

    python -m bench.profile_call --shape llada-8b --dtype bfloat16 --prefix 512 --rows 1 16   # a GPU
    python -m bench.profile_call --shape tiny --rows 1 4 --reps 3                            # CPU, seconds

The call is the one `bench.speed --cost-curve` times (the cache mode's verification `call` of R
draft blocks per sequence over one cached prefix, random weights at a real shape). Per R it
reports:

  event ms     the call's wall time on the device (CUDA events; perf_counter on CPU), median
  host ms      the time Python takes to issue the call, without waiting for the device: when it
               is close to `event ms` the call is launch-bound (the GPU waits for the host)
  kernel ms    the device time of the call's kernels (torch.profiler, summed), and `launches`,
               the number of kernels one call runs (on CPU: the aten ops' own time, and the ops
               without children)
  graph ms     the same call captured once in a CUDA graph and replayed (GPU only): the call
               without the host's launch cost
  roofline ms  bench.simulate's roofline of the same call on `--card` (bytes / bandwidth or
               FLOPs / peak, no overhead)

and the kernels that take the most device time. docs/gpu.md reads this table to say what the
projection's fixed `--call-overhead-ms` should be.
"""
from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict

import torch

from engine import CACHE_MODES, InputError
from engine.frontend import DTYPE_CHOICES, Parser, add_threads_flag, guarded
from models import DTYPES

from ._common import THREADS_HELP, bench_threads, device_name, versions
from .simulate import CARDS, Call, call_ms, card_key
from .speed import time_call
from .workload import SHAPES, build_random, cached_block, call_mode, shape_config, verification_call


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def host_ms(fn, device: torch.device, reps: int) -> float:
    """Median time to issue `fn` (the device is drained before each, not after)."""
    times = []
    for _ in range(reps):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    _sync(device)
    return statistics.median(times)


def kernel_profile(fn, device: torch.device, reps: int) -> tuple[float, float, list[tuple[str, float, int]]]:
    """(device ms per call, kernels per call, [(kernel, ms per call, count per call)] by time)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=acts) as prof:
        for _ in range(reps):
            fn()
        _sync(device)
    per = defaultdict(lambda: [0.0, 0])
    for ev in prof.events():
        if device.type == "cuda":
            if ev.device_type != torch.autograd.DeviceType.CUDA:
                continue
            t = ev.device_time
        else:                                  # CPU: every aten op's own time; a leaf op counts as one launch
            if not ev.name.startswith("aten::"):
                continue
            t = ev.self_cpu_time_total
        per[ev.name][0] += t / 1e3 / reps
        per[ev.name][1] += 1 if device.type == "cuda" or not ev.cpu_children else 0
    total = sum(v[0] for v in per.values())
    launches = sum(v[1] for v in per.values()) / reps
    top = sorted(((k, v[0], v[1] / reps) for k, v in per.items()), key=lambda r: -r[1])
    return total, launches, top


def graph_ms(fn, device: torch.device, reps: int) -> tuple[float | None, str | None]:
    """Median replay time of `fn` captured in a CUDA graph, or (None, why not)."""
    if device.type != "cuda":
        return None, "CUDA graphs need a CUDA device"
    try:
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                fn()
        torch.cuda.current_stream(device).wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        med, _ = time_call(g.replay, device, reps)
        return med, None
    except Exception as e:                      # noqa: BLE001 - a call that cannot be captured is reported
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def build_parser() -> Parser:
    ap = Parser(description="where the time of one model call goes: host issue, kernels, launches, CUDA-graph replay")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    ap.add_argument("--dtype", choices=DTYPE_CHOICES, default=None, help="default bfloat16 on CUDA, float32 on CPU")
    ap.add_argument("--device", default=None, help="default cuda when available, else cpu")
    ap.add_argument("--cache", choices=sorted(CACHE_MODES), default="dual")
    ap.add_argument("--prefix", type=int, default=512, help="cached prompt positions")
    ap.add_argument("--block-length", type=int, default=32)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16], help="draft blocks in the call")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--top", type=int, default=8, help="kernels listed")
    ap.add_argument("--card", default="h200", help="the card whose roofline is printed beside (bench.simulate)")
    add_threads_flag(ap, THREADS_HELP)
    return ap


def main(argv=None) -> int:
    return guarded(_run, build_parser().parse_args(argv))


def _run(args) -> int:
    for name in ("prefix", "block_length", "reps", "top"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if min(args.rows) < 1:
        raise InputError(f"--rows must be >= 1, got {min(args.rows)}")
    card = CARDS[card_key(args.card)]
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError("--device cuda: no CUDA device is visible")
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    bench_threads(args.threads)
    mc = shape_config(args.shape)
    model = build_random(mc, device, dtype)
    mode = call_mode(model, args.cache)        # a uniform-noise model (DiffusionGemma): its decoder call
    S, L = args.prefix, args.block_length
    uniform = mc.mask_token_id is None
    if uniform:                                 # canvases of its length over its encoder's cache
        args.cache, L = "encoder", mc.generation_defaults["block_length"]
    block = cached_block(mode, mc, 1, S, L, 0, device)
    rows, tops = [], {}
    for R in args.rows:
        call = verification_call(mode, mc, block, torch.zeros(R, dtype=torch.long, device=device),
                                 torch.Generator().manual_seed(R))
        event, _ = time_call(call, device, args.reps)
        host = host_ms(call, device, args.reps)
        kern, launches, top = kernel_profile(call, device, min(args.reps, 5))
        graphed, why = graph_ms(call, device, args.reps)
        cached = S if args.cache != "none" else 0
        shape = Call(R, L, S, R, L, self_cond=True) if uniform else \
            Call(R, L if args.cache != "none" else S + L, cached, 1 if cached else 0, L)
        roof = call_ms(mc, shape, card, elem=torch.finfo(dtype).bits // 8, overhead_ms=0.0)
        rows.append(dict(rows=R, event_ms=event, host_ms=host, kernel_ms=kern, launches=launches,
                         graph_ms=graphed, graph_error=why, roofline_ms=roof))
        tops[R] = top[:args.top]
    _print(args, rows, tops, S, L, dtype, device, card)
    return 0


def _print(args, rows: list[dict], tops: dict, S: int, L: int, dtype, device, card) -> None:
    """The table per row count, the kernels that took the time, and one JSON line."""
    head = (f"one model call: shape {args.shape}, {args.cache} cache, prefix {S}, block {L}, {dtype}, "
            f"device {device_name(device)}, torch {versions()['torch']}, triton {versions()['triton']}; "
            f"roofline: {card.label} ({card.hbm_gbps:g} GB/s, {card.bf16_tflops:g} TFLOP/s), no overhead")
    print(head, "\n")
    print("| rows | event ms | host ms | kernel ms | launches | graph ms | roofline ms |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        g = f"{r['graph_ms']:.3f}" if r["graph_ms"] is not None else "-"
        print(f"| {r['rows']} | {r['event_ms']:.3f} | {r['host_ms']:.3f} | {r['kernel_ms']:.3f} | "
              f"{r['launches']:.0f} | {g} | {r['roofline_ms']:.3f} |")
    for r in rows:
        if r["graph_error"]:
            print(f"\ngraph ({r['rows']} rows): not captured: {r['graph_error']}")
    for R, top in tops.items():
        print(f"\nkernels by device time, {R} rows (ms per call, launches per call):")
        for name, ms, n in top:
            print(f"  {ms:8.3f}  {n:5.0f}  {name[:110]}")
    print(json.dumps({"bench": "profile_call", "shape": args.shape, "cache": args.cache, "prefix": S, "block": L,
                      "dtype": str(dtype).removeprefix("torch."), "device": device_name(device), **versions(),
                      "card": card.label, "rows": rows}))


if __name__ == "__main__":
    raise SystemExit(main())
