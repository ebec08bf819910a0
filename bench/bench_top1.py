"""Microbenchmark: top-1 token + confidence over the vocabulary, torch reference vs Triton.

    python -m bench.bench_top1                      # small CPU defaults, seconds
    python -m bench.bench_top1 --rows 32 256 1024 --vocab 126464 151936 --dtype bfloat16
    pytest bench/bench_top1.py --benchmark-only     # pytest-benchmark view of the same cases

The kernel is bandwidth-bound: it reads the logits once. GB/s counts the bytes a single pass
must move (logits, plus noise when sampling, plus 12 B of output per row) for both providers,
so the torch number is an *effective* bandwidth; ``peak_frac`` divides by the measured
device-to-device copy bandwidth. Results: bench/results/bench_top1_<device>.csv.
"""
from __future__ import annotations

import argparse

import pytest
import torch

from psd_kernels import reference

from ._common import (bench_threads, copy_bandwidth_gbps, default_device, print_table, sync, time_ms,
                      triton_usable, write_csv)

MASK_ID = 126336  # LLaDA's mask token: excluded like the engine does
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def providers(device: torch.device) -> dict:
    out = {"torch": reference.top1}
    if triton_usable(device):
        from psd_kernels.ops.top1 import top1 as triton_top1

        out["triton"] = triton_top1
    return out


def make_case(rows: int, V: int, dtype: torch.dtype, device: torch.device, sample: bool):
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (torch.randn(rows, V, generator=gen, device=device) * 3).to(dtype)
    noise = -torch.empty(rows, V, device=device).exponential_(generator=gen).log() if sample else None
    return logits, noise


def useful_bytes(rows: int, V: int, dtype: torch.dtype, sample: bool) -> int:
    elt = torch.empty((), dtype=dtype).element_size()
    return rows * V * elt + (rows * V * 4 if sample else 0) + rows * (8 + 4)


def run(rows_list, vocab_list, dtypes, scores, sample: bool, device: torch.device) -> list[dict]:
    peak = copy_bandwidth_gbps(device)
    results = []
    for rows in rows_list:
        for V in vocab_list:
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                logits, noise = make_case(rows, V, dtype, device, sample)
                exclude = min(MASK_ID, V - 1)
                for score in scores:
                    kw = dict(score=score, temperature=0.7 if sample else 0.0, noise=noise)
                    for name, fn in providers(device).items():
                        ms = time_ms(lambda: fn(logits, exclude, **kw), device)
                        gbps = useful_bytes(rows, V, dtype, sample) / (ms * 1e-3) / 1e9
                        results.append(dict(bench="top1", provider=name, rows=rows, vocab=V, dtype=dtype_name,
                                            score=score, sample=sample, ms=ms, gbps=gbps, peak_gbps=peak,
                                            peak_frac=gbps / peak))
    return results


def main(argv=None) -> None:
    device = default_device()
    gpu = device.type == "cuda"
    ap = argparse.ArgumentParser(description="top-1 over the vocabulary: torch vs triton")
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 256, 1024] if gpu else [32])
    ap.add_argument("--vocab", type=int, nargs="+", default=[32000, 126464, 151936] if gpu else [32000, 126464])
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bfloat16", "float32"])
    ap.add_argument("--score", nargs="+", choices=list(reference.SCORES), default=["prob"])
    ap.add_argument("--sample", action="store_true", help="temperature 0.7 with Gumbel noise")
    args = ap.parse_args(argv)
    bench_threads()
    rows = run(args.rows, args.vocab, args.dtype, args.score, args.sample, device)
    print_table(rows, ["provider", "rows", "vocab", "dtype", "score", "ms", "gbps", "peak_frac"])
    print(f"wrote {write_csv('bench_top1', rows, device)}")


# ---------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("vocab", [32000, 126464])
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_top1(benchmark, provider, vocab):
    bench_threads()
    device = default_device()
    fns = providers(device)
    if provider not in fns:
        pytest.skip("triton is timed on CUDA only")
    logits, _ = make_case(32, vocab, torch.bfloat16, device, sample=False)
    fn = fns[provider]
    exclude = min(MASK_ID, vocab - 1)
    ids, _ = benchmark(lambda: (fn(logits, exclude), sync(device))[0])
    assert torch.equal(ids.cpu(), reference.top1(logits.cpu(), exclude)[0])


if __name__ == "__main__":
    main()
