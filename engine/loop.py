"""The one decoding loop (ALGORITHMS.md §3) shared by every method.

    out = call([s])                                   # first call of a block
    while the block of s has masked positions:
        s = commit(s, π(s, out), out)                 # stage 1 (spatial)
        stop if an EOS is committed with nothing masked before it (§5)
        drafts = s with out.pred at the ranks of each graph node     # stage 2 (no model call)
        outs = call(drafts)                           # stage 3: ONE batched call, root included
        s, out = deepest accepted draft and its verifier output

With a root-only draft graph stage 2 is the identity and stage 3 is the plain next call, so the
plain policies are this loop, not a copy of it. Rows of a batch advance block by block together;
inside a block each row takes only the calls it needs (finished rows are left out of a call),
so per-sequence counts equal a single-sequence run. Cache modes (§6) change only what a call
runs: `none` the whole canvas, `prefix` the block and what follows over cached keys/values of
the prefix, `dual` the block alone over a cached prefix and suffix. Drafts of one sequence share
one cache row. A step reads back a constant number of small tensors (which rows still need a
call); never one value per position, draft or node.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

import psd_kernels
from models import KVCache, Transformer, attention_mask, position_ids

from . import acceptance
from .config import DecodeConfig
from .errors import InputError
from .policies import rank_of


@dataclass
class SequenceResult:
    """What one prompt produced, and how (ALGORITHMS.md §5)."""

    token_ids: list[int]          # generated ids up to and including the stop token
    calls: int                    # model calls this sequence took part in
    tokens: int                   # len(token_ids)
    tpf: float                    # tokens per forward call
    seconds: float                # wall time of the whole batch
    rows_per_call: float          # canvases evaluated per call for this sequence (drafts > 1)
    stopped: bool                 # a stop token ended it before gen_length
    commit_call: list[int]        # per generated token: index (1-based) of the call whose output committed it
    commit_step: list[int]        # per generated token: step inside its block (0-based)
    commit_source: list[int]      # per generated token: 0 = stage 1, 1 = an accepted draft
    commit_block: list[int]       # per generated token: its block index
    accepted_depth: dict[int, int] = field(default_factory=dict)  # |S_k*| of the kept node per verification call
    text: str | None = None

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("text", "token_ids", "calls", "tokens", "tpf", "seconds", "rows_per_call",
                                           "stopped", "commit_call", "commit_step", "commit_source", "commit_block")}
        d["accepted_depth"] = {str(k): v for k, v in sorted(self.accepted_depth.items())}
        return d


def check_prompts(mc, dc: DecodeConfig, prompts) -> list[list[int]]:
    """Validate a batch of prompts (token-id lists) against a model config; returns int lists."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError("prompts must be a non-empty list of token-id lists")
    out = []
    for n, p in enumerate(prompts):
        ids = [int(t) for t in p]
        if not ids:
            raise InputError(f"prompt {n} is empty")
        if any(not 0 <= t < mc.vocab_size for t in ids):
            raise InputError(f"prompt {n} holds a token id outside the vocabulary of size {mc.vocab_size}")
        if mc.mask_token_id in ids:
            raise InputError(f"prompt {n} contains the mask token (id {mc.mask_token_id})")
        if len(ids) + dc.gen_length > mc.max_length:
            raise InputError(f"prompt {n} of {len(ids)} tokens plus gen length {dc.gen_length} exceeds "
                             f"the model's maximum length {mc.max_length}")
        out.append(ids)
    return out


