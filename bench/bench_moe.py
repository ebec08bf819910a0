"""Microbenchmark: the routed experts of an MoE layer, grouped torch reference vs dense loop vs Triton.

    python -m bench.bench_moe --quick                 # tiny, seconds on a CPU (CI, --dry report)
    python -m bench.bench_moe                         # CPU defaults: a small MoE, 1 and 64 tokens
    python -m bench.bench_moe --shape llada2-mini --tokens 1 32 256 2048 --dtype bfloat16
    python -m bench.bench_moe --hidden 2048 --inter 512 --experts 256 --topk 8 --tokens 64
    pytest bench/bench_moe.py --benchmark-only        # pytest-benchmark view of the same cases

Providers:
  torch    psd_kernels.reference.moe, the CPU path: slots sorted by expert, three matmuls per
           expert that got slots (fp32 math), one host read of the group sizes
  dense    every expert on every token, weighted by its routing weight (0 where not chosen):
           E/k times the work, no grouping, no host read; the baseline a grouped kernel replaces
  triton   psd_kernels.ops.moe (CUDA only: interpreter timings mean nothing)

Work counted for every provider: FLOPs 6·T·k·H·I (three projections of the routed slots);
bytes the weights of the experts the routing uses (3·I·H each, read once) plus x and out.
``tflops`` and ``gbps`` are those over the time, so the torch and dense numbers are *effective*
rates. ``hbm_frac`` divides gbps by the card's nominal HBM bandwidth, ``tc_frac`` tflops by its
dense 16-bit tensor-core peak (a table of known cards; fp32 inputs are compared with the same
number, which they cannot reach), ``roof_frac`` the roofline time max(bytes / HBM, FLOPs /
peak) by the measured time: 1.0 is the card's limit for this shape. On CPU ``peak_frac`` uses
the measured copy bandwidth. ``max_err``: largest |out − reference| (same inputs).
Results: CSV with the device name and versions (runs/bench/bench_moe_<device>.csv, or PSD_BENCH_RESULTS).
"""
from __future__ import annotations

from bench.pytest_view import pytest
import torch
import torch.nn.functional as F

from engine.frontend import Parser
from psd_kernels import reference

from . import _common
from ._common import bench_threads, copy_bandwidth_gbps, default_device, print_table, sync, triton_usable
from .bench_sparse_attn import time_interleaved
from .bench_top1 import hbm_gbps

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# (hidden H, expert intermediate I, experts E, experts per token k): LLaDA2.0's routed experts
SHAPES = {"llada2-mini": (2048, 512, 256, 8), "llada2-flash": (4096, 1024, 256, 8),
          "small": (512, 128, 32, 4), "tiny": (64, 32, 8, 2)}
# dense 16-bit tensor-core TFLOP/s (no sparsity) of known cards
KNOWN_TC_TFLOPS = {"H200": 989, "H100 SXM": 989, "H100 80GB HBM3": 989, "H100 PCIe": 756, "H100 NVL": 835,
                   "A100": 312, "L40S": 362, "L4": 121, "A10": 125, "RTX 4090": 165}


def tc_tflops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_properties(device).name
    return next((v for k, v in KNOWN_TC_TFLOPS.items() if k in name), None)


def dense_moe(x, w_gate, w_up, w_down, topk_ids, topk_weights, out=None):
    """Every expert on every token: out = Σ_e c[:, e] · mlp_e(x), c[t, e] the summed weight of the
    slots of token t that chose e (0 for the others). Same math as the reference, E/k times the work."""
    T, H = x.shape
    E = w_gate.shape[0]
    acc = torch.float32 if x.dtype != torch.float64 else torch.float64
    coef = torch.zeros(T, E, dtype=acc, device=x.device).scatter_add_(1, topk_ids, topk_weights.to(acc))
    xa = x.to(acc)
    y = torch.zeros(T, H, dtype=acc, device=x.device)
    for e in range(E):
        h = F.silu(xa @ w_gate[e].to(acc).T) * (xa @ w_up[e].to(acc).T)
        y.addcmul_(h @ w_down[e].to(acc).T, coef[:, e:e + 1])
    return y.to(x.dtype)


def providers(device: torch.device, names=("torch", "dense", "triton")) -> dict:
    out = {}
    if "torch" in names:
        out["torch"] = reference.moe
    if "dense" in names:
        out["dense"] = dense_moe
    if "triton" in names and triton_usable(device):
        from psd_kernels.ops.moe import moe as triton_moe

        out["triton"] = triton_moe
    return out


