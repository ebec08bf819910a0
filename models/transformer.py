"""One config-driven transformer for LLaDA, Dream, openPangu-Diffusion, LLaDA2.x and DiffusionGemma.

The families differ only in config fields (docs/algorithms.md §7, docs/models.md): q/k/v and o
biases, GQA, RoPE θ, RMS eps, logit shift, attention mode (bidirectional, context-causal or
block-causal), position ids with left padding; LLaDA2 adds QK-norm, RoPE on part of each head and a
mixture-of-experts feed-forward (sigmoid router with an expert-score bias, grouped top-k, shared
experts; the experts run in `psd_kernels.moe`). DiffusionGemma (the Gemma 4 text backbone) adds
sliding-window and full-attention layers of different shapes, v-norm, sandwich norms, scaled
embeddings, logit soft-capping, softmax-routed GeGLU experts beside a dense MLP, and two call modes
of the same weights: encoder (causal, writes KV) and decoder (a bidirectional canvas over the
encoder's KV, with the self-conditioning input). The forward takes an explicit boolean attention
mask for the tokens it runs and, optionally, a KV cache of other canvas positions; it returns
logits only for the query slice the caller asks for, because the engine needs predictions for one
block, not the whole canvas.
"""
from __future__ import annotations

import copy
import dataclasses
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .parallel import TensorParallel, check_divisible, row_parallel


# How the model's dense projections multiply (`Transformer.set_gemm`): "torch" is F.linear (on a CPU,
# MKL's sgemm for float32); "onednn" is oneDNN's matmul over the same weights, no copy (CPU only,
# float32 or bfloat16). The two round float32 sums in different orders (about 1e-6 apart), so
# "onednn" may change a token where two candidates nearly tie: an opt-in speed option, never the
# default (docs/results.md, "oneDNN matmuls", measures its speed and its token agreement).
GEMMS = ("torch", "onednn")


def check_gemm(kind: str, device, dtype: torch.dtype, tensor_parallel: bool = False) -> None:
    """ValueError (one line) unless a model on `device` with `dtype` weights (split over ranks when
    `tensor_parallel`) can run `kind`."""
    if kind not in GEMMS:
        raise ValueError(f"unknown gemm {kind!r}; expected one of {', '.join(GEMMS)}")
    if kind != "onednn":
        return
    if tensor_parallel:
        raise ValueError(f"--gemm {kind} is not for tensor parallelism (its ranks would round differently)")
    if torch.device(device).type != "cpu":
        raise ValueError(f"--gemm onednn runs on a CPU, not on {torch.device(device).type}")
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"--gemm onednn takes float32 or bfloat16 weights, not {str(dtype).removeprefix('torch.')}")
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        raise ValueError("--gemm onednn needs a torch built with oneDNN (torch.backends.mkldnn)")


