"""Compile every kernel variant to a CUDA binary without a GPU (``python -m psd_kernels.ops._compile_check``).

The interpreter runs the kernels' math on CPU but never lowers them, so type errors in
loop-carried values, unsupported ops or register blow-ups would first show on a GPU machine.
Triton ships ptxas, so the whole pipeline (TTIR → TTGIR → LLVM → PTX → cubin) runs here for a
chosen architecture. Must run with TRITON_INTERPRET unset (the kernels must be JITFunctions).
Prints one line per variant and exits non-zero on the first failure.
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def _signature(fn, pointers: dict[str, str], scalars: dict[str, str], constexprs: dict) -> dict[str, str]:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = pointers[name]
        elif name in scalars:
            sig[name] = scalars[name]
        elif name.startswith("stride"):
            sig[name] = "i64"
        else:
            sig[name] = "i32"
    return sig


def variants(quick: bool = False, only: str | None = None):
    """(label, kernel, signature, constexprs, num_warps) for every constexpr variant in use.

    ``quick`` keeps every constexpr flag but fewer dtypes, sizes and tile configs; ``only``
    names one module (top1, draft, sparse_attn, moe).
    """
    for label, fn, sig, ce, warps in _variants(quick):
        if only is None or fn.__module__.rsplit(".", 1)[-1] == only:
            yield label, fn, sig, ce, warps


def _variants(quick: bool):
    yield from _top1_variants(quick)
    yield from _draft_variants(quick)
    yield from _sparse_attn_variants(quick)
    yield from _moe_variants(quick)


def _top1_variants(quick: bool):
    from . import top1

    for score, noise, exclude, dt in itertools.product(range(3), (False, True), (False, True), ("bf16", "fp32")):
        if quick and (not exclude or dt == "fp32"):
            continue
        block_v, warps = 8192, 16
        ce = {"SCORE": score, "HAS_EXCLUDE": exclude, "HAS_NOISE": noise, "BLOCK_V": block_v}
        sig = _signature(top1._top1_kernel, {"X": f"*{dt}", "NOISE": "*fp32", "IDS": "*i64", "CONF": "*fp32"},
                         {"temperature": "fp32"}, ce)
        yield f"top1 score={score} noise={noise} exclude={exclude} {dt}", top1._top1_kernel, sig, ce, warps


def _draft_variants(quick: bool):
    from . import draft

    for L, K in ((32, 8),) if quick else ((32, 8), (1, 1), (1024, 3)):
        block_l, block_j, block_k, warps = draft.launch_config(L, K)
        # RANKS is assemble_drafts' node ranks and position_ranks' output: int64 in both
        ptr = {"CONF": "*fp32", "MASKED": "*u8", "ORDER": "*i64", "NMASKED": "*i64", "BLOCK": "*i64", "PRED": "*i64",
               "RANKS": "*i64", "DRAFTS": "*i64", "VALID": "*u8"}
        ce = {"BLOCK_L": block_l, "BLOCK_J": block_j}
        fn = draft._rank_positions_kernel
        yield f"rank_positions L={L}", fn, _signature(fn, ptr, {}, ce), ce, warps
        fn = draft._position_ranks_kernel
        yield f"position_ranks L={L}", fn, _signature(fn, ptr, {}, ce), ce, warps
        ce_d = dict(ce, BLOCK_K=block_k)
        fn = draft._assemble_drafts_kernel
        yield f"assemble_drafts L={L} K={K}", fn, _signature(fn, ptr, {}, ce_d), ce_d, warps


def _sparse_attn_variants(quick: bool):
    from . import sparse_attn

    fn = sparse_attn._shared_prefix_attn_kernel
    # (shared mask, own mask): the model passes (True, False) on bidirectional models and
    # (True, True) on context-causal ones; (False, False) is the one-cache call without masks
    masks = ((False, False), (True, False), (False, True), (True, True))
    for dt, head_dim, (smask, omask), group, cfg in itertools.product(
            ("bf16", "fp32"), (64, 128), masks, (1, 4, 7), sparse_attn._CONFIGS):
        if quick and (cfg is not sparse_attn._CONFIGS[2] or head_dim != 64 or group != 4):
            continue
        if not quick and (group != 4 and (cfg is not sparse_attn._CONFIGS[0] or smask != omask)):
            continue   # group sizes 1 (LLaDA) and 7 (Dream) once per dtype, head dim and mask pair
        block_d = triton.next_power_of_2(head_dim)
        if not sparse_attn._prune_configs([cfg], {"BLOCK_D": block_d}):
            continue
        ptr = {n: f"*{dt}" for n in ("Q", "KS", "VS", "KO", "VO", "O")}
        ptr.update({"SMASK": "*u8", "OMASK": "*u8", "LSE": "*fp32", "ORDER": "*i64", "OFFS": "*i64"})
        ce = dict(HEAD_DIM=head_dim, GROUP=group, HAS_MASK=smask, HAS_OWN_MASK=omask, UPCAST=dt == "fp32",
                  DOT_PRECISION="ieee" if dt == "fp32" else "tf32", CHUNK=sparse_attn.CHUNK_C, BLOCK_D=block_d,
                  **cfg.kwargs)
        label = (f"shared_prefix_attention {dt} D={head_dim} G={group} shared_mask={smask} own_mask={omask} "
                 f"{cfg.kwargs}")
        yield label, fn, _signature(fn, ptr, {"qk_scale": "fp32"}, ce), ce, cfg.num_warps


def _moe_variants(quick: bool):
    from . import moe

    # (slots, experts): decode (a few slots per expert), a mid batch, prefill (many per expert)
    for dt, (n, e) in itertools.product(("bf16", "fp16", "fp32"), ((64, 64), (2048, 64), (16384, 64))):
        if quick and (dt == "fp16" or n == 2048):
            continue
        torch_dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dt]
        bm, bn, bk, warps = moe.launch_config(n, e, torch_dt)
        tiles = dict(UPCAST=dt == "fp32", DOT_PRECISION="ieee" if dt == "fp32" else "tf32", CHUNK=moe.CHUNK_E,
                     BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        ptr = {"X": f"*{dt}", "WG": f"*{dt}", "WU": f"*{dt}", "WD": f"*{dt}", "HOUT": f"*{dt}", "HIN": f"*{dt}",
               "ORDER": "*i64", "OFFS": "*i64", "TW": "*fp32", "Y": "*fp32"}
        for fn in (moe._moe_gate_up_kernel, moe._moe_down_kernel):
            label = f"{fn.__name__} {dt} slots={n} experts={e} {bm}x{bn}x{bk}"
            yield label, fn, _signature(fn, ptr, {}, tiles), tiles, warps
        if n == 64:
            ce = dict(BLOCK_H=moe.SUM_BLOCK_H)
            ptr = {"Y": "*fp32", "IDS": "*i64", "OUT": f"*{dt}"}
            yield f"_moe_sum_kernel {dt}", moe._moe_sum_kernel, _signature(moe._moe_sum_kernel, ptr, {}, ce), ce, 4


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability, e.g. 80, 90")
    ap.add_argument("--quick", action="store_true", help="every constexpr flag, fewer dtypes/sizes/configs")
    ap.add_argument("--only", choices=("top1", "draft", "sparse_attn", "moe"), help="compile one kernel family")
    args = ap.parse_args(argv)
    if triton.knobs.runtime.interpret:
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    n = 0
    for label, fn, sig, ce, warps in variants(args.quick, args.only):
        kernel = triton.compile(ASTSource(fn, sig, constexprs=ce), target=target, options={"num_warps": warps})
        print(f"ok sm_{args.arch} {label}: {len(kernel.asm['cubin'])} B cubin, {kernel.metadata.shared} B smem")
        n += 1
    print(f"compiled {n} variants for sm_{args.arch}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
