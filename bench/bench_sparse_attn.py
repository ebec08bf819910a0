"""Microbenchmark: attention of K draft blocks per sequence over shared KV cache rows.

    python -m bench.bench_sparse_attn --quick                 # tiny shapes, seconds on a CPU (CI, --dry report)
    python -m bench.bench_sparse_attn --shape llada-8b dream-7b --drafts 1 2 4 8 16 --shared 512 1024 4096
    python -m bench.bench_sparse_attn --shape shipped small --drafts 16 --shared 256 1024 --dtype bfloat16 --repeats 9
    python -m bench.bench_sparse_attn --drafts 4 --shared 1024 --heads 32 --kv-heads 8 --head-dim 128 --seqs 4
    pytest bench/bench_sparse_attn.py --benchmark-only

Every provider computes the same attention: R = seqs·K query rows (L positions each), row r
sees all S keys of its sequence's cache row and its own L keys, never another draft's.
Providers:
  reference   psd_kernels.reference.shared_prefix_attention, the CPU path: on CPU one fused SDPA
              call (flash kernel, returns the lse) for the shared part over ONE copy of each
              cache row, one for the own part, merged by log-sum-exp; off CPU a matmul fallback
  reference_matmul  the same reference with its off-CPU fallback forced: materialised fp32
              score matrices (matmul, logsumexp, exp, matmul), the formulation the CPU path used
              before (its cost also depends on the data: large scores make exp slower)
  replicated  SDPA over [cache row | own block] per row: the cache row is copied per draft
              (expand + cat: the K-fold copy is timed, it is what a batch of K rows costs)
  dense_mask  SDPA per sequence over [shared | all K own blocks] keys with a prebuilt block mask
              (the key concatenation is timed: the own keys change every call)
  flex        torch.nn.attention.flex_attention, compiled, with a block mask over the same
              [shared | own blocks] layout (CUDA only: skipped elsewhere, with the reason)
  triton      the block-sparse kernel: one launch for every row and cache row (CUDA only)
TFLOP/s counts the useful work 4·R·H·L·(S+L)·D for every provider (masked-out work is not
credited). ``mem_mb``: extra device memory at the call's peak (CUDA). ``max_err``: largest
difference from the reference output.

Timing: on CUDA ``triton.testing.do_bench`` per provider (median); on CPU the providers are
timed in interleaved repeats (one call of each per round, the order rotated every round) and
``ms`` is the median, ``ms_min`` the minimum, so a loaded machine slows every provider alike.
Results: CSV with the device name and torch/triton versions (runs/bench/bench_sparse_attn_<device>.csv under
the current directory, or PSD_BENCH_RESULTS).
"""
from __future__ import annotations

import itertools
import math
import statistics
import time

from bench.pytest_view import pytest
import torch
import torch.nn.functional as F

from engine.frontend import Parser, add_threads_flag
from psd_kernels import reference

from . import _common
from ._common import THREADS_HELP, bench_threads, default_device, peak_memory_mb, print_table, sync, triton_usable

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# attention head shapes: (heads, kv heads, head dim)
SHAPES = {
    "llada-8b": (32, 32, 128),      # GSAI-ML/LLaDA-8B-Instruct
    "dream-7b": (28, 4, 128),       # Dream-org/Dream-v0-Instruct-7B (Qwen2.5-7B)
    "shipped": (8, 8, 32),          # models/default
    "small": (12, 12, 64),          # bench.speed --shape small (134M)
    "tiny": (4, 2, 16),             # --quick
}
PROVIDERS = ("reference", "reference_matmul", "replicated", "dense_mask", "flex", "triton")


