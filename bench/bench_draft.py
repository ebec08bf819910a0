"""Microbenchmark: draft assembly and the two rankings of the block, torch reference vs Triton.

    python -m bench.bench_draft                     # small CPU defaults, seconds
    python -m bench.bench_draft --rows 1 64 512 --nodes 8 32 --block 32
    pytest bench/bench_draft.py --benchmark-only

These kernels move little data (B·L inputs, B·K·L drafts): at decoding sizes they measure
launch latency, which is the point — the torch path issues ~15 small ops (two sorts, gathers,
a [B, K, L, D] compare) where the kernel issues one launch. GB/s counts the bytes one pass
must move (inputs once, outputs once); ``peak_frac`` divides by the measured copy bandwidth.
Results: runs/bench/bench_draft_<device>.csv (git-ignored; PSD_BENCH_RESULTS=DIR elsewhere).
"""
from __future__ import annotations

from bench.pytest_view import pytest
import torch

from engine.frontend import Parser, add_threads_flag
from psd_kernels import reference

from ._common import (THREADS_HELP, bench_threads, copy_bandwidth_gbps, default_device, print_table, sync, time_ms,
                      triton_usable, write_csv)

OPS = ("assemble_drafts", "rank_positions", "position_ranks")


def providers(device: torch.device) -> dict[str, object]:
    out = {"torch": reference}
    if triton_usable(device):
        from psd_kernels.ops import draft

        out["triton"] = draft
    return out


def make_case(B: int, L: int, K: int, depth: int, device: torch.device):
    gen = torch.Generator(device=device).manual_seed(0)
    conf = torch.rand(B, L, generator=gen, device=device)
    masked = torch.rand(B, L, generator=gen, device=device) < 0.7
    block = torch.randint(0, 126000, (B, L), generator=gen, device=device)
    pred = torch.randint(0, 126000, (B, L), generator=gen, device=device)
    # nodes: the root, then rank sets of growing size like a calibrated graph of that depth
    ranks = torch.full((K, depth), -1, dtype=torch.int64)
    for k in range(1, K):
        size = 1 + (k - 1) % depth
        ranks[k, :size] = torch.randperm(min(L, 2 * depth), generator=torch.Generator().manual_seed(k))[:size]
    return block, masked, pred, conf, ranks.to(device)


def useful_bytes(op: str, B: int, L: int, K: int, depth: int) -> int:
    if op in ("rank_positions", "position_ranks"):
        return B * L * (4 + 1) + B * L * 8 + B * 8
    return B * L * (8 + 1 + 8 + 4) + K * depth * 8 + B * K * L * 8 + B * K


def call(module, op: str, case):
    block, masked, pred, conf, ranks = case
    if op == "rank_positions":
        return module.rank_positions(conf, masked)
    if op == "position_ranks":
        return module.position_ranks(conf, masked)
    return module.assemble_drafts(block, masked, pred, conf, ranks)


def run(rows_list, nodes_list, L: int, depth: int, ops, device: torch.device) -> list[dict]:
    peak = copy_bandwidth_gbps(device)
    results = []
    for B in rows_list:
        for K in nodes_list:
            case = make_case(B, L, K, depth, device)
            for op in ops:
                if op != "assemble_drafts" and K != nodes_list[0]:
                    continue  # K only matters to the drafts
                for name, module in providers(device).items():
                    ms = time_ms(lambda: call(module, op, case), device)
                    gbps = useful_bytes(op, B, L, K, depth) / (ms * 1e-3) / 1e9
                    results.append(dict(bench=op, provider=name, rows=B, block=L, nodes=K, depth=depth, ms=ms,
                                        us=ms * 1e3, gbps=gbps, peak_gbps=peak, peak_frac=gbps / peak))
    return results


def main(argv=None) -> None:
    device = default_device()
    gpu = device.type == "cuda"
    ap = Parser(description="draft assembly / rank_positions / position_ranks: torch vs triton")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 64, 512] if gpu else [1, 64])
    ap.add_argument("--nodes", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--op", nargs="+", choices=OPS, default=list(OPS))
    add_threads_flag(ap, THREADS_HELP)
    args = ap.parse_args(argv)
    bench_threads(args.threads)
    rows = run(args.rows, args.nodes, args.block, args.depth, args.op, device)
    print_table(rows, ["bench", "provider", "rows", "block", "nodes", "us", "gbps", "peak_frac"])
    print(f"wrote {write_csv('bench_draft', rows, device)}")


# ---------------------------------------------------------------------- pytest-benchmark
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("provider", ["torch", "triton"])
def test_draft(benchmark, provider, op):
    bench_threads()
    device = default_device()
    mods = providers(device)
    if provider not in mods:
        pytest.skip("triton is timed on CUDA only")
    case = make_case(64, 32, 8, 4, device)
    got = benchmark(lambda: (call(mods[provider], op, case), sync(device))[0])
    want = call(reference, op, tuple(t.cpu() for t in case))
    assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want))


if __name__ == "__main__":
    main()
