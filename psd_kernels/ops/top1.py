"""Top-1 token and confidence over the vocabulary in one pass (Triton).

The torch path (``reference.top1``) reads the B·L·V logits three to five times (cast to fp32,
log-softmax, argmax, gather, exp) and writes fp32 copies of the same size. This kernel reads
every logit once and writes 12 bytes per row: each program owns one row and streams it in
chunks of BLOCK_V, keeping an online max, a running Σ exp(x − max) rescaled when the max grows,
and a first-index argmax, all in fp32. Optional statistics ride in the same pass, selected by
constexpr flags: the second-largest logit (margin), Σ exp(x − max)(x − max) (negative
entropy) and a Gumbel-max sample argmax(x / T + g) with the logit at the sampled index.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference import SCORES, check_top1_args, top1_out
from ._common import INTERPRET, check_device

_SCORE_CODE = {name: i for i, name in enumerate(SCORES)}  # prob 0, margin 1, entropy 2


@triton.jit
def _top1_kernel(
    X,
    NOISE,
    IDS,
    CONF,
    stride_x,
    stride_noise,
    V,
    exclude_id,
    temperature,
    SCORE: tl.constexpr,
    HAS_EXCLUDE: tl.constexpr,
    HAS_NOISE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # 64-bit row offsets: B·L·V exceeds 2^31 at 126k vocab with a few thousand rows.
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    noise_row = NOISE + row * stride_noise
    offs = tl.arange(0, BLOCK_V)

    m = float("-inf")  # running max of the logits
    s = 0.0  # Σ exp(x - m)
    t = 0.0  # Σ exp(x - m)(x - m), for the entropy
    m2 = float("-inf")  # second largest logit (counting repeats), for the margin
    best = 0  # chosen index
    y_best = float("-inf")  # best x / T + g so far, when sampling
    x_best = float("-inf")  # logit at the sampled index, for its untempered probability

    for start in range(0, V, BLOCK_V):
        cols = start + offs
        in_vocab = cols < V
        x = tl.load(x_row + cols, mask=in_vocab, other=float("-inf")).to(tl.float32)
        if HAS_EXCLUDE:
            x = tl.where(cols == exclude_id, float("-inf"), x)
        c_max = tl.max(x, 0)
        # First index of the chunk maximum, spelled out: tl.argmax's tie_break_left is ignored
        # by the interpreter (numpy is always leftmost), so the tie tests could not catch a
        # regression there; this form behaves the same compiled and interpreted.
        c_arg = tl.min(tl.where(x == c_max, offs, BLOCK_V), 0)
        m_new = tl.maximum(m, c_max)
        # m_new stays -inf while every logit so far is -inf; subtracting 0 instead keeps the
        # exponentials at 0 rather than NaN (-inf - -inf).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_ref)
        e = tl.exp(x - m_ref)
        if SCORE == 2:
            # Rescale Σ e^{x-m}(x-m) to the new max: α·(t + (m - m_new)·s). The guards select
            # before multiplying so that -inf·0 (no finite logit yet, excluded lanes) never
            # forms a NaN.
            shift = tl.where(s > 0, m - m_ref, 0.0) * s
            t = alpha * (t + shift) + tl.sum(e * tl.where(e > 0, x - m_ref, 0.0), 0)
        if SCORE == 1:
            c_second = tl.max(tl.where(offs == c_arg, float("-inf"), x), 0)
            m2 = tl.maximum(tl.maximum(m2, c_second), tl.minimum(m, c_max))
        s = alpha * s + tl.sum(e, 0)
        if HAS_NOISE:
            g = tl.load(noise_row + cols, mask=in_vocab, other=0.0).to(tl.float32)
            y = x / temperature + g  # excluded and padded lanes stay -inf
            y_max = tl.max(y, 0)
            y_arg = tl.min(tl.where(y == y_max, offs, BLOCK_V), 0)
            x_at = tl.max(tl.where(offs == y_arg, x, float("-inf")), 0)
            # strict '>' keeps the earlier chunk on ties: first index wins across chunks too
            take = y_max > y_best
            best = tl.where(take, start + y_arg, best)
            x_best = tl.where(take, x_at, x_best)
            y_best = tl.maximum(y_best, y_max)
        else:
            best = tl.where(c_max > m, start + c_arg, best)
        m = m_new

    m_ref = tl.where(m == float("-inf"), 0.0, m)
    if SCORE == 0:
        if HAS_NOISE:
            conf = tl.exp(x_best - m_ref) / s
        else:
            conf = 1.0 / s  # the argmax logit is m: exp(m - m) / s
    elif SCORE == 1:
        conf = (1.0 - tl.exp(m2 - m_ref)) / s
    else:
        conf = t / s - tl.log(s)
    # No token to choose (every logit -inf once exclude_id is; sampling: every x / T + g): conf -inf,
    # as the reference gives; `best` is still its initial 0, which must not be the excluded id.
    if HAS_NOISE:
        none = y_best == float("-inf")
    else:
        none = m == float("-inf")
    conf = tl.where(none, float("-inf"), conf)
    best = tl.where(none & (exclude_id == 0), 1, best)
    # NaN logits match no lane above; the clamp keeps even that unspecified id in the vocabulary
    best = tl.minimum(best, V - 1)
    tl.store(IDS + row, best.to(tl.int64))
    tl.store(CONF + row, conf)


# Interpreter: numpy vectorises a chunk, Python pays per loop trip, so take big chunks.
# GPU: 8192 fp32 lanes over 16 warps is 16 registers per thread per live chunk array.
MAX_BLOCK_V = 65536 if INTERPRET else 8192
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def launch_config(V: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a vocabulary of size V."""
    block_v = min(triton.next_power_of_2(V), MAX_BLOCK_V)
    num_warps = min(16, max(4, block_v // 512))
    return block_v, num_warps


def top1(
    logits: torch.Tensor,
    exclude_id: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    score: str = "prob",
    temperature: float = 0.0,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    exclude_id, temperature = check_top1_args(logits, exclude_id, score, temperature, noise)
    if logits.dtype not in _DTYPES:
        raise ValueError(f"triton top1 takes float16/bfloat16/float32 logits, got {logits.dtype}; use backend='reference'")
    sampling = temperature > 0
    check_device(logits, noise if sampling else None)
    V = logits.shape[-1]
    batch = tuple(logits.shape[:-1])
    x = logits.reshape(-1, V)  # [N, V]
    if x.stride(-1) != 1:
        x = x.contiguous()
    N = x.shape[0]
    if sampling:
        g = noise.reshape(-1, V)
        if g.stride(-1) != 1 or g.dtype not in _DTYPES:
            g = g.to(torch.float32).contiguous()
    else:
        g = x  # never read: HAS_NOISE is off

    if out is None:
        ids = torch.empty(batch, dtype=torch.int64, device=logits.device)
        conf = torch.empty(batch, dtype=torch.float32, device=logits.device)
    else:
        ids, conf = top1_out(out, logits)
    ids_flat = ids.view(-1) if ids.is_contiguous() else torch.empty(N, dtype=torch.int64, device=logits.device)
    conf_flat = conf.view(-1) if conf.is_contiguous() else torch.empty(N, dtype=torch.float32, device=logits.device)

    if N > 0:
        block_v, num_warps = launch_config(V)
        _top1_kernel[(N,)](
            x, g, ids_flat, conf_flat,
            x.stride(0), g.stride(0),
            V, -1 if exclude_id is None else int(exclude_id), float(temperature) if sampling else 1.0,
            SCORE=_SCORE_CODE[score],
            HAS_EXCLUDE=exclude_id is not None,
            HAS_NOISE=sampling,
            BLOCK_V=block_v,
            num_warps=num_warps,
        )
    # A strided out buffer cannot be viewed as [N]; the kernel wrote a temporary instead.
    if not ids.is_contiguous():
        ids.copy_(ids_flat.view(batch))
    if not conf.is_contiguous():
        conf.copy_(conf_flat.view(batch))
    return ids, conf


top1.__doc__ = """Triton twin of ``reference.top1`` (same signature and results: ids exactly, conf to
float32 rounding). float16/bfloat16/float32 logits; reads each logit once."""