def make_case(seqs, K, H, Hkv, L, S, D, dtype, device, seed=0):
    """(q, k_cache, v_cache, k_own, v_own, row_map, key_mask) for `seqs` sequences of K drafts."""
    gen = torch.Generator(device=device).manual_seed(seed)
    R = seqs * K

    def r(*shape):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    row_map = torch.arange(seqs, device=device).repeat_interleave(K)
    key_mask = torch.ones(seqs, S, dtype=torch.bool, device=device)
    key_mask[:, : S // 16] = False          # some left padding, as the engine's caches have
    return r(R, H, L, D), r(seqs, Hkv, S, D), r(seqs, Hkv, S, D), r(R, Hkv, L, D), r(R, Hkv, L, D), row_map, key_mask


def reference_provider(q, kc, vc, ko, vo, row_map, km):
    plan = reference.plan_rows(row_map, kc.shape[0])   # once per model call in the engine, not per layer

    def fn():
        return reference.shared_prefix_attention(q, kc, vc, ko, vo, shared_mask=km, row_map=plan)[0]

    return fn


def reference_matmul_provider(q, kc, vc, ko, vo, row_map, km):
    plan = reference.plan_rows(row_map, kc.shape[0])

    def fn():
        flash, reference.USE_FLASH_CPU = reference.USE_FLASH_CPU, False
        try:
            return reference.shared_prefix_attention(q, kc, vc, ko, vo, shared_mask=km, row_map=plan)[0]
        finally:
            reference.USE_FLASH_CPU = flash

    return fn


def triton_provider(q, kc, vc, ko, vo, row_map, km):
    from psd_kernels.ops.sparse_attn import shared_prefix_attention

    plan = reference.plan_rows(row_map, kc.shape[0], padded=False)

    def fn():
        return shared_prefix_attention(q, kc, vc, ko, vo, shared_mask=km, row_map=plan)[0]

    return fn


def replicated_provider(q, kc, vc, ko, vo, row_map, km):
    R, H, L, _ = q.shape
    Hkv, S = kc.shape[1], kc.shape[2]
    mask = torch.cat([km[row_map][:, None, None, :].expand(R, 1, L, S),
                      torch.ones(R, 1, L, L, dtype=torch.bool, device=q.device)], -1)

    def fn():
        keys = torch.cat([kc[row_map], ko], 2)          # [R, Hkv, S+L, D]: a copy of the cache row per draft
        vals = torch.cat([vc[row_map], vo], 2)
        return F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, enable_gqa=H != Hkv)

    return fn


def _block_layout(q, ko, vo, row_map, seqs):
    """Per sequence: queries [seqs, H, K·L, D], own keys [seqs, Hkv, K·L, D] (rows grouped)."""
    R, H, L, D = q.shape
    K = R // seqs
    Hkv = ko.shape[1]
    qs = q.view(seqs, K, H, L, D).transpose(1, 2).reshape(seqs, H, K * L, D)
    own_k = ko.view(seqs, K, Hkv, L, D).transpose(1, 2).reshape(seqs, Hkv, K * L, D)
    own_v = vo.view(seqs, K, Hkv, L, D).transpose(1, 2).reshape(seqs, Hkv, K * L, D)
    return qs, own_k, own_v, K


def dense_mask_provider(q, kc, vc, ko, vo, row_map, km):
    seqs, Hkv, S, D = kc.shape
    R, H, L, _ = q.shape
    qs, own_k, own_v, K = _block_layout(q, ko, vo, row_map, seqs)
    draft = torch.arange(K, device=q.device).repeat_interleave(L)
    own = draft[:, None] == draft[None, :]
    mask = torch.cat([km[:, None, None, :].expand(seqs, 1, K * L, S), own.expand(seqs, 1, K * L, K * L)], -1)

    def fn():
        keys = torch.cat([kc, own_k], 2)        # [seqs, Hkv, S+K·L, D]
        vals = torch.cat([vc, own_v], 2)
        out = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, enable_gqa=H != Hkv)
        return out.view(seqs, H, K, L, D).transpose(1, 2).reshape(R, H, L, D)

    return fn


_FLEX = {}


def flex_unavailable(device) -> str | None:
    if device.type != "cuda":
        return "FlexAttention runs compiled on CUDA only here"
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention  # noqa: F401
    except ImportError as e:
        return f"no torch.nn.attention.flex_attention ({e})"
    return None


