"""Plain-torch reference implementations of the psd_kernels API.

Each function has exactly the signature of its Triton twin in ``psd_kernels.ops``. They are the
CPU path, the test oracle and the benchmark baseline, so the two that dominate a CPU call are
written for speed within plain torch: ``top1`` writes one float copy of the logits and reads it
a few times (max with argmax, log-softmax in place, gather) where the Triton kernel reads the
logits once; ``shared_prefix_attention`` runs on CPU as two fused SDPA calls (shared part, own
part) merged by log-sum-exp, never materialising a score matrix. Neither replicates a cache
row per draft, and neither reads a value back to the host, except ``plan_rows``' one int for
the padded layout (once per model call).
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "top1",
    "rank_positions",
    "position_ranks",
    "assemble_drafts",
    "shared_prefix_attention",
    "merge_attention",
    "plan_rows",
    "RowPlan",
    "moe",
]

SCORES = ("prob", "margin", "entropy")


# --------------------------------------------------------------------------------------------
# out= buffers, checked alike by both backends (the Triton launchers import these: this module
# imports no triton). Every op that takes out= accepts exactly the buffers it would allocate: the
# results' shapes, dtypes and device, any strides, a pair where it returns a pair. One spec per
# op (top1_out, rank_out, drafts_out, attention_out, check_moe_args), checked before any work.
# --------------------------------------------------------------------------------------------
def check_out(t, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``t`` itself when it is a ``dtype`` tensor of ``shape`` on ``device``; else ValueError."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"out buffer {name} must be a tensor")
    if tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
        raise ValueError(f"out buffer {name} must be {dtype} {tuple(shape)} on {device}, "
                         f"got {t.dtype} {tuple(t.shape)} on {t.device}")
    return t


def check_out_pair(out, names: tuple[str, str]) -> None:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
        raise ValueError(f"out must be a pair ({names[0]}, {names[1]})")


def out_pair(out, first: tuple, second: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's ``out`` pair checked against ``first`` and ``second``, each ``(name, shape, dtype)``
    of one result on ``device``; returned as a tuple of the caller's two tensors."""
    check_out_pair(out, (first[0], second[0]))
    return check_out(out[0], *first, device), check_out(out[1], *second, device)


# --------------------------------------------------------------------------------------------
# top-1 over the vocabulary
# --------------------------------------------------------------------------------------------
def check_top1_args(logits, exclude_id, score, temperature, noise) -> tuple[int | None, float]:
    """Input validation shared by both backends, so both reject the same calls: (exclude_id as an
    int or None, temperature as a float) -- numpy and 0-d tensor numbers taken as Python's."""
    if score not in SCORES:
        raise ValueError(f"unknown confidence score {score!r}; expected one of {SCORES}")
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point():
        raise ValueError("logits must be a floating-point tensor")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    V = logits.shape[-1]
    if exclude_id is not None:
        exclude_id = _number(exclude_id, operator.index, "exclude_id must be an integer token id")
        if not 0 <= exclude_id < V:
            raise ValueError(f"exclude_id {exclude_id} outside vocabulary of size {V}")
        if V == 1:
            raise ValueError("exclude_id removes the only token of a vocabulary of size 1")
    temperature = _number(temperature, float, "temperature must be a real number")
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be a finite number >= 0 (0: argmax), got {temperature!r}")
    if temperature > 0:
        if not isinstance(noise, torch.Tensor) or noise.shape != logits.shape:
            raise ValueError("temperature > 0 needs Gumbel noise: a tensor with the logits' shape")
        if not noise.is_floating_point():
            raise ValueError("noise must be a floating-point tensor of Gumbel draws")
    return exclude_id, temperature


def _number(value, convert, what: str):
    """`value` (a Python, numpy or 0-d tensor number; never a bool, whose True would be 1) as
    `convert` makes it, else ValueError `what`, naming the type given."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.dtype == torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):    # numpy's bool is no Real
        raise ValueError(f"{what}, got {type(value).__name__}")
    try:
        return convert(value)
    except TypeError:                                 # a float where operator.index needs an integer
        raise ValueError(f"{what}, got {type(value).__name__} {value!r}") from None


def top1_out(out, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's ``out=(ids, conf)`` of a ``top1`` call checked (both backends): int64 and float32
    (float64 for float64 logits) tensors of the logits' leading shape, on their device."""
    batch = tuple(logits.shape[:-1])
    conf_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return out_pair(out, ("ids", batch, torch.int64), ("conf", batch, conf_dtype), logits.device)


