"""Microbenchmark: top-1 token + confidence over the vocabulary, torch reference vs Triton.

    python -m bench.bench_top1 --quick                # tiny, seconds on a CPU (CI, --dry report)
    python -m bench.bench_top1                        # CPU defaults: 32k and 126k vocabularies
    python -m bench.bench_top1 --rows 32 256 1024 --vocab 126464 152064 --dtype bfloat16
    pytest bench/bench_top1.py --benchmark-only       # pytest-benchmark view of the same cases

Providers:
  torch    psd_kernels.reference.top1, the CPU path: one float copy (cast + mask column), max and
           argmax in one pass, log-softmax in place, one gather
  unfused  the textbook formulation it replaced (cast, clone, log-softmax into a new tensor,
           argmax, gather): three tensors of the logits' size written; bit-identical results
  triton   the one-pass kernel (CUDA only: interpreter timings mean nothing)

The kernel is bandwidth-bound: it reads the logits once. GB/s counts the bytes a single pass
must move (logits, plus noise when sampling, plus 12 B of output per row) for every provider,
so the torch numbers are *effective* bandwidths. ``peak_frac`` divides by the measured
device-to-device copy bandwidth, ``hbm_frac`` (CUDA) by the card's nominal HBM bandwidth
(memory clock x bus width from the device properties, else a table of known cards).
On CPU the providers are timed in interleaved rounds (``ms`` median, ``ms_min`` minimum).
Results: CSV with the device name and versions (runs/bench/bench_top1_<device>.csv under the current
directory, or PSD_BENCH_RESULTS).
"""
from __future__ import annotations

from bench.pytest_view import pytest
import torch

from engine.frontend import Parser, add_threads_flag
from psd_kernels import reference

from . import _common
from ._common import THREADS_HELP, bench_threads, copy_bandwidth_gbps, default_device, print_table, sync, triton_usable
from .bench_sparse_attn import time_interleaved

MASK_ID = 126336  # LLaDA's mask token: excluded like the engine does
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# nominal HBM bandwidth in GB/s when the device properties do not give clock and bus width
KNOWN_HBM = {"H200": 4800, "H100 SXM": 3350, "H100 80GB HBM3": 3350, "H100 PCIe": 2000, "H100 NVL": 3900,
             "A100-SXM4-80GB": 2039, "A100 80GB PCIe": 1935, "A100-SXM4-40GB": 1555, "A100-PCIE-40GB": 1555,
             "L40S": 864, "L4": 300, "A10": 600, "RTX 4090": 1008}


def unfused_top1(logits, exclude_id=None, *, score="prob", temperature=0.0, noise=None):
    """The formulation the reference used before (prob score): bit-identical, more passes."""
    x = logits.to(torch.float32)
    if exclude_id is not None:
        x = x.clone()
        x[..., exclude_id] = float("-inf")
    logp = torch.log_softmax(x, dim=-1)
    ids = torch.argmax(x / temperature + noise.float(), -1) if temperature > 0 else torch.argmax(x, dim=-1)
    return ids, logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1).exp()


def hbm_gbps(device: torch.device) -> float | None:
    """The card's nominal memory bandwidth (None off CUDA or when unknown)."""
    if device.type != "cuda":
        return None
    p = torch.cuda.get_device_properties(device)
    clock, bus = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)   # kHz, bits
    if clock and bus:
        return 2 * clock * 1e3 * bus / 8 / 1e9
    return next((v for k, v in KNOWN_HBM.items() if k in p.name), None)


def providers(device: torch.device, names=("torch", "unfused", "triton")) -> dict:
    out = {}
    if "torch" in names:
        out["torch"] = reference.top1
    if "unfused" in names:
        out["unfused"] = unfused_top1
    if "triton" in names and triton_usable(device):
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


def run(rows_list, vocab_list, dtypes, scores, sample: bool, device: torch.device, repeats: int = 7,
        rep_ms: float = 100.0, names=("torch", "unfused", "triton")) -> list[dict]:
    peak = copy_bandwidth_gbps(device)
    hbm = hbm_gbps(device)
    results = []
    for rows in rows_list:
        for V in vocab_list:
            for dtype_name in dtypes:
                dtype = DTYPES[dtype_name]
                logits, noise = make_case(rows, V, dtype, device, sample)
                exclude = min(MASK_ID, V - 1)
                for score in scores:
                    kw = dict(score=score, temperature=0.7 if sample else 0.0, noise=noise)
                    fns = {n: (lambda fn=fn: fn(logits, exclude, **kw)) for n, fn in providers(device, names).items()
                           if n != "unfused" or score == "prob"}
                    want = reference.top1(logits, exclude, **kw)[0]
                    same = {n: bool(torch.equal(f()[0], want)) for n, f in fns.items()}
                    for name, (ms, ms_min) in time_interleaved(fns, device, repeats, rep_ms).items():
                        gbps = useful_bytes(rows, V, dtype, sample) / (ms * 1e-3) / 1e9
                        results.append(dict(bench="top1", provider=name, rows=rows, vocab=V, dtype=dtype_name,
                                            score=score, sample=sample, ms=ms, ms_min=ms_min, gbps=gbps,
                                            peak_gbps=peak, peak_frac=gbps / peak, hbm_gbps=hbm,
                                            hbm_frac=gbps / hbm if hbm else None, same_ids=same[name]))
    return results


def main(argv=None) -> int:
    device = default_device()
    gpu = device.type == "cuda"
    ap = Parser(description="top-1 over the vocabulary: torch vs triton")
    ap.add_argument("--quick", action="store_true", help="4 rows of 4096 logits: seconds on a CPU")
    ap.add_argument("--rows", type=int, nargs="+", default=None)
    ap.add_argument("--vocab", type=int, nargs="+", default=None)
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=None)
    ap.add_argument("--score", nargs="+", choices=list(reference.SCORES), default=["prob"])
    ap.add_argument("--sample", action="store_true", help="temperature 0.7 with Gumbel noise")
    ap.add_argument("--providers", nargs="+", choices=("torch", "unfused", "triton"),
                    default=["torch", "unfused", "triton"])
    ap.add_argument("--repeats", type=int, default=None, help="interleaved rounds on CPU")
    add_threads_flag(ap, THREADS_HELP)
    args = ap.parse_args(argv)
    q = args.quick
    rows_list = args.rows or ([4] if q else [32, 256, 1024] if gpu else [32, 512])
    vocab = args.vocab or ([4096] if q else [32000, 126464, 152064] if gpu else [32000, 126464])
    dtypes = args.dtype or (["float32"] if q else ["bfloat16", "float32"])
    bench_threads(args.threads)
    rows = run(rows_list, vocab, dtypes, args.score, args.sample, device, args.repeats or (3 if q else 7),
               25.0 if q else 100.0, tuple(args.providers))
    print_table(rows, ["provider", "rows", "vocab", "dtype", "score", "ms", "ms_min", "gbps", "peak_frac", "hbm_frac"])
    print(f"device: {_common.device_name(device)}")
    print(f"wrote {_common.write_csv('bench_top1', rows, device)}")
    return 0


# ---------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("vocab", [32000, 126464])
@pytest.mark.parametrize("provider", ["torch", "unfused", "triton"])
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
    raise SystemExit(main())