def flex_provider(q, kc, vc, ko, vo, row_map, km):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if "fn" not in _FLEX:
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    seqs, Hkv, S, D = kc.shape
    R, H, L, _ = q.shape
    qs, own_k, own_v, K = _block_layout(q, ko, vo, row_map, seqs)

    def visible(b, h, q_idx, kv_idx):
        own = (kv_idx >= S) & ((kv_idx - S) // L == q_idx // L)
        return own | ((kv_idx < S) & km[b, kv_idx.clamp(max=S - 1)])

    block_mask = create_block_mask(visible, seqs, None, K * L, S + K * L, device=q.device)

    def fn():
        keys = torch.cat([kc, own_k], 2)
        vals = torch.cat([vc, own_v], 2)
        out = _FLEX["fn"](qs, keys, vals, block_mask=block_mask, enable_gqa=H != Hkv)
        return out.view(seqs, H, K, L, D).transpose(1, 2).reshape(R, H, L, D)

    return fn


def providers(case, device, names=PROVIDERS) -> tuple[dict, dict]:
    """({name: fn}, {name: reason it is skipped})."""
    made, skipped = {}, {}
    for name in names:
        if name == "triton" and not triton_usable(device):
            skipped[name] = "the Triton kernel is timed compiled on CUDA only"
        elif name == "flex" and flex_unavailable(device):
            skipped[name] = flex_unavailable(device)
        elif name == "reference_matmul" and device.type != "cpu":
            skipped[name] = "off CPU the reference already runs this fallback"
        else:
            try:
                made[name] = globals()[f"{name}_provider"](*case)
            except Exception as e:        # noqa: BLE001  (a provider that cannot run here is reported, not fatal)
                skipped[name] = f"{type(e).__name__}: {e}"
    return made, skipped


def flops(R, H, L, S, D) -> float:
    return 4.0 * R * H * L * (S + L) * D


def time_interleaved(fns: dict, device, repeats: int, rep_ms: float) -> dict[str, tuple[float, float]]:
    """{name: (median ms, min ms)}; CPU: interleaved rounds, CUDA: do_bench per provider."""
    if device.type == "cuda":
        import triton.testing

        out = {}
        for n, f in fns.items():
            med, low = triton.testing.do_bench(f, warmup=10, rep=rep_ms, quantiles=[0.5, 0.0])
            out[n] = (float(med), float(low))
        return out
    names = list(fns)
    times = {n: [] for n in names}
    for n in names:         # warm-up: first-touch allocation, lazy init
        fns[n]()
    for rnd in range(repeats):
        order = names[rnd % len(names):] + names[:rnd % len(names)]
        for n in order:
            t0 = time.perf_counter()
            fns[n]()
            times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: (statistics.median(t), min(t)) for n, t in times.items()}


def run(shapes, drafts, shared, seqs, L, dtype_names, device, repeats, rep_ms=100.0, names=PROVIDERS,
        log=print, flex_budget_s=20.0, checkpoint=None) -> list[dict]:
    """Rows of results; `checkpoint(rows)` after every case (a killed run keeps what it measured).
    FlexAttention compiles once per shape: after `flex_budget_s` seconds spent on it, later
    cases skip it (and say so)."""
    results = []
    flex_spent = 0.0
    for dtype_name, (shape_name, (H, Hkv, D)), K, S in itertools.product(dtype_names, shapes, drafts, shared):
        dtype = DTYPES[dtype_name]
        case = make_case(seqs, K, H, Hkv, L, S, D, dtype, device)
        use = tuple(n for n in names if n != "flex" or flex_spent < flex_budget_s)
        if "flex" in names and "flex" not in use:
            log(f"skip flex ({shape_name}, K={K}, S={S}): its {flex_budget_s:.0f} s budget (compiles) is spent")
        t_made = time.perf_counter()
        fns, skipped = providers(case, device, use)
        if "flex" in fns:             # building the block mask
            flex_spent += time.perf_counter() - t_made
        for name, why in skipped.items():
            log(f"skip {name} ({shape_name}, K={K}, S={S}): {why}")
        want = reference_provider(*case)().float()
        errs, mems = {}, {}
        for name, fn in list(fns.items()):
            t0 = time.perf_counter()
            try:
                errs[name] = (fn().float() - want).abs().max().item()   # the same attention
                mems[name] = peak_memory_mb(fn, device)
            except Exception as e:    # noqa: BLE001
                log(f"skip {name} ({shape_name}, K={K}, S={S}): {type(e).__name__}: {e}")
                del fns[name]
            if name == "flex":          # the first call compiles
                flex_spent += time.perf_counter() - t0
        timed = time_interleaved(fns, device, repeats, rep_ms)
        R = seqs * K
        for name, (ms, ms_min) in timed.items():
            results.append(dict(bench="shared_prefix_attention", shape=shape_name, provider=name, seqs=seqs,
                                drafts=K, rows=R, heads=H, kv_heads=Hkv, block=L, shared=S, head_dim=D,
                                dtype=dtype_name, ms=ms, ms_min=ms_min,
                                tflops=flops(R, H, L, S, D) / (ms * 1e-3) / 1e12, mem_mb=mems.get(name),
                                max_err=errs.get(name), repeats=repeats if device.type == "cpu" else None))
        if checkpoint is not None:
            checkpoint(results)
    return results