class Decoder:
    """Decodes batches of prompts (token id lists) with one model and one `DecodeConfig`."""

    def __init__(self, model: Transformer, config: DecodeConfig | None = None, trace=None):
        """`trace(rows, block, step, ranks, pred)`, if given, is called after every stage 1 with the
        rows (batch indices) that go on, the block index, the step index just taken, the rank of
        every block position in σ [A, W] (masked positions first) and the predictions [A, W]
        drafts would use (offline tools such as graph calibration; it may sync freely)."""
        self.trace = trace
        self.model = model
        self.mc = model.config
        self.dc = (config or DecodeConfig()).validate()
        self.policy = self.dc.policy()
        self.graph = self.dc.draft_graph()
        dev = model.device
        self.stop_ids = torch.tensor(self.mc.stop_token_ids, device=dev)
        self.node_ranks = self.graph.node_ranks(dev)                               # [K, D]
        self.node_size = torch.tensor([len(s) for s in self.graph.nodes], device=dev)
        self.gen = torch.Generator(device=dev).manual_seed(self.dc.seed)

    def check_prompts(self, prompts) -> list[list[int]]:
        return check_prompts(self.mc, self.dc, prompts)

    # ------------------------------------------------------------------ model calls
    def _predict(self, logits: torch.Tensor):
        """Top-1 token and confidence [R, L] from logits [R, L, V]."""
        if self.dc.conf_dtype == "float64":
            logits = logits.double()
        noise = None
        if self.dc.temperature > 0:
            u = torch.rand(logits.shape, generator=self.gen, device=logits.device, dtype=torch.float64)
            noise = -torch.log(-torch.log(u.clamp_min(1e-300)))       # standard Gumbel, LLaDA's float64 draw
        return psd_kernels.top1(logits, self.mc.mask_token_id, score=self.dc.score,
                                temperature=self.dc.temperature, noise=noise)

    def _full_call(self, x, valid, pos, lo, return_kv):
        """Whole canvas; logits for the block (read at i - shift)."""
        n = x.shape[1]
        idx = torch.arange(n, device=x.device)
        mask = attention_mask(self.mc, valid, self.P, lo, self.L, idx, idx)
        return self.model(x, pos, mask, out_start=lo - self.mc.logit_shift, out_len=self.W, return_kv=return_kv)

    def _query_span(self, lo: int, n: int) -> tuple[int, int]:
        """Canvas span a cached call runs: the active window (the block, or ETE's blocks), one
        position before it for a logit shift, and (prefix mode, bidirectional models) the suffix."""
        hi = lo + self.W
        q_hi = n if (self.dc.cache == "prefix" and self.mc.attention == "bidirectional") else hi
        return lo - self.mc.logit_shift, q_hi

    def _block_start(self, x, valid, pos, lo):
        """First call of a block; with a cache mode it also builds the block's cache."""
        if self.dc.cache == "none":
            logits, _ = self._full_call(x, valid, pos, lo, False)
            return self._predict(logits), None
        logits, kvs = self._full_call(x, valid, pos, lo, True)
        n = x.shape[1]
        q_lo, q_hi = self._query_span(lo, n)
        dev = x.device
        cache_idx = torch.arange(q_lo, device=dev)
        if self.dc.cache == "dual" and self.mc.attention == "bidirectional":
            # the suffix is invisible to a context-causal block, so only bidirectional models cache it
            cache_idx = torch.cat((cache_idx, torch.arange(q_hi, n, device=dev)))
        layers = [(k[:, :, cache_idx], v[:, :, cache_idx]) for k, v in kvs]
        probe = torch.tensor([lo], device=dev)   # any block query: cache visibility is query-independent
        key_mask = attention_mask(self.mc, valid, self.P, lo, self.L, probe, cache_idx)[:, 0, 0]
        return self._predict(logits), KVCache(layers, key_mask)

    def _call(self, x, valid, pos, lo, cache: KVCache | None, cache_rows: torch.Tensor | None):
        """One model call on rows x [R, N] (drafts already written into their block)."""
        if cache is None:
            logits, _ = self._full_call(x, valid, pos, lo, False)
            return self._predict(logits)
        q_lo, q_hi = self._query_span(lo, x.shape[1])
        q_idx = torch.arange(q_lo, q_hi, device=x.device)
        own = attention_mask(self.mc, valid, self.P, lo, self.L, q_idx, q_idx)
        logits, _ = self.model(x[:, q_lo:q_hi], pos[:, q_lo:q_hi], own, cache=cache.for_rows(cache_rows),
                               out_start=0, out_len=self.W)
        return self._predict(logits)

    # ------------------------------------------------------------------ stopping
    def _stopped(self, blk, masked):
        """(stopped [R] bool, first stop position in the block [R]) per ALGORITHMS.md §5."""
        L = blk.shape[1]
        idx = torch.arange(L, device=blk.device)
        is_stop = torch.isin(blk, self.stop_ids) & ~masked
        first = torch.where(is_stop, idx, L).min(-1).values
        masked_before = (masked & (idx < first[:, None])).any(-1)
        return (first < L) & ~masked_before, first

    # ------------------------------------------------------------------ stage 2 + 3
    def _drafts(self, blk, masked, pred, conf):
        """Drafts [R, K, W] (psd_kernels.assemble_drafts: ranks by confidence, index ops only),
        node membership [R, K, W] and valid [R, K] (every rank of the node exists this step)."""
        if len(self.graph) == 1:
            return blk[:, None], torch.zeros_like(blk, dtype=torch.bool)[:, None], torch.ones_like(masked[:, :1])
        drafts, valid = psd_kernels.assemble_drafts(blk, masked, pred, conf.float(), self.node_ranks)
        # a drafted position was masked (mask id) and now holds a prediction (never the mask id)
        return drafts, drafts != blk[:, None], valid

    def _accept(self, drafts, in_node, valid, vpred, vconf, step):
        """Which draft each row keeps; returns (k* [R], step index of k* [R])."""
        dc, mask_id = self.dc, self.mc.mask_token_id
        if dc.selection == "best_score":
            best, bstep, _ = acceptance.best_score(mask_id, drafts, valid, vconf, step)
        elif dc.selection == "draft_conf":
            tau = 0.9 if dc.threshold is None else dc.threshold
            best, bstep, _ = acceptance.threshold_only(tau, self.graph, mask_id, drafts, in_node, valid, vpred, vconf, step)
        else:
            best, bstep, _ = acceptance.hierarchical(self.policy, self.graph, mask_id, drafts, in_node, valid, vpred,
                                                     vconf, step, exact=dc.exact)
        return best, bstep

    # ------------------------------------------------------------------ the loop
    @torch.no_grad()
    def generate(self, prompts) -> list[SequenceResult]:
        prompts = self.check_prompts(prompts)
        t0 = time.perf_counter()
        mc, dc, dev = self.mc, self.dc, self.model.device
        B, G, L = len(prompts), dc.gen_length, dc.block_length
        P = max(len(p) for p in prompts)
        N = P + G
        self.P, self.L = P, L
        pad = mc.pad_token_id if mc.pad_token_id is not None else mc.eos_token_id
        x = torch.full((B, N), pad, dtype=torch.long, device=dev)
        valid = torch.zeros(B, N, dtype=torch.bool, device=dev)
        for b, p in enumerate(prompts):
            x[b, P - len(p):P] = torch.tensor(p, device=dev)
            valid[b, P - len(p):] = True
        x[:, P:] = mc.mask_token_id
        pos = position_ids(mc, valid)

        calls = torch.zeros(B, dtype=torch.long, device=dev)
        rows = torch.zeros(B, dtype=torch.long, device=dev)
        stop_at = torch.full((B,), -1, dtype=torch.long, device=dev)
        c_call = torch.full((B, G), -1, dtype=torch.long, device=dev)
        c_step = torch.full((B, G), -1, dtype=torch.long, device=dev)
        c_src = torch.zeros(B, G, dtype=torch.long, device=dev)
        depth_hist = torch.zeros(B, self.graph.depth + 1, dtype=torch.long, device=dev)
        K = len(self.graph)

        for b in range(dc.num_blocks):
            lo = P + b * L
            self.W = W = min(dc.window_blocks * L, N - lo)      # active window: the block, or ETE's blocks
            hi = lo + W
            # rows still generating whose block is not already complete (ETE may have filled it)
            todo = (stop_at < 0) & (x[:, lo:lo + L] == mc.mask_token_id).any(-1)
            sub = todo.nonzero()[:, 0]                          # one sync per block
            if sub.numel() == 0:
                if not (stop_at < 0).any():
                    break
                continue
            g0 = lo - P
            xs, vs, ps = x[sub], valid[sub], pos[sub]
            (pred, conf), cache = self._block_start(xs, vs, ps, lo)
            S = sub.numel()
            calls_s, rows_s = calls[sub] + 1, rows[sub] + 1
            step = torch.zeros(S, dtype=torch.long, device=dev)
            stop_s = torch.full((S,), -1, dtype=torch.long, device=dev)
            pending = torch.ones(S, dtype=torch.bool, device=dev)
            cc, cs, csrc = c_call[sub, g0:g0 + W], c_step[sub, g0:g0 + W], c_src[sub, g0:g0 + W]
            hist = depth_hist[sub]
            while True:
                # ---- stage 1: the policy commits on the latest verifier output
                blk = xs[:, lo:hi]
                masked = blk == mc.mask_token_id
                commit = self.policy.select(conf, masked, step) & pending[:, None]
                blk = torch.where(commit, pred, blk)
                cc = torch.where(commit, calls_s[:, None], cc)
                cs = torch.where(commit, step[:, None], cs)
                step = step + pending.long()
                masked = blk == mc.mask_token_id
                stopped, first = self._stopped(blk, masked)
                stopped &= pending
                stop_s = torch.where(stopped, g0 + first, stop_s)
                pending = pending & ~stopped & masked[:, :L].any(-1)
                xs[:, lo:hi] = blk
                act = pending.nonzero()[:, 0]                  # one small read-back per step
                if act.numel() == 0:
                    break
                if self.trace is not None:
                    self.trace(sub[act], b, step[act] - 1, rank_of(conf[act], masked[act]), pred[act])
                # ---- stage 2: drafts from the last predictions (index ops only)
                drafts, in_node, nvalid = self._drafts(blk[act], masked[act], pred[act], conf[act])
                pair = nvalid.reshape(-1).nonzero()[:, 0]      # (row, node) pairs to verify
                prow = act[pair // K]                         # the sequence (cache row) of each verified draft
                # ---- stage 3: one batched call over every draft of every active row
                xr = xs[prow].clone()
                xr[:, lo:hi] = drafts.reshape(-1, W)[pair]
                vp, vc = self._call(xr, vs[prow], ps[prow], lo, cache, prow)
                A = act.numel()
                vpred = torch.zeros(A * K, W, dtype=vp.dtype, device=dev).index_copy_(0, pair, vp).view(A, K, W)
                vconf = torch.zeros(A * K, W, dtype=vc.dtype, device=dev).index_copy_(0, pair, vc).view(A, K, W)
                best, bstep = self._accept(drafts, in_node, nvalid, vpred, vconf, step[act])
                ar = torch.arange(A, device=dev)
                kept, kept_in = drafts[ar, best], in_node[ar, best]
                # bookkeeping for the tokens the kept draft committed (made by the previous call)
                cc[act] = torch.where(kept_in, calls_s[act, None], cc[act])
                cs[act] = torch.where(kept_in, step[act, None], cs[act])
                csrc[act] = torch.where(kept_in, 1, csrc[act])
                hist[act] = hist[act].scatter_add(1, self.node_size[best][:, None], torch.ones_like(best)[:, None])
                calls_s[act] += 1
                rows_s[act] += nvalid.sum(-1)
                xs[act, lo:hi] = kept
                pred[act], conf[act], step[act] = vpred[ar, best], vconf[ar, best], bstep
                if K > 1:   # a kept draft changed s: apply the stopping rule again (§3)
                    kb = xs[act, lo:hi]
                    km = kb == mc.mask_token_id
                    st, fi = self._stopped(kb, km)
                    stop_s[act] = torch.where(st, g0 + fi, stop_s[act])
                    pending[act] = ~st & km[:, :L].any(-1)
            x[sub] = xs
            calls[sub], rows[sub], stop_at[sub] = calls_s, rows_s, stop_s
            c_call[sub, g0:g0 + W], c_step[sub, g0:g0 + W], c_src[sub, g0:g0 + W] = cc, cs, csrc
            depth_hist[sub] = hist

        seconds = time.perf_counter() - t0
        return self._results(x[:, P:], calls, rows, stop_at, c_call, c_step, c_src, depth_hist, seconds)

    def _results(self, gen, calls, rows, stop_at, c_call, c_step, c_src, depth_hist, seconds):
        gen, calls, rows, stop_at = gen.cpu(), calls.cpu(), rows.cpu(), stop_at.cpu()
        c_call, c_step, c_src, depth_hist = c_call.cpu(), c_step.cpu(), c_src.cpu(), depth_hist.cpu()
        out = []
        for b in range(gen.shape[0]):
            n = int(stop_at[b]) + 1 if stop_at[b] >= 0 else gen.shape[1]
            ncall = int(calls[b])
            hist = {d: int(c) for d, c in enumerate(depth_hist[b].tolist()) if c}
            r = SequenceResult(
                token_ids=gen[b, :n].tolist(), calls=ncall, tokens=n, tpf=n / max(ncall, 1), seconds=seconds,
                rows_per_call=int(rows[b]) / max(ncall, 1), stopped=bool(stop_at[b] >= 0),
                commit_call=c_call[b, :n].tolist(), commit_step=c_step[b, :n].tolist(),
                commit_source=c_src[b, :n].tolist(), commit_block=[i // self.dc.block_length for i in range(n)],
                accepted_depth=hist)
            out.append(r)
        return out


def generate(model: Transformer, prompts, config: DecodeConfig | None = None, **options) -> list[SequenceResult]:
    """Decode a batch of prompts (lists of token ids); `options` override fields of `config`."""
    cfg = DecodeConfig(**options) if config is None else config
    if config is not None and options:
        from dataclasses import replace

        cfg = replace(config, **options)
    return Decoder(model, cfg).generate(prompts)


def aggregate(results: list[SequenceResult]) -> dict:
    """Statistics over many sequences: totals, TPF = all tokens / all calls, rows per call, the
    summed accepted-depth histogram and the share of tokens from accepted drafts."""
    calls = sum(r.calls for r in results)
    tokens = sum(r.tokens for r in results)
    rows = sum(r.rows_per_call * r.calls for r in results)
    hist: dict[int, int] = {}
    for r in results:
        for d, c in r.accepted_depth.items():
            hist[d] = hist.get(d, 0) + c
    drafted = sum(sum(r.commit_source) for r in results)
    return {"sequences": len(results), "tokens": tokens, "calls": calls, "tpf": tokens / max(calls, 1),
            "rows_per_call": rows / max(calls, 1), "draft_token_share": drafted / max(tokens, 1),
            "accepted_depth": {str(d): c for d, c in sorted(hist.items())},
            "stopped": sum(r.stopped for r in results)}