def top1(
    logits: torch.Tensor,
    exclude_id: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    score: str = "prob",
    temperature: float = 0.0,
    noise: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 token and its confidence for every row of ``logits`` [..., V].

    ids  int64  [...]: argmax over the vocabulary (first index on ties); with
                       ``temperature > 0`` the Gumbel-max sample argmax(logits / T + noise),
                       where ``noise`` [..., V] holds standard Gumbel draws from the caller.
    conf float32 [...]: ``prob``: softmax probability of the chosen token (untempered);
                       ``margin``: top-1 minus top-2 probability; ``entropy``: sum p log p
                       (negative entropy). All math in float32 (float64 logits stay float64).
    ``exclude_id`` (the mask token) gets probability zero and is never chosen.
    A row with no token to choose (every logit -inf once ``exclude_id`` is; sampling: every
    logits / T + noise -inf) gets conf -inf, below every confidence of every score (the engine
    fails such a row: its confidence is not finite), and the id 0, or 1 when ``exclude_id`` is 0.
    ``out=(ids, conf)`` receives the results: buffers of exactly the results' shapes, dtypes and
    device (else ValueError, as on the Triton backend). NaN logits give unspecified results.

    Torch path: ONE float copy of the logits (the cast, with the excluded column set to -inf),
    max and argmax together in one pass (``torch.max``), then log-softmax IN PLACE into that
    copy and one gather: one tensor of the logits' size is written, against three (cast, clone,
    log-softmax) before. Fewer passes, same arithmetic: ids and confidences are bit-identical
    to the cast/clone/log-softmax/argmax formulation (on rows with a token to choose).
    """
    exclude_id, temperature = check_top1_args(logits, exclude_id, score, temperature, noise)
    if out is not None:
        out = top1_out(out, logits)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    x = logits.to(acc, copy=True)                      # our own copy: edited in place below
    if exclude_id is not None:
        x[..., exclude_id] = float("-inf")
    # max and (first-index) argmax in one pass; the max says which rows have no token to choose
    top, ids = torch.max(x / temperature + noise.to(acc) if temperature > 0 else x, dim=-1)
    logp = torch.log_softmax(x, dim=-1, out=x)         # in place: x is not read again
    conf = _top1_conf(logp, ids, score)
    conf = conf.to(torch.float32) if acc == torch.float32 else conf
    none = torch.isneginf(top)                        # rows with no token to choose
    conf.masked_fill_(none, float("-inf"))
    if exclude_id == 0:                                # torch.max gave such rows the first index, 0
        ids.masked_fill_(none, 1)
    if out is not None:
        out[0].copy_(ids)
        out[1].copy_(conf)
        return out
    return ids, conf


def _top1_conf(logp: torch.Tensor, ids: torch.Tensor, score: str) -> torch.Tensor:
    """The confidence ``score`` of the chosen ``ids`` from the log-probabilities ``logp`` [..., V]."""
    if score == "prob":
        return logp.gather(-1, ids.unsqueeze(-1)).squeeze(-1).exp()
    if score == "margin":
        top2 = torch.topk(logp, min(2, logp.shape[-1]), dim=-1).values.exp()   # exp is monotone
        return top2[..., 0] - (top2[..., 1] if top2.shape[-1] > 1 else 0.0)
    p = logp.exp()
    return torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(-1)


# --------------------------------------------------------------------------------------------
# draft assembly: rank masked positions, write predictions
# --------------------------------------------------------------------------------------------
def _check_2d(name: str, t, dtype: torch.dtype, shape: tuple[int, int] | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [B, L], got shape {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    if shape is not None and tuple(t.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {shape}")


def check_rank_args(conf, masked) -> tuple[int, int]:
    _check_2d("conf", conf, torch.float32, None)
    _check_2d("masked", masked, torch.bool, tuple(conf.shape))
    if masked.device != conf.device:
        raise ValueError("conf and masked must be on the same device")
    return conf.shape[0], conf.shape[1]


def check_draft_args(block, masked, pred, conf, node_ranks) -> tuple[int, int, int, int]:
    _check_2d("block", block, torch.int64, None)
    B, L = block.shape
    _check_2d("masked", masked, torch.bool, (B, L))
    _check_2d("pred", pred, torch.int64, (B, L))
    _check_2d("conf", conf, torch.float32, (B, L))
    if not isinstance(node_ranks, torch.Tensor) or node_ranks.dim() != 2:
        raise ValueError("node_ranks must be a 2-D [K, D] tensor of ranks padded with -1")
    if node_ranks.dtype != torch.int64:
        raise ValueError(f"node_ranks must be torch.int64, got {node_ranks.dtype}")
    if len({t.device for t in (block, masked, pred, conf, node_ranks)}) != 1:
        raise ValueError("block, masked, pred, conf and node_ranks must be on one device")
    return B, L, node_ranks.shape[0], node_ranks.shape[1]


def rank_out(out, conf: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's ``out=(name, n_masked)`` of ``rank_positions`` / ``position_ranks`` checked (both
    backends): int64 [B, L] and int64 [B] on conf's device."""
    B, L = conf.shape
    return out_pair(out, (name, (B, L), torch.int64), ("n_masked", (B,), torch.int64), conf.device)


