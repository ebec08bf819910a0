"""One config-driven transformer for LLaDA, Dream, openPangu-Diffusion and LLaDA2.x.

The families differ only in config fields (docs/algorithms.md §7, docs/models.md): q/k/v and o
biases, GQA, RoPE θ, RMS eps, logit shift, attention mode (bidirectional, context-causal or
block-causal), position ids with left padding; LLaDA2 adds QK-norm, RoPE on part of each head and a
mixture-of-experts feed-forward (sigmoid router with an expert-score bias, grouped top-k, shared
experts; the experts run in `psd_kernels.moe`). The forward takes an explicit boolean attention
mask for the tokens it runs and, optionally, a KV cache of other canvas positions; it returns
logits only for the query slice the caller asks for, because the engine needs predictions for one
block, not the whole canvas.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .parallel import TensorParallel, check_divisible, row_parallel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # statistics in fp32 whatever the weight dtype, as the reference implementations do
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(pos: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos/sin [R, 1, T, D] for integer positions [R, T] (rotate-half convention); `head_dim` is
    the rotary dimension D, which may be only the first part of a head (partial rotary)."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=pos.device).float() / head_dim))
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
    """

    layers: list
    key_mask: torch.Tensor
    row_map: torch.Tensor | None = None
    plan: object = field(default=None, repr=False, compare=False)
    own_masked: bool = False

    def __post_init__(self):
        if self.row_map is not None and self.plan is None:
            import psd_kernels

            self.plan = psd_kernels.plan_rows(self.row_map, self.key_mask.shape[0])

    @property
    def length(self) -> int:
        return self.key_mask.shape[1]

    def for_rows(self, row_map: torch.Tensor | None, own_masked: bool = False) -> "KVCache":
        return KVCache(self.layers, self.key_mask, row_map, own_masked=own_masked)