def main(argv=None) -> int:
    device = default_device()
    gpu = device.type == "cuda"
    ap = Parser(description="shared-prefix attention of K drafts: reference / SDPA variants / "
                            "FlexAttention / triton")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, two drafts counts, one prefix: seconds on a CPU")
    ap.add_argument("--shape", nargs="+", choices=sorted(SHAPES),
                    help="head shapes by name (default: --heads/--kv-heads/--head-dim)")
    ap.add_argument("--drafts", type=int, nargs="+", default=None, help="K, drafts per sequence")
    ap.add_argument("--shared", "--prefix", type=int, nargs="+", default=None, help="S, cached keys per sequence")
    ap.add_argument("--seqs", type=int, default=1, help="sequences (cache rows) per call, K drafts each")
    ap.add_argument("--heads", type=int, default=None)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=None)
    ap.add_argument("--block", type=int, default=None, help="L, positions per draft block")
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=None)
    ap.add_argument("--providers", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds on CPU (median and min reported)")
    ap.add_argument("--flex-budget", type=float, default=20.0,
                    help="seconds FlexAttention may spend (it compiles per shape); later cases skip it")
    add_threads_flag(ap, THREADS_HELP)
    args = ap.parse_args(argv)
    q = args.quick
    drafts = args.drafts or ([1, 4] if q else [1, 2, 4, 8, 16] if gpu else [4, 16])
    shared = args.shared or ([64] if q else [512, 1024, 4096] if gpu else [256, 1024])
    block = args.block or (8 if q else 32)
    dtypes = args.dtype or (["float32"] if q else ["bfloat16"] if gpu else ["bfloat16", "float32"])
    repeats = args.repeats or (3 if q else 7)
    if args.shape:
        shapes = [(s, SHAPES[s]) for s in args.shape]
    elif args.heads or args.kv_heads or args.head_dim:
        H, D = args.heads or 8, args.head_dim or 64
        Hkv = args.kv_heads or H
        shapes = [(f"h{H}-kv{Hkv}-d{D}", (H, Hkv, D))]
    else:
        shapes = [(s, SHAPES[s]) for s in (["tiny"] if q else ["llada-8b", "dream-7b"] if gpu else ["shipped", "small"])]
    for name, (H, Hkv, D) in shapes:
        if Hkv < 1 or H % Hkv:
            ap.error(f"{name}: heads {H} must be a multiple of kv heads {Hkv}")
    bench_threads(args.threads)
    rows = run(shapes, drafts, shared, args.seqs, block, dtypes, device, repeats, 25.0 if q else 100.0,
               tuple(args.providers), flex_budget_s=args.flex_budget,
               checkpoint=lambda done: _common.write_csv("bench_sparse_attn", done, device))
    print_table(rows, ["shape", "dtype", "provider", "seqs", "drafts", "shared", "ms", "ms_min", "tflops", "mem_mb",
                       "max_err"])
    print(f"device: {_common.device_name(device)}")
    print(f"wrote {_common.write_csv('bench_sparse_attn', rows, device)}")
    return 0


# ---------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("provider", ["reference", "replicated", "dense_mask", "triton"])
def test_shared_prefix_attention(benchmark, provider):
    bench_threads()
    device = default_device()
    gpu = device.type == "cuda"
    case = make_case(1, 8, 8, 2, 32, 1024, 64, torch.bfloat16 if gpu else torch.float32, device)
    fns, skipped = providers(case, device, (provider,))
    if provider not in fns:
        pytest.skip(skipped[provider])
    got = benchmark(lambda: (fns[provider](), sync(device))[0])
    want = reference_provider(*case)()
    tol = 2e-2 if gpu else 1e-4
    assert math.isclose((got.float() - want.float()).abs().max().item(), 0.0, abs_tol=tol)


if __name__ == "__main__":
    raise SystemExit(main())