def drafts_out(out, block: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's ``out=(drafts, valid)`` of ``assemble_drafts`` checked (both backends): int64
    [B, K, L] and bool [B, K] on block's device."""
    B, L = block.shape
    return out_pair(out, ("drafts", (B, K, L), torch.int64), ("valid", (B, K), torch.bool), block.device)


def _position_ranks(conf: torch.Tensor, masked: torch.Tensor):
    """(order with unmasked positions last, rank of every position (-1 if unmasked), n_masked)."""
    B, L = conf.shape
    # Two stable sorts build the key (masked first, conf descending, position ascending):
    # stability keeps the lower position first among equal confidences.
    by_conf = torch.sort(conf, dim=-1, descending=True, stable=True).indices
    masked_first = torch.sort(masked.gather(-1, by_conf).to(torch.int8), dim=-1, descending=True, stable=True).indices
    order_full = by_conf.gather(-1, masked_first)  # [B, L]: a permutation of 0..L-1 per row
    ranks = torch.empty_like(order_full)
    ranks.scatter_(-1, order_full, torch.arange(L, device=conf.device).expand(B, L))
    ranks = torch.where(masked, ranks, torch.full_like(ranks, -1))
    n_masked = masked.sum(-1)
    return order_full, ranks, n_masked


def rank_positions(
    conf: torch.Tensor,
    masked: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank the masked positions of every row by confidence (the PSD ordering σ).

    conf float32 [B, L], masked bool [B, L].
    Returns ``order`` int64 [B, L] and ``n_masked`` int64 [B]: ``order[b, r]`` for
    ``r < n_masked[b]`` is the position holding rank ``r`` (confidence descending, lower position
    first on ties); ``order[b, r] = -1`` for ``r >= n_masked[b]``. Unmasked positions are never
    ranked. ``out=(order, n_masked)`` receives the results (buffers of exactly their shapes, dtypes
    and device). NaN confidences at masked positions give unspecified ranks.
    """
    B, L = check_rank_args(conf, masked)
    if out is not None:
        out = rank_out(out, conf, "order")
    order_full, _, n_masked = _position_ranks(conf, masked)
    r = torch.arange(L, device=conf.device)
    order = torch.where(r < n_masked[:, None], order_full, torch.full_like(order_full, -1))
    if out is not None:
        out[0].copy_(order)
        out[1].copy_(n_masked)
        return out
    return order, n_masked


def position_ranks(
    conf: torch.Tensor,
    masked: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank of every masked position in its row's ordering σ (the inverse of ``rank_positions``).

    conf float32 [B, L], masked bool [B, L].
    Returns ``ranks`` int64 [B, L] and ``n_masked`` int64 [B]: ``ranks[b, i]`` for a masked
    position i is its rank in σ (confidence descending, lower position first on ties), so
    ``order[b, ranks[b, i]] == i`` for the ``order`` of ``rank_positions``, and the masked ranks
    of a row are a permutation of ``0..n_masked[b]-1``; ``ranks[b, i] = -1`` at unmasked
    positions. ``out=(ranks, n_masked)`` receives the results (buffers of exactly their shapes,
    dtypes and device). NaN confidences at masked positions give unspecified ranks.
    """
    check_rank_args(conf, masked)
    if out is not None:
        out = rank_out(out, conf, "ranks")
    _, ranks, n_masked = _position_ranks(conf, masked)
    if out is not None:
        out[0].copy_(ranks)
        out[1].copy_(n_masked)
        return out
    return ranks, n_masked


def assemble_drafts(
    block: torch.Tensor,
    masked: torch.Tensor,
    pred: torch.Tensor,
    conf: torch.Tensor,
    node_ranks: torch.Tensor,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Instantiate the K draft blocks of a draft graph for every row (PSD stage 2).

    block int64 [B, L]: current block of each row's canvas; masked bool [B, L]: still-masked
    positions; pred int64 [B, L] / conf float32 [B, L]: top-1 token and confidence of the last
    call; node_ranks int64 [K, D]: rank set of every graph node, padded with -1 (negative
    entries are padding; the root is all padding).
    Masked positions are ranked as in ``rank_positions``.
    Returns ``drafts`` int64 [B, K, L]: ``block`` with ``pred`` written at the position of every
    rank of node k, and ``valid`` bool [B, K]: every rank of node k is < the row's number of
    masked positions. Ranks beyond that write nothing; the engine skips invalid nodes.
    ``out=(drafts, valid)`` receives the results (buffers of exactly their shapes, dtypes and device).
    """
    B, L, K, D = check_draft_args(block, masked, pred, conf, node_ranks)
    if out is not None:
        out = drafts_out(out, block, K)
    _, ranks, n_masked = _position_ranks(conf, masked)
    # hit[b, k, i]: position i holds one of node k's ranks. Unmasked positions have rank -1 and
    # must not match the -1 padding, hence the explicit `masked`.
    hit = (ranks[:, None, :, None] == node_ranks[None, :, None, :]).any(-1) & masked[:, None, :]
    drafts = torch.where(hit, pred[:, None, :], block[:, None, :])
    valid = ((node_ranks[None] < 0) | (node_ranks[None] < n_masked[:, None, None])).all(-1)
    if out is not None:
        out[0].copy_(drafts)
        out[1].copy_(valid)
        return out
    return drafts, valid


# --------------------------------------------------------------------------------------------
# shared-prefix (block-sparse) attention
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, eq=False)
class RowPlan:
    """Layout of one call's rows over its cache rows, made once per call (``plan_rows``) and
    read by every layer's ``shared_prefix_attention`` (the FlashInfer plan/run split).

    row_map  int64 [R]: the cache row each query row reads.
    order    int64 [R]: the rows sorted by cache row (stable); cache row c serves the rows
             ``order[offsets[c]:offsets[c + 1]]``.
    offsets  int64 [C + 1].
    slots, max_rows: the reference's padded layout ([C', max_rows] row slots; row r sits in slot
             ``slots[r]``; ``rect``: the rows already are that layout), or None when the plan was
             made without it (the Triton kernel needs only order/offsets).
    used     int64 [C'] or None: the cache rows that some row reads, in order, when not all of them
             are (C' < C): the padded layout holds those only, so the reference never attends
             from a cache row no query reads (a running batch's call holds only its rows still
             decoding, while the cache keeps a row per sequence of the block).
    """

    row_map: torch.Tensor
    cache_rows: int
    order: torch.Tensor
    offsets: torch.Tensor
    slots: torch.Tensor | None = None
    max_rows: int | None = None
    rect: bool = False
    used: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return self.row_map.shape[0]

    def padded(self) -> "RowPlan":
        """This plan with the reference's padded layout (one host read if it has none)."""
        return self if self.slots is not None else plan_rows(self.row_map, self.cache_rows, padded=True)


def plan_rows(row_map: torch.Tensor, cache_rows: int, *, padded: bool = True) -> RowPlan:
    """Plan the rows of one call over ``cache_rows`` cache rows (``row_map`` int64 [R]).

    Device ops only (a stable sort and a searchsorted), except with ``padded``: the reference's
    padded layout needs the largest number of rows of one cache row as a Python int, ONE host
    read per plan (free on CPU, where the reference runs), which also checks that every entry
    of ``row_map`` names a cache row. Without it, entries outside ``[0, C)`` leave their rows'
    output unwritten (the kernel cannot check without a sync).
    """
    if not isinstance(row_map, torch.Tensor) or row_map.dim() != 1 or row_map.dtype != torch.int64:
        raise ValueError("row_map must be a 1-D int64 tensor [R] of cache rows")
    if isinstance(cache_rows, bool) or not isinstance(cache_rows, int) or cache_rows < 1:
        raise ValueError(f"cache_rows must be a positive int, got {cache_rows!r}")
    dev, R = row_map.device, row_map.shape[0]
    sorted_map, order = torch.sort(row_map, stable=True)
    offsets = torch.searchsorted(sorted_map, torch.arange(cache_rows + 1, device=dev))
    if not padded:
        return RowPlan(row_map, cache_rows, order, offsets)
    if R == 0:
        return RowPlan(row_map, cache_rows, order, offsets, order, 0, True)
    counts = offsets[1:] - offsets[:-1]
    n, has = counts.max(), counts > 0
    # one read: the padding width, the range of the map, whether the rows already are [C, n], and
    # how many cache rows some row reads
    rect = (counts == n).all() & (sorted_map == row_map).all()
    n, lo, hi, rect, k = torch.stack((n, row_map.min(), row_map.max(), rect.long(), has.sum())).tolist()
    if lo < 0 or hi >= cache_rows:
        raise ValueError(f"row_map names cache rows {lo}..{hi}, but there are {cache_rows}")
    rank = torch.arange(R, device=dev) - offsets[sorted_map]        # place of each sorted row in its group
    used, group = None, sorted_map
    if k < cache_rows:           # the layout holds only the cache rows read: cache row c is its used[c']
        used = torch.argsort((~has).to(torch.uint8), stable=True)[:k]
        group = (torch.cumsum(has, 0) - 1)[sorted_map]
    slots = torch.empty_like(order).index_copy_(0, order, group * n + rank)
    return RowPlan(row_map, cache_rows, order, offsets, slots, n, bool(rect), used)


def check_attention_args(q, k_shared, v_shared, k_own, v_own, shared_mask, own_mask=None,
                         row_map=None) -> tuple[int, ...]:
    """Validates a call (no host read); returns (R, H, L, D, Hkv, S, C)."""
    for name, t, nd in (("q", q, (4,)), ("k_shared", k_shared, (3, 4)), ("v_shared", v_shared, (3, 4)),
                        ("k_own", k_own, (4,)), ("v_own", v_own, (4,))):
        if not isinstance(t, torch.Tensor) or t.dim() not in nd:
            raise ValueError(f"{name} must be a {' or '.join(map(str, nd))}-D tensor")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {t.dtype}")
        if t.dtype != q.dtype:
            raise ValueError(f"{name} is {t.dtype} but q is {q.dtype}; all inputs need one dtype")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    K, H, L, D = q.shape
    if D < 1:
        raise ValueError("q's head dim D must be >= 1 (the scale is 1/sqrt(D))")
    C, Hkv, S, Dk = k_shared.shape if k_shared.dim() == 4 else (1, *k_shared.shape)
    if Hkv < 1 or H % Hkv != 0:
        raise ValueError(f"query heads H={H} must be a multiple of kv heads Hkv={Hkv}")
    if Dk != D:
        raise ValueError(f"k_shared head dim {Dk} differs from q head dim {D}")
    if tuple(v_shared.shape) != tuple(k_shared.shape):
        raise ValueError(f"v_shared has shape {tuple(v_shared.shape)}, expected {tuple(k_shared.shape)}")
    for name, t in (("k_own", k_own), ("v_own", v_own)):
        if tuple(t.shape) != (K, Hkv, L, D):
            raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {(K, Hkv, L, D)}")
    if shared_mask is not None:
        if not isinstance(shared_mask, torch.Tensor) or shared_mask.dtype != torch.bool:
            raise ValueError("shared_mask must be a bool tensor")
        if tuple(shared_mask.shape) not in ((S,), (C, S)):
            want = f"({S},)" + (f" or ({C}, {S})" if k_shared.dim() == 4 else "")
            raise ValueError(f"shared_mask has shape {tuple(shared_mask.shape)}, expected {want}")
        if shared_mask.device != q.device:
            raise ValueError("shared_mask must be on the device of q")
    if own_mask is not None:
        if not isinstance(own_mask, torch.Tensor) or own_mask.dtype != torch.bool:
            raise ValueError("own_mask must be a bool tensor")
        if own_mask.dim() != 3 or own_mask.shape[0] not in (1, K) or tuple(own_mask.shape[1:]) != (L, L):
            raise ValueError(f"own_mask has shape {tuple(own_mask.shape)}, expected ({K} or 1, {L}, {L})")
        if own_mask.device != q.device:
            raise ValueError("own_mask must be on the device of q")
    if row_map is None:
        if C != 1:
            raise ValueError(f"k_shared holds {C} cache rows: give row_map (the cache row of each of the {K} rows)")
    else:
        rm = row_map.row_map if isinstance(row_map, RowPlan) else row_map
        if not isinstance(rm, torch.Tensor) or rm.dtype != torch.int64 or tuple(rm.shape) != (K,):
            raise ValueError(f"row_map must be an int64 tensor of shape ({K},) or a RowPlan of {K} rows")
        if rm.device != q.device:
            raise ValueError("row_map must be on the device of q")
        if isinstance(row_map, RowPlan) and row_map.cache_rows != C:
            raise ValueError(f"the RowPlan was made for {row_map.cache_rows} cache rows, k_shared has {C}")
    return K, H, L, D, Hkv, S, C


def attention_out(out, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caller's ``out=(out, lse)`` of ``shared_prefix_attention`` checked (both backends): q's
    shape [R, H, L, D] and dtype, and float32 [R, H, L], on q's device."""
    return out_pair(out, ("out", tuple(q.shape), q.dtype), ("lse", tuple(q.shape[:-1]), torch.float32), q.device)


def _attend(q, k, v, scale, key_mask=None):
    """Softmax attention with materialised scores, returning (out, lse) in q's dtype; rows with
    no visible key give (0, -inf). The reference's fallback off CPU, and the test oracle's form."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if key_mask is not None:
        s = s.masked_fill(~key_mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    # A row whose keys are all masked has lse = -inf; its exp(s - lse) would be NaN.
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    p = torch.exp(s - safe[..., None])
    return torch.matmul(p, v), lse


# CPU: the fused flash-attention kernel behind SDPA, which also returns the log-sum-exp.
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
USE_FLASH_CPU = _FLASH_CPU is not None      # tests switch it off to cover the fallback


def _attend_lse(q, k, v, scale, key_mask):
    """(out in q's dtype, lse float32/float64) of q [B, h, M, D] over k, v [B, h, N, D];
    key_mask bool broadcastable to [B, 1, M, N] or None. A row that sees no key: (0, -inf)."""
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        out = q.new_zeros(q.shape)
        return out, torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    if USE_FLASH_CPU and q.device.type == "cpu":
        # the private flash op assumes a unit stride in the head dim (the public SDPA copies such
        # inputs first): a q, k or v without one gave wrong values, silently
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        bias = None
        if key_mask is not None:
            bias = torch.zeros(key_mask.shape, dtype=q.dtype).masked_fill_(~key_mask, float("-inf"))
        out, lse = _FLASH_CPU(q, k, v, attn_mask=bias, scale=scale)
        if key_mask is not None:   # the kernel gives (0, 0) to a row that sees nothing
            lse = lse.masked_fill(~key_mask.any(-1).expand(lse.shape), float("-inf"))
        return out, lse
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse = _attend(q.to(acc), k.to(acc), v.to(acc), scale, key_mask)
    return out.to(q.dtype), lse


def merge_attention(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of two softmax-attention results over disjoint key sets.

    out_* [..., D] (any float dtype), lse_* float32 [...] natural log-sum-exp of each part's
    scaled scores. Returns (out [..., D] in out_a's dtype, lse float32 [...]) equal to attention
    over the union of the keys. A part with lse = -inf (no keys) contributes nothing.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape or out_a.shape[:-1] != lse_a.shape:
        raise ValueError("merge_attention needs out_a/out_b [..., D] and lse_a/lse_b [...] of matching shapes")
    lse = torch.logaddexp(lse_a.float(), lse_b.float())
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_a = torch.exp(lse_a.float() - safe)[..., None]
    w_b = torch.exp(lse_b.float() - safe)[..., None]
    out = out_a.float() * w_a + out_b.float() * w_b
    return out.to(out_a.dtype), lse


def shared_prefix_attention(
    q: torch.Tensor,
    k_shared: torch.Tensor,
    v_shared: torch.Tensor,
    k_own: torch.Tensor,
    v_own: torch.Tensor,
    scale: float | None = None,
    shared_mask: torch.Tensor | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    *,
    own_mask: torch.Tensor | None = None,
    row_map: torch.Tensor | RowPlan | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of R query rows (draft blocks) over shared cache rows plus each row's own block.

    q [R, H, L, D]; k_own, v_own [R, Hkv, L, D]; H a multiple of Hkv (GQA).
    k_shared, v_shared: ``[Hkv, S, D]`` (one cache, read by every row) or ``[C, Hkv, S, D]``
    (C cache rows, e.g. the cached prefix and suffix of each sequence of a batch, stored once
    each); S may be 0. ``row_map`` int64 [R] (or the ``RowPlan`` of ``plan_rows(row_map, C)``,
    made once per model call and shared by its layers) names the cache row of each query row;
    the K drafts of one sequence share their sequence's cache row. None means cache row 0 for
    every row (C must be 1).
    Row r's queries see the S keys of its cache row c (those with ``shared_mask[c]`` True; a
    ``[S]`` mask applies to every cache row) and the L own keys of row r, never another row's.
    ``own_mask`` bool [R or 1, L, L], when given, restricts the own part: query i of row r sees
    own key j iff ``own_mask[r, i, j]`` (e.g. a causal block); a query that then sees no key at
    all gets out 0 and lse -inf. ``scale`` defaults to 1/sqrt(D).
    Returns ``out`` [R, H, L, D] in q's dtype and ``lse`` float32 [R, H, L], the natural
    log-sum-exp of the scaled scores. ``out=(out, lse)`` receives the results (buffers of exactly
    their shapes, dtypes and device).

    The cache is never replicated per row. This torch version is the CPU path: math in float32
    (float64 inputs: float64), rounded once to q's dtype. On CPU the shared part is ONE fused SDPA
    call (the flash kernel behind ``scaled_dot_product_attention``, which also returns the
    log-sum-exp) with the rows of each cache row as one query sequence against one copy of that
    cache row, the own part a second one, and the two are merged by log-sum-exp; no score matrix
    is materialised. A ``RowPlan`` given here without the padded layout costs one host read
    (``RowPlan.padded``).
    """
    R, H, L, D, Hkv, S, C = check_attention_args(q, k_shared, v_shared, k_own, v_own, shared_mask, own_mask,
                                                 row_map)
    if out is not None:
        out = attention_out(out, q)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    G = H // Hkv
    # float32 math for 16-bit inputs (float64 stays float64): ONE rounding to q's dtype at the
    # end, as the kernel does; the cast copies each cache row once, never per row. (Few large
    # ops: on a loaded CPU every parallel op can cost a scheduling slice.)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    qg = q.reshape(R, Hkv, G * L, D)   # the G query heads of kv head g share its keys: rows (head-in-group, position)
    o, lse = _own_part(qg, k_own, v_own, scale, own_mask, G, L, acc)
    if S > 0 and R > 0:
        o_sh, lse_sh, rows = _shared_part(qg, k_shared, v_shared, scale, shared_mask, row_map, C, acc)
        o, lse = _merge_parts(o.reshape(*rows, D), lse.reshape(rows), o_sh, lse_sh, acc)
    o, lse = o.reshape(R, H, L, D).to(q.dtype), lse.float().reshape(R, H, L)
    if out is not None:
        out[0].copy_(o)
        out[1].copy_(lse)
        return out
    return o, lse


def _own_part(qg, k_own, v_own, scale: float, own_mask, G: int, L: int, acc: torch.dtype):
    """Row r's G*L queries of kv head g (qg [R, Hkv, G*L, D]) against its own L keys: (out, lse) in `acc`."""
    om = None
    if own_mask is not None:   # [R|1, L, L] -> [R|1, 1, G*L, L]: every head of a group shares the mask
        om = own_mask[:, None, None].expand(own_mask.shape[0], 1, G, L, L).reshape(own_mask.shape[0], 1, G * L, L)
    return _attend_lse(qg.to(acc), k_own.to(acc), v_own.to(acc), scale, om)


def _shared_part(qg, k_shared, v_shared, scale: float, shared_mask, row_map, C: int, acc: torch.dtype):
    """Each row's queries (qg [R, Hkv, G*L, D]) against the S keys of its cache row: (out, lse, rows)
    with out [*rows, D] and lse [*rows] in `acc`, `rows` either (C, n, Hkv, G*L) (rows already laid
    out [C, n]) or (R, Hkv, G*L).

    The rows of each cache row are ONE query sequence per kv head against one copy of that cache
    row: [C, Hkv, n*G*L, D] with n rows per cache row (padded to the largest n)."""
    R, Hkv, GL, D = qg.shape
    if row_map is None:
        plan = RowPlan(qg.new_zeros(R, dtype=torch.int64), 1, None, None, None, R, True)
    else:
        plan = (row_map if isinstance(row_map, RowPlan) else plan_rows(row_map, C)).padded()
    n = plan.max_rows
    if plan.used is not None:          # only the cache rows some row reads (their keys copied once per layer)
        C = plan.used.numel()
        k_shared, v_shared = k_shared.index_select(0, plan.used), v_shared.index_select(0, plan.used)
        if shared_mask is not None and shared_mask.dim() == 2:
            shared_mask = shared_mask.index_select(0, plan.used)
    q_sh = torch.empty(C, Hkv, n, GL, D, dtype=acc, device=qg.device)
    if plan.rect:       # rows already [C, n]: permute and cast in one copy
        q_sh.copy_(qg.view(C, n, Hkv, GL, D).transpose(1, 2))
    else:               # padding slots see zero queries; their results are never read
        c_of, j_of = plan.slots // n, plan.slots % n
        q_sh.zero_()[c_of, :, j_of] = qg.to(acc)
    ks = k_shared if k_shared.dim() == 4 else k_shared[None]
    vs = v_shared if v_shared.dim() == 4 else v_shared[None]
    km = None
    if shared_mask is not None:
        km = (shared_mask if shared_mask.dim() == 2 else shared_mask[None])[:, None, None, :]   # [C|1, 1, 1, S]
    o_sh, lse_sh = _attend_lse(q_sh.view(C, Hkv, n * GL, D), ks.to(acc), vs.to(acc), scale, km)
    o_sh, lse_sh = o_sh.view(C, Hkv, n, GL, D), lse_sh.view(C, Hkv, n, GL)
    if plan.rect:       # the rows are [C, n]: strided views, no gather
        return o_sh.transpose(1, 2), lse_sh.transpose(1, 2), (C, n, Hkv, GL)
    return o_sh[c_of, :, j_of], lse_sh[c_of, :, j_of], (R, Hkv, GL)   # one gather of the rows' slots


def _merge_parts(o_own, lse_own, o_sh, lse_sh, acc: torch.dtype):
    """Merge by log-sum-exp (merge_attention's formula) as ONE pass over the outputs:
    out = lerp(own, shared, w) with w = exp(lse_shared - lse), the shared part's weight."""
    lse = torch.logaddexp(lse_sh.to(acc), lse_own.to(acc))
    safe = torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)
    w_sh = torch.exp(lse_sh.to(acc) - safe)
    return torch.lerp(o_own, o_sh, w_sh[..., None]), lse


# --------------------------------------------------------------------------------------------
# mixture of experts: top-k routed gated MLPs
# --------------------------------------------------------------------------------------------
def check_moe_args(x, w_gate, w_up, w_down, topk_ids, topk_weights, out=None) -> tuple[int, int, int, int, int]:
    """Validates a call (no host read); returns (T, H, E, I, k)."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or not x.is_floating_point():
        raise ValueError("x must be a 2-D floating-point tensor [T, H]")
    T, H = x.shape
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D tensor [E, out_features, in_features]")
        if t.dtype != x.dtype or t.device != x.device:
            raise ValueError(f"{name} is {t.dtype} on {t.device}; x is {x.dtype} on {x.device}: one dtype and device")
    E, I, Hw = w_gate.shape
    if E < 1 or Hw != H:
        raise ValueError(f"w_gate has shape {tuple(w_gate.shape)}, expected [E >= 1, I, {H}]")
    if tuple(w_up.shape) != (E, I, H):
        raise ValueError(f"w_up has shape {tuple(w_up.shape)}, expected {(E, I, H)}")
    if tuple(w_down.shape) != (E, H, I):
        raise ValueError(f"w_down has shape {tuple(w_down.shape)}, expected {(E, H, I)}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype != torch.int64 or topk_ids.dim() != 2 \
            or topk_ids.shape[0] != T:
        raise ValueError(f"topk_ids must be an int64 tensor [{T}, k]")
    k = topk_ids.shape[1]
    if not isinstance(topk_weights, torch.Tensor) or not topk_weights.is_floating_point() \
            or tuple(topk_weights.shape) != (T, k):
        raise ValueError(f"topk_weights must be a floating-point tensor of shape {(T, k)}")
    if topk_ids.device != x.device or topk_weights.device != x.device:
        raise ValueError("topk_ids and topk_weights must be on the device of x")
    if out is not None:
        check_out(out, "out", (T, H), x.dtype, x.device)
    return T, H, E, I, k


def moe(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k routed mixture of gated-MLP experts (SwiGLU), the MoE layer's expert part.

    x [T, H]; w_gate, w_up [E, I, H] and w_down [E, H, I] (nn.Linear layout, x's dtype);
    topk_ids int64 [T, k] in [0, E) (a row may name one expert twice: both slots count);
    topk_weights float [T, k] (the caller normalises and scales them).
    Returns [T, H] in x's dtype:
    ``out[t] = Σ_j topk_weights[t, j] · w_down[e] @ (silu(w_gate[e] @ x[t]) * (w_up[e] @ x[t]))``
    with ``e = topk_ids[t, j]``. ``out=`` receives the result (a buffer of exactly its shape, dtype
    and device).

    Math in float32 (float64 inputs: float64), rounded once to x's dtype. Grouped by expert:
    the T·k slots are sorted by expert and only the experts that received slots run, each as
    three matmuls over its rows, so the work is that of the routed slots, never T·E. ONE host
    read per call (the per-expert row counts, which also checks every id is in [0, E)); an id
    outside raises ValueError. Each used expert's weights are cast to float32 once per call
    (16-bit weights).
    """
    T, H, E, I, k = check_moe_args(x, w_gate, w_up, w_down, topk_ids, topk_weights, out)
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = torch.zeros(T, H, dtype=acc, device=x.device)
    N = T * k
    if N > 0:
        flat = topk_ids.reshape(N)
        sorted_ids, order = torch.sort(flat, stable=True)       # slots grouped by expert
        offsets = torch.searchsorted(sorted_ids, torch.arange(E + 1, device=x.device))
        bounds = torch.cat((offsets, sorted_ids[[0, -1]])).tolist()   # the one host read
        lo, hi = bounds[E + 1], bounds[E + 2]
        if lo < 0 or hi >= E:
            raise ValueError(f"topk_ids holds experts {lo}..{hi}, but there are {E}")
        tok = order // k                                        # token of each sorted slot
        w = topk_weights.reshape(N).index_select(0, order).to(acc)
        xa = x.to(acc)
        for e in range(E):
            a, b = bounds[e], bounds[e + 1]
            if a == b:
                continue
            t_e = tok[a:b]
            xe = xa.index_select(0, t_e)                        # [n_e, H]
            h = F.silu(xe @ w_gate[e].to(acc).T) * (xe @ w_up[e].to(acc).T)   # [n_e, I]
            # a token listed twice (one expert in two of its slots) is added twice
            y.index_add_(0, t_e, (h @ w_down[e].to(acc).T).mul_(w[a:b, None]))
    if out is not None:
        return out.copy_(y)
    return y.to(x.dtype)