def attend(q, k_own, v_own, own_mask, cache_kv=None, cache: KVCache | None = None, all_own: bool = False):
    """Attention of q [R, H, T, D] over own keys [R, Hkv, T, D] (mask [R, 1, T, T]) and cached keys.

    Without a row map each row has its own cache row: one SDPA over cache + own keys. With a row
    map (drafts sharing a sequence's cache), ONE `psd_kernels.shared_prefix_attention` call per
    layer serves every row against ONE copy of its cache row (the call's `RowPlan`, made once per
    call, says which), so a K-draft call never materialises K copies of a cache row and never
    reads anything back to the host; `all_own` says every query may see every own key
    (bidirectional models, unless the cache says its call's own keys hold padding:
    `KVCache.own_masked`), else the kernel applies the own mask too (`own_mask`).
    """
    if cache_kv is None or cache.length == 0:
        return F.scaled_dot_product_attention(q, k_own, v_own, attn_mask=own_mask, enable_gqa=True)
    k_c, v_c = cache_kv
    km = cache.key_mask
    R, _, T, _ = q.shape
    if cache.row_map is None:
        k = torch.cat((k_c, k_own), dim=2)
        v = torch.cat((v_c, v_own), dim=2)
        mask = torch.cat((km[:, None, None, :].expand(R, 1, T, km.shape[1]), own_mask.expand(R, 1, T, T)), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    import psd_kernels

    om = None if all_own and not cache.own_masked else own_mask[:, 0]          # [R or 1, T, T]
    return psd_kernels.shared_prefix_attention(q, k_c, v_c, k_own, v_own, shared_mask=km, own_mask=om,
                                               row_map=cache.plan)[0]


class Attention(nn.Module):
    """q/k/v/o projections; under tensor parallelism (`tp`) this rank's whole heads and kv-heads
    (q/k/v column-parallel) and the matching input slice of o (row-parallel, summed over ranks)."""

    def __init__(self, c: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        world = tp.world if tp is not None else 1
        self.tp = tp
        self.h, self.hkv, self.d = c.num_heads // world, c.num_kv_heads // world, c.head_dim
        self.bidirectional = c.attention == "bidirectional"   # own keys all visible in cached calls
        self.wq = nn.Linear(c.hidden_size, self.h * self.d, bias=c.qkv_bias)
        self.wk = nn.Linear(c.hidden_size, self.hkv * self.d, bias=c.qkv_bias)
        self.wv = nn.Linear(c.hidden_size, self.hkv * self.d, bias=c.qkv_bias)
        self.wo = nn.Linear(self.h * self.d, c.hidden_size, bias=c.o_bias)
        # QK-norm (LLaDA2): one RMSNorm over each head's features, shared by the heads, before RoPE
        self.q_norm = RMSNorm(self.d, c.rms_eps) if c.qk_norm else None
        self.k_norm = RMSNorm(self.d, c.rms_eps) if c.qk_norm else None

    def forward(self, x, cos, sin, own_mask, cache_kv, cache):
        R, T, _ = x.shape
        q = self.wq(x).view(R, T, self.h, self.d).transpose(1, 2)       # [R, H, T, D]
        k = self.wk(x).view(R, T, self.hkv, self.d).transpose(1, 2)     # [R, Hkv, T, D]
        v = self.wv(x).view(R, T, self.hkv, self.d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        o = attend(q, k, v, own_mask, cache_kv, cache, all_own=self.bidirectional)
        return row_parallel(self.wo, o.transpose(1, 2).reshape(R, T, self.h * self.d), self.tp), (k, v)


class MLP(nn.Module):
    """SwiGLU; under tensor parallelism gate/up are column-parallel and down row-parallel."""

    def __init__(self, c: ModelConfig, tp: TensorParallel | None = None, size: int | None = None):
        super().__init__()
        self.tp = tp
        inner = (size or c.intermediate_size) // (tp.world if tp is not None else 1)
        self.w_gate = nn.Linear(c.hidden_size, inner, bias=False)
        self.w_up = nn.Linear(c.hidden_size, inner, bias=False)
        self.w_down = nn.Linear(inner, c.hidden_size, bias=False)

    def forward(self, x):
        return row_parallel(self.w_down, F.silu(self.w_gate(x)) * self.w_up(x), self.tp)


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
        import psd_kernels

        flat = x.reshape(-1, x.shape[-1])                                                 # [R·T, H]
        ids, w = self.route(flat)
        y = psd_kernels.moe(flat, self.w_gate, self.w_up, self.w_down, ids, w).view_as(x)
        return y if self.shared is None else y + self.shared(x)


class Block(nn.Module):
    def __init__(self, c: ModelConfig, tp: TensorParallel | None = None, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.attn = Attention(c, tp)
        self.ffn_norm = RMSNorm(c.hidden_size, c.rms_eps)
        self.mlp = MoE(c) if c.is_moe_layer(index) else MLP(c, tp)

    def forward(self, x, cos, sin, own_mask, cache_kv, cache):
        a, kv = self.attn(self.attn_norm(x), cos, sin, own_mask, cache_kv, cache)
        x = x + a
        return x + self.mlp(self.ffn_norm(x)), kv


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

    @property
    def dtype(self) -> torch.dtype:
        return self.tok_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.tok_embeddings.weight.device

    def compiled(self) -> "Transformer":
        """A twin of this model whose transformer blocks run under `torch.compile` (dynamic shapes,
        so the rows and lengths of a call do not recompile), sharing every parameter with it; the
        model itself stays eager. Made once per model; the first calls of each shape compile."""
        twin = self.__dict__.get("_compiled_twin")
        if twin is None:
            twin = Transformer.__new__(Transformer)
            twin.__dict__.update(self.__dict__)
            twin._modules = dict(self._modules)            # a new module table: the blocks differ
            twin.layers = nn.ModuleList(torch.compile(b, dynamic=True) for b in self.layers)
            self.__dict__["_compiled_twin"] = twin          # a plain attribute: no module registration
        return twin

    def lm_head(self, h: torch.Tensor) -> torch.Tensor:
        h = self.norm(h)
        return F.linear(h, self.tok_embeddings.weight) if self.output is None else self.output(h)

    def forward(
        self,
        ids: torch.Tensor,                 # [R, T] token ids of the positions this call runs
        pos: torch.Tensor,                 # [R, T] RoPE positions
        own_mask: torch.Tensor,            # [R or 1, 1, T, T] bool, True = may attend
        cache: KVCache | None = None,      # other positions' keys/values
        out_start: int = 0,                # logits for query positions [out_start, out_start + out_len)
        out_len: int | None = None,
        return_kv: bool = False,
    ):
        """Returns (logits [R, out_len, V], per-layer (k, v) of the T positions if return_kv)."""
        x = self.tok_embeddings(ids)
        cos, sin = rope_cos_sin(pos, self.config.rotary_dim or self.config.head_dim, self.config.rope_theta, x.dtype)
        kvs = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, cos, sin, own_mask, cache.layers[i] if cache is not None else None, cache)
            if return_kv:
                kvs.append(kv)
        out_len = x.shape[1] - out_start if out_len is None else out_len
        logits = self.lm_head(x[:, out_start:out_start + out_len])
        return logits, (kvs if return_kv else None)


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
    q_idx: torch.Tensor,       # [Tq] canvas indices of the queries
    k_idx: torch.Tensor,       # [Tk] canvas indices of the keys
) -> torch.Tensor:
    """Boolean mask [R, 1, Tq, Tk] (True = may attend) for the model's attention mode.

    bidirectional: every non-pad key. context_causal (openPangu): the context (prompt and
    finished blocks, index < block_start) attends causally; generation blocks attend to the
    whole context and bidirectionally within their own block, never to later blocks.
    block_causal (LLaDA2): position i sees position j iff j's block is not after i's, blocks of
    `config.attention_block` counted from each sequence's first token (its position id), so the
    prompt fills the first blocks and a left-padded row sees what it would unpadded; the
    canvas arguments (prompt_len, block_start, block_len) play no part. A query always sees
    itself, so a pad row never has an empty softmax (NaN would leak through 0·NaN).
    """
    i, j = q_idx[:, None], k_idx[None, :]
    kv = valid[:, k_idx][:, None, None, :]                         # [R, 1, 1, Tk]
    if config.attention == "bidirectional":
        m = kv.expand(valid.shape[0], 1, len(q_idx), len(k_idx))
    elif config.attention == "block_causal":
        blk = torch.div(position_ids(config, valid), config.attention_block, rounding_mode="floor")   # [R, N]
        m = kv & (blk[:, k_idx][:, None, None, :] <= blk[:, q_idx][:, None, :, None])
    else:
        ctx_j = j < block_start
        blk = lambda p: torch.div(p - prompt_len, block_len, rounding_mode="floor")  # noqa: E731
        allowed = (ctx_j & ((j <= i) | (i >= block_start))) | ((i >= block_start) & (j >= block_start) & (blk(i) == blk(j)))
        m = kv & allowed[None, None]
    return m | (i == j)[None, None]
