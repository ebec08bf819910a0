"""Microbenchmark: attention of K draft blocks over one shared KV cache.

    python -m bench.bench_sparse_attn               # small CPU defaults, seconds
    python -m bench.bench_sparse_attn --drafts 4 8 16 --shared 1024 4096 16384 --heads 32 --kv-heads 8
    pytest bench/bench_sparse_attn.py --benchmark-only

Providers:
  torch       psd_kernels.reference: shared part as one [Hkv, K·G·L, S] matmul, own part per
              draft, merged by log-sum-exp (never copies the cache)
  dense_mask  SDPA over [shared | all K own blocks] keys with a materialised block mask
              (the K·L×(S+K·L) mask is prebuilt; the key concatenation is timed: the own keys
              change every call)
  replicated  SDPA per draft over a K-fold copy of the cache (the copy is timed)
  triton      the block-sparse kernel
TFLOP/s counts the useful work 4·K·H·L·(S+L)·D for every provider (masked-out work of
dense_mask is not credited). ``mem_mb``: extra device memory at the call's peak (CUDA).
Results: bench/results/bench_sparse_attn_<device>.csv.
"""
from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F

from psd_kernels import reference

from ._common import bench_threads, default_device, peak_memory_mb, print_table, sync, time_ms, triton_usable, write_csv

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def make_case(K, H, Hkv, L, S, D, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)

    def r(*shape):
        return torch.randn(shape, generator=gen, device=device).to(dtype)

    return r(K, H, L, D), r(Hkv, S, D), r(Hkv, S, D), r(K, Hkv, L, D), r(K, Hkv, L, D)


def dense_mask_provider(q, ks, vs, ko, vo):
    K, H, L, D = q.shape
    Hkv, S, _ = ks.shape
    draft = torch.arange(K, device=q.device).repeat_interleave(L)
    mask = torch.cat([torch.ones(K * L, S, dtype=torch.bool, device=q.device), draft[:, None] == draft[None, :]], 1)
    queries = q.permute(1, 0, 2, 3).reshape(H, K * L, D)

    def fn():
        keys = torch.cat([ks, ko.permute(1, 0, 2, 3).reshape(Hkv, K * L, D)], 1)  # [Hkv, S+K*L, D]
        vals = torch.cat([vs, vo.permute(1, 0, 2, 3).reshape(Hkv, K * L, D)], 1)
        out = F.scaled_dot_product_attention(queries[None], keys[None], vals[None], attn_mask=mask,
                                             enable_gqa=H != Hkv)
        return out[0].view(H, K, L, D).transpose(0, 1)  # rows (draft, position) back to [K, H, L, D]

    return fn


def replicated_provider(q, ks, vs, ko, vo):
    K, H = q.shape[:2]
    Hkv = ks.shape[0]

    def fn():
        keys = torch.cat([ks[None].expand(K, -1, -1, -1), ko], 2)  # [K, Hkv, S+L, D]: K copies of the cache
        vals = torch.cat([vs[None].expand(K, -1, -1, -1), vo], 2)
        return F.scaled_dot_product_attention(q, keys, vals, enable_gqa=H != Hkv)

    return fn


def providers(case, device) -> dict:
    out = {
        "torch": lambda: reference.shared_prefix_attention(*case),
        "dense_mask": dense_mask_provider(*case),
        "replicated": replicated_provider(*case),
    }
    if triton_usable(device):
        from psd_kernels.ops.sparse_attn import shared_prefix_attention

        out["triton"] = lambda: shared_prefix_attention(*case)
    return out


def flops(K, H, L, S, D) -> float:
    return 4.0 * K * H * L * (S + L) * D


def run(drafts, shared, H, Hkv, L, D, dtype_name, device) -> list[dict]:
    dtype = DTYPES[dtype_name]
    results = []
    for K in drafts:
        for S in shared:
            case = make_case(K, H, Hkv, L, S, D, dtype, device)
            want = reference.shared_prefix_attention(*case)[0].float()
            for name, fn in providers(case, device).items():
                got = fn()
                got = (got[0] if isinstance(got, tuple) else got).float()
                err = (got - want).abs().max().item()  # every provider computes the same attention
                mem = peak_memory_mb(fn, device)
                ms = time_ms(fn, device)
                results.append(dict(bench="shared_prefix_attention", provider=name, drafts=K, heads=H, kv_heads=Hkv,
                                    block=L, shared=S, head_dim=D, dtype=dtype_name, ms=ms,
                                    tflops=flops(K, H, L, S, D) / (ms * 1e-3) / 1e12, mem_mb=mem, max_err=err))
    return results


def main(argv=None) -> None:
    device = default_device()
    gpu = device.type == "cuda"
    ap = argparse.ArgumentParser(description="shared-prefix attention of K drafts: torch / SDPA variants / triton")
    ap.add_argument("--drafts", type=int, nargs="+", default=[4, 8, 16] if gpu else [4, 8])
    ap.add_argument("--shared", type=int, nargs="+", default=[1024, 4096, 16384] if gpu else [256, 1024])
    ap.add_argument("--heads", type=int, default=32 if gpu else 8)
    ap.add_argument("--kv-heads", type=int, default=8 if gpu else 2)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128 if gpu else 64)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16" if gpu else "float32")
    args = ap.parse_args(argv)
    if args.heads % args.kv_heads:
        ap.error("--heads must be a multiple of --kv-heads")
    bench_threads()
    rows = run(args.drafts, args.shared, args.heads, args.kv_heads, args.block, args.head_dim, args.dtype, device)
    print_table(rows, ["provider", "drafts", "shared", "heads", "kv_heads", "ms", "tflops", "mem_mb", "max_err"])
    print(f"wrote {write_csv('bench_sparse_attn', rows, device)}")


# ---------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("provider", ["torch", "dense_mask", "replicated", "triton"])
def test_shared_prefix_attention(benchmark, provider):
    bench_threads()
    device = default_device()
    gpu = device.type == "cuda"
    case = make_case(8, 8, 2, 32, 1024, 64, torch.bfloat16 if gpu else torch.float32, device)
    fns = providers(case, device)
    if provider not in fns:
        pytest.skip("triton is timed on CUDA only")
    got = benchmark(lambda: (fns[provider](), sync(device))[0])
    got = got[0] if isinstance(got, tuple) else got
    want = reference.shared_prefix_attention(*case)[0]
    tol = 2e-2 if gpu else 1e-4
    assert math.isclose((got.float() - want.float()).abs().max().item(), 0.0, abs_tol=tol)


if __name__ == "__main__":
    main()