def make_case(T: int, H: int, I: int, E: int, k: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    """x, weights (fan-in scaled) and a top-k routing from random router scores (distinct experts)."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*shape, fan_in):
        return (torch.randn(shape, generator=gen, device=device) / fan_in ** 0.5).to(dtype)

    x = torch.randn(T, H, generator=gen, device=device).to(dtype)
    ws = (r(E, I, H, fan_in=H), r(E, I, H, fan_in=H), r(E, H, I, fan_in=I))
    scores = torch.rand(T, E, generator=gen, device=device)
    w, ids = scores.topk(k, dim=-1)
    return x, ws, ids, w / w.sum(-1, keepdim=True)


def work(T: int, H: int, I: int, k: int, used_experts: int, dtype: torch.dtype) -> tuple[int, int]:
    """(FLOPs, bytes) one call must do and move: the routed slots' three projections; the used
    experts' weights read once, x read once, out written once."""
    elt = torch.empty((), dtype=dtype).element_size()
    return 6 * T * k * H * I, (3 * I * H * used_experts + 2 * T * H) * elt


def run(tokens, shape: tuple[int, int, int, int], dtypes, device: torch.device, repeats: int = 7,
        rep_ms: float = 100.0, names=("torch", "dense", "triton")) -> list[dict]:
    H, I, E, k = shape
    gpu = device.type == "cuda"
    peak = copy_bandwidth_gbps(device)
    hbm, tc = hbm_gbps(device), tc_tflops(device)
    results = []
    for dtype_name in dtypes:
        dtype = DTYPES[dtype_name]
        for T in tokens:
            x, ws, ids, w = make_case(T, H, I, E, k, dtype, device)
            used = int(torch.unique(ids).numel())
            flops, nbytes = work(T, H, I, k, used, dtype)
            roof_ms = max(nbytes / (hbm * 1e9), flops / (tc * 1e12)) * 1e3 if hbm and tc else None
            fns = {n: (lambda fn=fn: fn(x, *ws, ids, w)) for n, fn in providers(device, names).items()}
            want = reference.moe(x, *ws, ids, w).float()
            err = {n: float((f().float() - want).abs().max()) for n, f in fns.items()}
            for name, (ms, ms_min) in time_interleaved(fns, device, repeats, rep_ms).items():
                gbps, tflops = nbytes / (ms * 1e-3) / 1e9, flops / (ms * 1e-3) / 1e12
                results.append(dict(bench="moe", provider=name, tokens=T, hidden=H, inter=I, experts=E, topk=k,
                                    used_experts=used, dtype=dtype_name, ms=ms, ms_min=ms_min, tflops=tflops,
                                    gbps=gbps, peak_gbps=peak, peak_frac=gbps / peak, hbm_gbps=hbm,
                                    hbm_frac=gbps / hbm if hbm else None, tc_tflops=tc,
                                    tc_frac=tflops / tc if tc else None,
                                    roof_frac=roof_ms / ms if roof_ms else None, max_err=err[name],
                                    mem_mb=_common.peak_memory_mb(fns[name], device) if gpu else None))
    return results


def main(argv=None) -> int:
    device = default_device()
    gpu = device.type == "cuda"
    ap = Parser(description="MoE routed experts: grouped torch vs dense loop vs triton")
    ap.add_argument("--quick", action="store_true", help="the tiny shape, 1 and 5 tokens: seconds on a CPU")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="(H, I, E, k) preset; default llada2-mini on CUDA, small on CPU")
    ap.add_argument("--hidden", type=int, help="override H")
    ap.add_argument("--inter", type=int, help="override I (each expert's intermediate size)")
    ap.add_argument("--experts", type=int, help="override E")
    ap.add_argument("--topk", type=int, help="override k")
    ap.add_argument("--tokens", type=int, nargs="+", default=None)
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=None)
    ap.add_argument("--providers", nargs="+", choices=("torch", "dense", "triton"),
                    default=["torch", "dense", "triton"])
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds on CPU")
    args = ap.parse_args(argv)
    q = args.quick
    H, I, E, k = SHAPES[args.shape or ("tiny" if q else "llada2-mini" if gpu else "small")]
    H, I, E, k = (args.hidden or H, args.inter or I, args.experts or E, args.topk or k)
    if not 1 <= k <= E:
        ap.error(f"--topk {k} must be in 1..{E} (the experts)")
    tokens = args.tokens or ([1, 5] if q else [1, 32, 256, 2048] if gpu else [1, 64])
    dtypes = args.dtype or (["float32"] if q else ["bfloat16"] if gpu else ["float32", "bfloat16"])
    bench_threads()
    rows = run(tokens, (H, I, E, k), dtypes, device, args.repeats or (3 if q else 7), 25.0 if q else 100.0,
               tuple(args.providers))
    print_table(rows, ["provider", "tokens", "used_experts", "dtype", "ms", "ms_min", "tflops", "gbps", "peak_frac",
                       "hbm_frac", "tc_frac", "roof_frac", "max_err"])
    print(f"shape: hidden {H}, inter {I}, experts {E}, top-{k}")
    print(f"device: {_common.device_name(device)}")
    print(f"wrote {_common.write_csv('bench_moe', rows, device)}")
    return 0


# ---------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("tokens", [1, 64])
@pytest.mark.parametrize("provider", ["torch", "dense", "triton"])
def test_moe(benchmark, provider, tokens):
    bench_threads()
    device = default_device()
    fns = providers(device)
    if provider not in fns:
        pytest.skip("triton is timed on CUDA only")
    H, I, E, k = SHAPES["llada2-mini" if device.type == "cuda" else "small"]
    x, ws, ids, w = make_case(tokens, H, I, E, k, torch.bfloat16, device)
    fn = fns[provider]
    y = benchmark(lambda: (fn(x, *ws, ids, w), sync(device))[0])
    torch.testing.assert_close(y.float(), reference.moe(x, *ws, ids, w).float(), rtol=2e-2, atol=2e-2)


if __name__ == "__main__":
    raise SystemExit(main())