def _onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return _onednn_linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if scale else None    # Gemma's v-norm has no weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32 whatever the weight dtype, as the reference implementations do
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return x32.to(x.dtype) if self.weight is None else self.weight * x32.to(x.dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype, turned: int | None = None):
    """cos/sin [R, 1, T, D] for integer positions [R, T] (rotate-half convention); `head_dim` is
    the rotary dimension D, which may be only the first part of a head (partial rotary). With
    `turned` (Gemma's proportional RoPE) only the first `turned` of the D/2 frequency pairs turn,
    at the frequencies of the whole head; the rest have frequency 0 (cos 1, sin 0: they pass)."""
    n = head_dim // 2 if turned is None else turned
    inv = 1.0 / (theta ** (torch.arange(0, 2 * n, 2, dtype=torch.int64, device=pos.device).float() / head_dim))
    if n < head_dim // 2:
        inv = torch.cat((inv, inv.new_zeros(head_dim // 2 - n)))
    f = pos.float()[..., None] * inv                      # [R, T, D/2]
    emb = torch.cat((f, f), dim=-1)[:, None]              # [R, 1, T, D]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    # partial rotary: the first r features turn, the rest pass unchanged
    xr = x[..., :r]
    return torch.cat((xr * cos + _rotate_half(xr) * sin, x[..., r:]), dim=-1)


@dataclass
class KVCache:
    """Keys/values (post-RoPE) of cached canvas positions, one copy per cache row.

    layers:   per layer (k, v), each [Bc, Hkv, S, D]
    key_mask: [Bc, S] bool, True where a query of the current call may attend the cached key
              (the cache is query-independent: pads and invisible suffix positions are False)
    row_map:  [R] int64 or None; the cache row serving each of the R rows of a call (drafts of
              one sequence share one cache row); None means row r uses cache row r.
    own_masked: the call's own keys may include columns a row must not see even on a
              bidirectional model (a prefix-cache call runs to the canvas end, where a row shorter
              than the batch's longest has padding): the own mask is applied, not skipped.
    plan:     the `psd_kernels.RowPlan` of row_map, made once per call when the cache is bound
              to the call's rows (not per layer); every layer's attention reads it.
    positions: [Bc, S] int64 RoPE positions of the cached keys, or None; needed only by models
              with sliding-window layers (DiffusionGemma), whose windows count positions.
    slots:    where layers and key_mask live when they are views of an owned store's memory
              (engine/kvstore.py: its rows and epoch), or None: tensors of their own.
    """

    layers: list
    key_mask: torch.Tensor
    row_map: torch.Tensor | None = None
    plan: object = field(default=None, repr=False, compare=False)
    own_masked: bool = False
    positions: torch.Tensor | None = None
    slots: object = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if self.row_map is not None and self.plan is None:
            import psd_kernels

            self.plan = psd_kernels.plan_rows(self.row_map, self.key_mask.shape[0])

    @property
    def length(self) -> int:
        return self.key_mask.shape[1]

    def for_rows(self, row_map: torch.Tensor | None, own_masked: bool = False) -> "KVCache":
        return KVCache(self.layers, self.key_mask, row_map, own_masked=own_masked, positions=self.positions,
                       slots=self.slots)


def attend(q, k_own, v_own, own_mask, cache_kv=None, cache: KVCache | None = None, all_own: bool = False,
           scale: float | None = None, cache_mask: torch.Tensor | None = None):
    """Attention of q [R, H, T, D] over own keys [R, Hkv, T, D] (mask [R, 1, T, T]) and cached keys.

    Without a row map each row has its own cache row: one SDPA over cache + own keys. With a row
    map (drafts sharing a sequence's cache), ONE `psd_kernels.shared_prefix_attention` call per
    layer serves every row against ONE copy of its cache row (the call's `RowPlan`, made once per
    call, says which), so a K-draft call never materialises K copies of a cache row and never
    reads anything back to the host; `all_own` says every query may see every own key
    (bidirectional models, unless the cache says its call's own keys hold padding:
    `KVCache.own_masked`), else the kernel applies the own mask too (`own_mask`). `scale` is the
    q.k scale (None: 1/sqrt(D)); `cache_mask` [R, 1, T, S], where a cached key's visibility
    depends on the query (a sliding window in an encoder call), replaces the cache's key mask.
    """
    sc = {} if scale is None else {"scale": scale}
    if cache_kv is None or cache.length == 0:
        return F.scaled_dot_product_attention(q, k_own, v_own, attn_mask=own_mask, enable_gqa=True, **sc)
    k_c, v_c = cache_kv
    km = cache.key_mask
    R, _, T, _ = q.shape
    if cache.row_map is None:
        k = torch.cat((k_c, k_own), dim=2)
        v = torch.cat((v_c, v_own), dim=2)
        cm = km[:, None, None, :].expand(R, 1, T, km.shape[1]) if cache_mask is None else cache_mask
        mask = torch.cat((cm, own_mask.expand(R, 1, T, T)), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True, **sc)
    if cache_mask is not None:
        raise ValueError("a per-query cache mask (a sliding window in an encoder call) needs one cache row per row "
                         "(row_map None)")
    import psd_kernels

    om = None if all_own and not cache.own_masked else own_mask[:, 0]          # [R or 1, T, T]
    return psd_kernels.shared_prefix_attention(q, k_c, v_c, k_own, v_own, shared_mask=km, own_mask=om,
                                               row_map=cache.plan, **sc)[0]


@dataclass(frozen=True)
class Tokens:
    """The real positions of an [rows, width] call (`Transformer.forward(tokens=)`): `index` [M], their
    flat indices into rows · width. Every per-token layer runs on those M only; attention, which
    needs each row's layout, scatters them back (padding: zeros, never visible keys)."""

    rows: int
    width: int
    index: torch.Tensor

    @classmethod
    def of(cls, real: torch.Tensor) -> "Tokens":
        """From real [R, T] bool (one host read: how many)."""
        return cls(real.shape[0], real.shape[1], real.reshape(-1).nonzero()[:, 0])

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """[R, T, F] -> [M, F]."""
        return t.reshape(self.rows * self.width, -1).index_select(0, self.index)

    def scatter(self, t: torch.Tensor) -> torch.Tensor:
        """[M, F] -> [R, T, F], zeros at padding."""
        out = t.new_zeros(self.rows * self.width, t.shape[-1]).index_copy_(0, self.index, t)
        return out.view(self.rows, self.width, -1)


class Attention(nn.Module):
    """q/k/v/o projections; under tensor parallelism (`tp`) this rank's whole heads and kv-heads
    (q/k/v column-parallel) and the matching input slice of o (row-parallel, summed over ranks)."""

    def __init__(self, c: ModelConfig, tp: TensorParallel | None = None, index: int = 0):
        super().__init__()
        world = tp.world if tp is not None else 1
        shape = c.layer(index)              # this layer's head dim, kv heads, window, RoPE (DiffusionGemma: per type)
        self.tp = tp
        self.h, self.hkv, self.d = c.num_heads // world, shape.kv_heads // world, shape.head_dim
        self.window, self.rope, self.scale = shape.window, shape.rope, c.attention_scale
        self.bidirectional = c.attention == "bidirectional"   # own keys all visible in cached calls
        self.wq = nn.Linear(c.hidden_size, self.h * self.d, bias=c.qkv_bias)
        self.wk = nn.Linear(c.hidden_size, self.hkv * self.d, bias=c.qkv_bias)
        # DiffusionGemma's full-attention layers have no v projection: v is k's projection (own norm, no RoPE)
        self.wv = None if shape.k_is_v else nn.Linear(c.hidden_size, self.hkv * self.d, bias=c.qkv_bias)
        self.wo = nn.Linear(self.h * self.d, c.hidden_size, bias=c.o_bias)
        # QK-norm (LLaDA2, DiffusionGemma): one RMSNorm over each head's features, shared by the heads, before RoPE
        self.q_norm = RMSNorm(self.d, c.rms_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(self.d, c.rms_eps) if c.qk_norm else None
        self.v_norm = RMSNorm(self.d, c.rms_eps, scale=False) if c.v_norm else None

    def qkv(self, x, cos, sin, tokens: Tokens | None = None):
        """q [R, H, T, D], k and v [R, Hkv, T, D] of x [R, T, hidden], or with `tokens` [M, hidden]: the
        call's real positions only (the projections, norms and RoPE run on those, `cos`/`sin` [M, 1, 1,
        D]; q, k and v come back in the [R, T] layout, padding zero, as attention needs)."""
        R, T = (x.shape[0], x.shape[1]) if tokens is None else (tokens.rows, tokens.width)
        # [rows, heads, positions, D]: [R, H, T, D], or one position per real token [M, H, 1, D]
        heads = (lambda t, n: t.view(R, T, n, self.d).transpose(1, 2)) if tokens is None else \
            (lambda t, n: t.view(-1, n, 1, self.d))
        kp = self.wk(x)
        q, k = heads(self.wq(x), self.h), heads(kp, self.hkv)
        v = heads(kp if self.wv is None else self.wv(x), self.hkv)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.v_norm is not None:
            v = self.v_norm(v)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if tokens is not None:       # attention needs each row's layout: scatter (padding zero)
            q, k, v = (tokens.scatter(t.reshape(t.shape[0], -1)).view(R, T, -1, self.d).transpose(1, 2)
                       for t in (q, k, v))
        return q, k, v

    def attend(self, q, k, v, own_mask, cache_kv, cache, cache_mask=None, decoder: bool = False):
        """`attend` with this layer's scale and own-key visibility: o [R, T, H·D]."""
        R, _, T, _ = q.shape
        o = attend(q, k, v, own_mask, cache_kv, cache, all_own=self.bidirectional or decoder, scale=self.scale,
                   cache_mask=cache_mask)
        return o.transpose(1, 2).reshape(R, T, self.h * self.d)

    def out(self, o, tokens: Tokens | None = None):
        """The o projection of attention's o [R, T, H·D]: [R, T, hidden] (with `tokens` [M, hidden])."""
        return row_parallel(self.wo, o if tokens is None else tokens.gather(o), self.tp)


# the gated MLPs' activation: SwiGLU, or GeGLU with the tanh approximation (Gemma's gelu_pytorch_tanh)
ACTIVATIONS = {"silu": F.silu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """SwiGLU; under tensor parallelism gate/up are column-parallel and down row-parallel."""

    def __init__(self, c: ModelConfig, tp: TensorParallel | None = None, size: int | None = None):
        super().__init__()
        self.tp = tp
        inner = (size or c.intermediate_size) // (tp.world if tp is not None else 1)
        self.w_gate = nn.Linear(c.hidden_size, inner, bias=False)
        self.w_up = nn.Linear(c.hidden_size, inner, bias=False)
        self.w_down = nn.Linear(inner, c.hidden_size, bias=False)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, x):
        return row_parallel(self.w_down, self.act(self.w_gate(x)) * self.w_up(x), self.tp)


class MoE(nn.Module):
    """LLaDA2's mixture-of-experts feed-forward: each token's k routed SwiGLU experts, weighted,
    plus the shared experts every token runs (one SwiGLU of their summed size).

    Routing (`route`) as the checkpoints were trained, in fp32: scores = sigmoid(router · x); the
    choice ranks scores + expert_bias (the bias steers which experts are chosen, never how much
    they count); experts form n_group equal groups, each group scored by the sum of its two best
    biased scores, and only the topk_group best groups stay eligible; the k best eligible experts
    are chosen; their weights are the unbiased scores, renormalised to sum 1 (norm_topk_prob),
    times routed_scaling_factor. The experts are stacked [E, I, H] / [E, H, I] parameters (the
    loader stacks the checkpoint's per-expert tensors) run by `psd_kernels.moe`."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
        self.k, self.groups, self.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        self.scale, self.renormalise = c.routed_scaling_factor, c.norm_topk_prob
        self.router = nn.Linear(H, E, bias=False)
        self.expert_bias = nn.Parameter(torch.zeros(E)) if c.expert_bias else None
        self.w_gate = nn.Parameter(torch.empty(E, I, H))
        self.w_up = nn.Parameter(torch.empty(E, I, H))
        self.w_down = nn.Parameter(torch.empty(E, H, I))
        self.shared = MLP(c, size=c.shared_intermediate_size) if c.shared_intermediate_size else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k] int64, weights [T, k] fp32) of tokens x [T, H]."""
        scores = torch.sigmoid(F.linear(x.float(), self.router.weight.float()))          # [T, E]
        choice = scores if self.expert_bias is None else scores + self.expert_bias.float()
        if self.topk_group < self.groups:
            T, E = choice.shape
            grouped = choice.view(T, self.groups, E // self.groups)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices   # [T, topk_group]
            keep = torch.zeros(T, self.groups, dtype=torch.bool, device=x.device).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(E // self.groups, dim=1), float("-inf"))
        ids = choice.topk(self.k, dim=-1).indices
        w = scores.gather(1, ids)
        if self.renormalise:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * self.scale

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])                                                 # [R·T, H]
        ids, w = self.route(flat)
        y = routed_experts(flat, self.w_gate, self.w_up, self.w_down, ids, w).view_as(x)
        return y if self.shared is None else y + self.shared(x)


def routed_experts(x, w_gate, w_up, w_down, ids, weights):
    """`psd_kernels.moe`; once a model is compiled, outside its graphs (`_experts_out_of_graphs`)."""
    import psd_kernels

    return psd_kernels.moe(x, w_gate, w_up, w_down, ids, weights)


def _experts_out_of_graphs() -> None:
    """`--compile` runs the routed experts eagerly: their slots grouped per expert are sized by a host
    read of the counts, and inductor generated code that failed on those sizes (NameError on a size
    symbol) when a batch's rows routed differently; the rest of each block compiles as before. Done
    when the first model is compiled, not at import (torch.compiler brings in dynamo: seconds of
    start-up)."""
    global routed_experts
    if not getattr(routed_experts, "out_of_graphs", False):
        routed_experts = torch.compiler.disable(routed_experts)
        routed_experts.out_of_graphs = True


def grouped_experts(x, w_gate, w_up, w_down, ids, weights, act):
    """`psd_kernels.moe`'s math with another activation (GeGLU), in plain torch: out[t] =
    Σ_j weights[t, j] · w_down[e] @ (act(w_gate[e] @ x[t]) * (w_up[e] @ x[t])), e = ids[t, j], fp32
    accumulation rounded once to x's dtype. Slots are grouped by expert and only the experts that
    received some run (one host read of the per-expert counts). The kernel is SwiGLU only; this is
    DiffusionGemma's path until it takes an activation."""
    T, k = ids.shape
    E = w_gate.shape[0]
    y = torch.zeros(T, x.shape[-1], dtype=torch.float32, device=x.device)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    tok, w = order // k, weights.reshape(-1)[order].float()
    start = 0
    for e, n in enumerate(counts):
        if n:
            t = tok[start:start + n]
            xe = x.index_select(0, t).float()
            h = act(xe @ w_gate[e].float().T) * (xe @ w_up[e].float().T)
            y.index_add_(0, t, (h @ w_down[e].float().T) * w[start:start + n, None])
            start += n
    return y.to(x.dtype)


class SoftmaxMoE(nn.Module):
    """Gemma 4's (DiffusionGemma's) routed experts, run beside each layer's dense MLP.

    The router reads the layer's residual stream x: scores = W_router · (rmsnorm(x) * router_scale
    / sqrt(H)) without a norm weight; softmax over the E experts in fp32; the k best, their
    probabilities renormalised to sum 1, times a learned per-expert scale. The experts (GeGLU,
    stacked [E, I, H] / [E, H, I]; the checkpoint's fused gate_up is split at load as views) run on
    in_norm(x), and their sum goes through out_norm."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        E, I, H = c.num_experts, c.moe_intermediate_size, c.hidden_size
        self.k, self.act = c.num_experts_per_tok, ACTIVATIONS[c.hidden_act]
        self.router_norm = RMSNorm(H, c.rms_eps, scale=False)
        self.router = nn.Linear(H, E, bias=False)
        self.router_scale = nn.Parameter(torch.ones(H))
        self.expert_scale = nn.Parameter(torch.ones(E))
        self.in_norm = RMSNorm(H, c.rms_eps)
        self.out_norm = RMSNorm(H, c.rms_eps)
        self.w_gate = nn.Parameter(torch.empty(E, I, H))
        self.w_up = nn.Parameter(torch.empty(E, I, H))
        self.w_down = nn.Parameter(torch.empty(E, H, I))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(expert ids [T, k] int64, weights [T, k] fp32) of tokens x [T, H]."""
        h = self.router_norm(x) * self.router_scale * x.shape[-1] ** -0.5
        probs = F.softmax(self.router(h), dim=-1, dtype=torch.float32)
        w, ids = probs.topk(self.k, dim=-1)
        return ids, w / w.sum(-1, keepdim=True) * self.expert_scale[ids]

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])                                                 # [R·T, H]
        ids, w = self.route(flat)
        y = grouped_experts(self.in_norm(flat), self.w_gate, self.w_up, self.w_down, ids, w, self.act)
        return self.out_norm(y.view_as(x))


class Block(nn.Module):
    def __init__(self, c: ModelConfig, tp: TensorParallel | None = None, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.attn = Attention(c, tp, index)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        gemma = c.is_moe_layer(index) and c.moe_router == "softmax"
        self.mlp = MoE(c) if c.is_moe_layer(index) and not gemma else MLP(c, tp)
        self.sandwich = c.sandwich_norm
        if c.sandwich_norm:      # Gemma: the attention's and the feed-forward's outputs are normed too
            self.post_attn_norm = RMSNorm(c.hidden_size, c.rms_eps)
            self.post_ffn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        # Gemma 4: routed experts beside the dense MLP, whose output has its own norm
        self.moe = SoftmaxMoE(c) if gemma else None
        self.mlp_norm = RMSNorm(c.hidden_size, c.rms_eps) if gemma else None
        self.scalars = c.encoder_decoder
        if c.encoder_decoder:    # DiffusionGemma: the block's output scale, one per mode (the checkpoint has both)
            self.enc_scalar = nn.Parameter(torch.ones(1))
            self.dec_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, cos, sin, own_mask, cache_kv, cache, cache_mask=None, decoder: bool = False,
                tokens: Tokens | None = None):
        """x [R, T, hidden] (with `tokens`: [M, hidden], the real positions only) through the block:
        (x, this call's (k, v)). Three parts: `before_attention` and `after_attention` hold every
        parameter and are what `Transformer.compiled` compiles; attention itself runs between them."""
        q, k, v = self.before_attention(x, cos, sin, tokens)
        o = self.attn.attend(q, k, v, own_mask, cache_kv, cache, cache_mask, decoder)
        return self.after_attention(x, o, decoder, tokens), (k, v)

    def before_attention(self, x, cos, sin, tokens: Tokens | None = None):
        return self.attn.qkv(self.attn_norm(x), cos, sin, tokens)

    def after_attention(self, x, o, decoder: bool = False, tokens: Tokens | None = None):
        a = self.attn.out(o, tokens)
        if not self.sandwich:
            x = x + a
            return x + self.mlp(self.ffn_norm(x))
        x = x + self.post_attn_norm(a)
        f = self.mlp(self.ffn_norm(x))
        if self.moe is not None:
            f = self.mlp_norm(f) + self.moe(x)
        x = x + self.post_ffn_norm(f)
        if self.scalars:
            x = x * (self.dec_scalar if decoder else self.enc_scalar)
        return x


_RECOMPILE_LIMIT = "torch._dynamo hit config.%s"      # dynamo's warning, when a function reaches its limit
_warned_recompile_limit = False


def _recompile_limit_warning(record) -> bool:
    """A logging filter of dynamo's warnings: its five lines saying that one of this file's compiled
    functions reached the recompile limit become one line, printed once (stderr); the others pass."""
    global _warned_recompile_limit
    args = record.args if isinstance(record.args, tuple) else ()
    if not str(record.msg).startswith(_RECOMPILE_LIMIT) or len(args) < 3 or __file__ not in str(args[2]):
        return True
    if not _warned_recompile_limit:
        _warned_recompile_limit = True
        where = str(args[2]).split("'")
        print(f"warning: --compile: torch.compile reached its recompile limit ({args[1]}) in the model's blocks ("
              f"{where[1] if len(where) > 2 else args[2]}); calls of shapes it compiled no graph for run eagerly "
              f"from now on (TORCH_LOGS=recompiles names them)", file=sys.stderr)
    return False


def _warn_at_recompile_limit() -> None:
    """Install `_recompile_limit_warning` on dynamo's logger (once)."""
    import logging

    log = logging.getLogger("torch._dynamo.convert_frame")
    if _recompile_limit_warning not in log.filters:
        log.addFilter(_recompile_limit_warning)


def _compiled_blocks(layers, c: ModelConfig) -> list:
    """`_compiled_block` of each of `layers`, the model's. Each kind of layer (attention shape, mixture
    of experts or not) has its own compiled region per part, which its layers share, with its own
    graphs and its own recompile limit (`isolate_recompiles`: another model compiled in the process
    neither shares nor counts against it)."""
    parts = {}
    for i in range(len(layers)):
        kind = (c.layer(i), c.is_moe_layer(i))
        if kind not in parts:
            parts[kind] = tuple(torch.compile(f, dynamic=True, isolate_recompiles=True)
                                for f in (Block.before_attention, Block.after_attention))
    return [_compiled_block(b, parts[c.layer(i), c.is_moe_layer(i)]) for i, b in enumerate(layers)]


def _compiled_block(block: Block, parts: tuple) -> Block:
    """A shallow copy of `block` (the same submodules and parameters) whose parts before and after
    attention run `parts`: `Block.before_attention` and `Block.after_attention` under `torch.compile`."""
    before, after = parts
    twin = copy.copy(block)
    twin._modules = dict(block._modules)
    twin.before_attention = lambda *a: before(block, *a)
    # attention's output, laid out as each kernel left it (a view, strides), as one contiguous tensor
    # of its own: the graph is not specialised on the layout
    twin.after_attention = lambda x, o, *a: after(block, x, o.contiguous().detach(), *a)
    return twin


class SelfConditioning(nn.Module):
    """DiffusionGemma's decoder input: the canvas embeddings plus a gated MLP of the soft
    embeddings of the previous step's logits (softmax(logits) @ E, scaled as token embeddings),
    through an RMSNorm without weight. Without previous logits (the first step) the soft
    embeddings are zero, so the MLP adds exactly 0 and only the norm remains."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = MLP(c)
        self.out_norm = RMSNorm(c.hidden_size, c.rms_eps, scale=False)

    def forward(self, x, logits, rows, embedding: torch.Tensor, scale: float):
        if logits is None:
            return self.out_norm(x)
        soft = (logits.softmax(-1, dtype=torch.float32).to(embedding.dtype) @ embedding) * x.new_tensor(scale)
        if rows is not None:                 # rows without a previous step: zero soft embeddings
            soft = soft * rows.to(soft.dtype)[:, None, None]
        return self.out_norm(x + self.mlp(self.norm(soft)))


class Transformer(nn.Module):
    """The model; with `tp` (models/parallel.py) this rank's shard of it: every block split over
    the ranks, embeddings, norms and the LM head whole, so `forward` returns the full logits on
    every rank (every rank must call it with the same inputs)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        if tp is not None and tp.world <= 1:
            tp = None
        if tp is not None:
            check_divisible(config, tp.world)
        self.config = config
        self.tp = tp
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, tp, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_eps)
        self.output = None if config.tie_embeddings else nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.self_cond = SelfConditioning(config) if config.encoder_decoder else None
        self.gemm = "torch"
        self._linear = F.linear                  # the tied LM head's product (set_gemm)
        self.unpad: bool | None = None           # whole-canvas calls on real positions only (`unpads`; None: auto)

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def set_gemm(self, kind: str) -> "Transformer":
        """Run every dense projection (q/k/v/o, the MLPs, the LM head; not the MoE experts or routers)
        with `kind` (GEMMS); returns the model. "onednn" needs a CPU model of float32 or bfloat16
        weights and a torch built with oneDNN; each problem is one ValueError line."""
        check_gemm(kind, self.device, self.dtype, self.tp is not None)
        routers = {id(m.router) for m in self.modules() if isinstance(m, (MoE, SoftmaxMoE))}   # stay as they are
        for m in self.modules():
            if isinstance(m, nn.Linear) and id(m) not in routers:
                if kind == "onednn":
                    m.forward = _onednn_forward.__get__(m)      # this module's forward, no weight copy
                else:
                    m.__dict__.pop("forward", None)
        self.gemm, self._linear = kind, (_onednn_linear if kind == "onednn" else F.linear)
        return self

    @property
    def unpads(self) -> bool:
        """Should whole-canvas calls with padding pass `tokens=` (real positions only)? By default
        (`unpad` None) on a CPU: the GEMMs are the time there, and one host read (`Tokens.of`) costs
        nothing; not on a GPU (padded rows are cheap there, a read drains the queue). Never on the
        compiled twin (a new token count per call is a new shape)."""
        if self.__dict__.get("_compiled", False):
            return False
        return self.device.type == "cpu" if self.unpad is None else self.unpad

    def compiled(self) -> "Transformer":
        """A twin of this model whose transformer blocks run under `torch.compile`, sharing every
        parameter with it; the model itself stays eager. Made once per model.

        What compiles is each block's parts before and after attention (`_compiled_block`), with
        dynamic shapes; attention runs its kernels eagerly between them. Its inputs vary in more than
        shape: with a cache or not, one cache row per row or drafts sharing one (the row plan's layout:
        drafts per sequence, rows already grouped, cache rows no row reads), own keys masked or not;
        dynamo guarded on each and compiled a graph per mix, past its recompile limit (8) in a batch
        whose rows join and leave, after which new mixes ran eagerly. The parts compile for rows 1 or
        more and positions 1 or more: at most 4 graphs each per kind of layer (`_compiled_blocks`),
        whatever the batch, cache or draft depth (tests/test_static_rows.py). Should dynamo still
        reach its limit, one warning line says so (`_recompile_limit_warning`)."""
        twin = self.__dict__.get("_compiled_twin")
        if twin is None:
            _experts_out_of_graphs()
            _warn_at_recompile_limit()
            twin = Transformer.__new__(Transformer)
            twin.__dict__.update(self.__dict__)
            twin._modules = dict(self._modules)            # a new module table: the blocks differ
            twin.layers = nn.ModuleList(_compiled_blocks(self.layers, self.config))
            twin.__dict__["_compiled"] = True
            self.__dict__["_compiled_twin"] = twin          # a plain attribute: no module registration
        return twin

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        logits = self._linear(h, self.tok_embeddings.weight) if self.output is None else self.output(h)
        cap = self.config.logit_softcap
        if cap is None:
            return logits
        return torch.tanh(logits.float() / cap) * cap      # in fp32, returned fp32 (as transformers' Gemma)

    def forward(
        self,
        ids: torch.Tensor,                 # [R, T] token ids of the positions this call runs
        pos: torch.Tensor,                 # [R, T] RoPE positions
        own_mask: torch.Tensor,            # [R or 1, 1, T, T] bool, True = may attend
        cache: KVCache | None = None,      # other positions' keys/values
        out_start: int | torch.Tensor = 0,   # logits for query positions [out_start, out_start + out_len);
                                           # a LongTensor [R]: each row's own start (out_len then required;
                                           # positions past T repeat the last)
        out_len: int | None = None,
        return_kv: bool = False,
        *,
        decoder: bool = False,             # encoder-decoder models (DiffusionGemma): run the decoder mode
        self_cond: torch.Tensor | None = None,       # decoder mode: the previous step's logits [R, T, V]
        self_cond_rows: torch.Tensor | None = None,  # [R] bool: rows False use none (their first step)
        tokens: Tokens | None = None,      # the real positions (`Tokens.of(real [R, T])`): the others are padding,
                                           # run by no projection or MLP (their keys/values and logits: zeros)
    ):
        """Returns (logits [R, out_len, V], per-layer (k, v) of the T positions if return_kv).

        Encoder-decoder models (docs/models.md, DiffusionGemma) have two modes of the same weights:
        encoder (default; a causal `own_mask`, KV written with return_kv, sliding windows counted
        back from each query) and decoder (`decoder=True`: the canvas, a bidirectional `own_mask`,
        over the encoder's KV in `cache`, whose sliding-window layers see the last window - 1
        cached positions; the input embeddings take the self-conditioning signal of `self_cond`).
        Sliding-window layers need `cache.positions` when a cache is given."""
        c = self.config
        if tokens is not None and (decoder or self_cond is not None):
            raise ValueError("tokens= (real positions only) is for encoder calls: the decoder mode runs whole canvases")
        x = self.tok_embeddings(ids if tokens is None else tokens.gather(ids[..., None])[:, 0])
        if c.embedding_scale != 1.0:
            x = x * x.new_tensor(c.embedding_scale)        # the scale rounded to the weights' dtype, as Gemma's
        if decoder or self_cond is not None or self_cond_rows is not None:
            if self.self_cond is None:
                raise ValueError(f"a {c.family} model has no decoder mode (self-conditioning): only encoder-decoder "
                                 f"models (diffusion_gemma) do")
            if not decoder:
                raise ValueError("self_cond / self_cond_rows are inputs of the decoder mode (decoder=True)")
            x = self.self_cond(x, self_cond, self_cond_rows, self.tok_embeddings.weight, c.embedding_scale)
        rope_pos = pos if tokens is None else tokens.gather(pos[..., None])    # real positions only: [M, 1]
        if not c.layer_types:       # one attention shape for every layer: one RoPE, the caller's masks
            cos, sin = rope_cos_sin(rope_pos, c.rotary_dim or c.head_dim, c.rope_theta, x.dtype)
        ropes, windows, kvs = {}, {}, []
        for i, layer in enumerate(self.layers):
            kv_i = cache.layers[i] if cache is not None else None
            if not c.layer_types:
                x, kv = layer(x, cos, sin, own_mask, kv_i, cache, tokens=tokens)
            else:
                spec, w = layer.attn.rope, layer.attn.window
                if spec not in ropes:
                    ropes[spec] = rope_cos_sin(rope_pos, spec[0], spec[1], x.dtype, spec[2])
                if w not in windows:
                    windows[w] = self._window(w, pos, own_mask, cache, decoder)
                m_own, m_cache, cm = windows[w]
                x, kv = layer(x, *ropes[spec], m_own, kv_i, m_cache, cm, decoder, tokens)
            if return_kv:
                kvs.append(kv)
        x = _out_window(x if tokens is None else tokens.scatter(x), out_start, out_len)
        return self.lm_head(x), (kvs if return_kv else None)

    @staticmethod
    def _window(window, pos, own_mask, cache, decoder):
        """(own mask, cache, per-query cache mask or None) of the layers with `window` (None: the
        caller's). Encoder: query i sees key j only if pos_i - pos_j < window (own and cached keys,
        as transformers' sliding-window causal mask). Decoder: the canvas sees itself whole and the
        last window - 1 cached positions, what transformers' sliding cache layers keep of the
        encoded sequence (DynamicSlidingWindowLayer)."""
        if window is None:
            return own_mask, cache, None
        own = own_mask if decoder else own_mask & ((pos[:, :, None] - pos[:, None, :]) < window)[:, None]
        if cache is None or cache.length == 0:
            return own, cache, None
        if cache.positions is None:
            raise ValueError("a model with sliding-window layers needs the cached keys' positions (KVCache.positions)")
        kp = cache.positions
        if decoder:
            last = kp.masked_fill(~cache.key_mask, torch.iinfo(kp.dtype).min).amax(-1, keepdim=True)   # [Bc, 1]
            return own, dataclasses.replace(cache, key_mask=cache.key_mask & (last - kp < window - 1)), None
        cm = cache.key_mask[:, None, None, :] & ((pos[:, :, None] - kp[:, None, :]) < window)[:, None]
        return own, cache, cm


def _out_window(x: torch.Tensor, out_start: int | torch.Tensor, out_len: int | None) -> torch.Tensor:
    """x [R, T, H] at the query positions whose logits a call returns: [out_start, out_start +
    out_len), or from one start per row (a LongTensor [R]: a packed call, engine/cache.py)."""
    if isinstance(out_start, torch.Tensor):
        at = (out_start[:, None] + torch.arange(out_len, device=x.device)).clamp(0, x.shape[1] - 1)
        return x.gather(1, at[..., None].expand(-1, -1, x.shape[2]))
    out_len = x.shape[1] - out_start if out_len is None else out_len
    return x[:, out_start:out_start + out_len]


# ---------------------------------------------------------------------- masks and positions
def position_ids(config: ModelConfig, valid: torch.Tensor) -> torch.Tensor:
    """RoPE positions [R, N] for canvases with left padding (valid [R, N] bool)."""
    if config.position_mode == "cumsum":
        return (valid.long().cumsum(-1) - 1).clamp_min(0)
    return torch.arange(valid.shape[1], device=valid.device).expand_as(valid)


def attention_mask(
    config: ModelConfig,
    valid: torch.Tensor,       # [R, N] bool, False at left padding
    prompt_len: int,           # canvas index where generation starts (padded prompt length)
    block_start: int,          # canvas index of the current block
    block_len: int,
    q_idx: torch.Tensor,       # [Tq] canvas indices of the queries, or [R, Tq] per row (>= N: padding)
    k_idx: torch.Tensor,       # [Tk] canvas indices of the keys, or [R, Tk]
) -> torch.Tensor:
    """Boolean mask [R, 1, Tq, Tk] (True = may attend) for the model's attention mode.

    bidirectional: every non-pad key. context_causal (openPangu): the context (prompt and
    finished blocks, index < block_start) attends causally; generation blocks attend to the
    whole context and bidirectionally within their own block, never to later blocks.
    causal (DiffusionGemma's encoder mode): j <= i. block_causal (LLaDA2): position i sees
    position j iff j's block is not after i's, blocks of
    `config.attention_block` counted from each sequence's first token (its position id), so the
    prompt fills the first blocks and a left-padded row sees what it would unpadded; the
    canvas arguments (prompt_len, block_start, block_len) play no part. A query always sees
    itself, so a pad row never has an empty softmax (NaN would leak through 0·NaN).
    """
    rows = q_idx.dim() == 2                # per-row indices [R, T]: a packed call (engine/cache.py)
    N = valid.shape[1]
    if rows:                               # columns >= N are padding of the call: never visible
        i, j = q_idx[:, :, None], k_idx[:, None, :]
        at = lambda t, idx: t.gather(1, idx.clamp(max=N - 1))          # noqa: E731
        kv = (at(valid, k_idx) & (k_idx < N))[:, None, None, :]
    else:
        i, j = q_idx[:, None], k_idx[None, :]
        at = lambda t, idx: t[:, idx]                                   # noqa: E731
        kv = valid[:, k_idx][:, None, None, :]                         # [R, 1, 1, Tk]
    pair = lambda t: t[:, None] if rows else t[None, None]             # noqa: E731  [Tq, Tk] -> [R|1, 1, Tq, Tk]
    if config.attention == "bidirectional":
        m = kv.expand(valid.shape[0], 1, q_idx.shape[-1], k_idx.shape[-1])
    elif config.attention == "causal":          # DiffusionGemma's encoder mode (its decoder: all keys visible)
        m = kv & pair(j <= i)
    elif config.attention == "block_causal":
        blk = torch.div(position_ids(config, valid), config.attention_block, rounding_mode="floor")   # [R, N]
        m = kv & (at(blk, k_idx)[:, None, None, :] <= at(blk, q_idx)[:, None, :, None])
    else:
        ctx_j = j < block_start
        blk = lambda p: torch.div(p - prompt_len, block_len, rounding_mode="floor")  # noqa: E731
        allowed = (ctx_j & ((j <= i) | (i >= block_start))) | ((i >= block_start) & (j >= block_start) & (blk(i) == blk(j)))
        m = kv & pair(allowed)
    return m | pair(i == j)
