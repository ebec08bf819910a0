"""The one decoding loop (docs/algorithms.md §3) shared by every method.

    out = call([s])                                   # first call of a block
    while the block of s has masked positions:
        s = commit(s, π(s, out), out)                 # stage 1 (spatial)
        stop if an EOS is committed with nothing masked before it (§5)
        drafts = s with out.pred at the ranks of each graph node     # stage 2 (no model call)
        outs = call(drafts)                           # stage 3: ONE batched call, root included
        s, out = deepest accepted draft and its verifier output

With a root-only draft graph stage 2 is the identity and stage 3 is the plain next call, so the
plain policies are this loop, not a copy of it. What a method runs in each stage comes from its
entry in the method table (engine/methods.py); what a call runs, from the cache mode
(engine/cache.py). Rows of a batch advance block by block together; inside a block each row takes
only the calls it needs (finished rows are left out of a call), so per-sequence counts equal a
single-sequence run. A step reads back a constant number of small tensors (which rows still need
a call); never one value per position, draft or node.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import shutil
import threading
import time

import torch

import psd_kernels
from models import Transformer, position_ids

from .ahead import carry_over, draft_across, first_output, keep_ahead
from .budget import DraftBudget, shape_key
from .cost import host_key
from .cache import CACHE_MODES, Window
from .config import DecodeConfig, check_prompts, check_seeds, exact_int
from .errors import DecodingError, InputError
from .graph import make_plan
from .graphs import graphed
from .progress import apply_stopping, generated, guard_progress, raise_failure, settle_edits
from .policies import policy_key, policy_select, rank_of
from .results import SequenceResult, StepOutput, StreamUpdate, aggregate, collect_results
from .sampling import Sampler
from .state import Batch, BatchState, BlockRun, join, layout, new_batch, pad_columns, state_of
from .uniform import UniformNoise, for_model

__all__ = ["Decoder", "SequenceResult", "StreamUpdate", "aggregate", "check_prompts", "generate"]


def _one_at_a_time(method):
    """A Decoder with a KV cache has one store (engine/kvstore.py): threads sharing it take turns in
    `step`, `join`, `leave` and a whole `generate` (so a thread pool's `generate` calls each decode
    as alone, one after another), instead of one releasing the store while another writes it.
    Interleaving the steps of two batches is still refused (KVStore.check). Cache none: no lock."""
    @functools.wraps(method)
    def one_at_a_time(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return one_at_a_time


class Decoder:
    """Decodes batches of prompts (token id lists) with one model and one `DecodeConfig`."""

    def __init__(self, model: Transformer, config: DecodeConfig | None = None, trace=None, cost_model=None):
        """`trace(rows, block, step, ranks, pred)`, if given, is called after every stage 1 with the
        rows (batch indices) that go on, the block index, the step index just taken, the rank of
        every block position in σ [A, W] (masked positions first) and the predictions [A, W]
        drafts would use (offline tools such as graph calibration; it may sync freely).
        `cost_model` (engine.cost.CostModel) fixes the call cost `--draft-budget auto` plans with."""
        if not isinstance(model, Transformer):
            raise InputError(f"model must be a loaded model (models.load_model or engine.load), got "
                             f"{type(model).__name__}" + (" (a path: load it first)" if isinstance(model, str) else ""))
        if model.device.type == "meta":
            raise InputError("the model's weights are on the meta device (shapes only, no values): load them "
                             "(models.load_model) or materialise them on a real device first")
        _check_config(config)
        self.trace = trace
        self.model = model
        self.mc = model.config
        self.dc = for_model(self.mc, config or DecodeConfig()).validate()   # DiffusionGemma: uniform noise
        self.policy = self.dc.policy()
        self.graph = self.dc.draft_graph()
        if self.dc.compile and model.device.type == "cpu" and not any(map(shutil.which, ("c++", "g++", "clang++"))):
            raise InputError("--compile on CPU needs a C++ compiler on PATH (torch inductor builds C++ kernels)")
        self.cache_mode = CACHE_MODES[self.dc.cache](model.compiled() if self.dc.compile else model)
        # one KV store: its steps are one thread's at a time (_one_at_a_time); no store, no lock
        self._lock = threading.RLock() if self.dc.cache != "none" else contextlib.nullcontext()
        if self.dc.cuda_graphs:                # verification calls replayed from CUDA graphs (engine/graphs.py)
            self.cache_mode = graphed(self.cache_mode, self.dc, model.device)
        if self.dc.cross_block and self.mc.attention != "bidirectional":
            raise InputError(f"--cross-block needs a bidirectional model (a {self.mc.attention.replace('_', '-')} "
                             f"block never sees the next)")
        dev = model.device
        self.stop_ids = torch.tensor(self.mc.stop_token_ids, device=dev)
        selection = lambda g: self.dc.selection(self.policy, g, self.mc.mask_token_id)   # noqa: E731
        self.full_plan = make_plan(self.graph, list(range(len(self.graph))), selection, dev)  # every node
        self.budget = None if self.dc.draft_budget != "auto" else DraftBudget(
            self.graph, selection, dev, cost_model, self.dc.cost_profile, self.dc.cache,
            key=(shape_key(self.mc), *host_key(dev), str(model.tok_embeddings.weight.dtype), model.gemm, self.dc.cache,
                 self.dc.block_length, getattr(model, "tp", None) and model.tp.world, bool(self.dc.compile),
                 bool(self.dc.cuda_graphs), bool(self.dc.static_rows)))
        self.sampler = Sampler(self.dc, self.mc, dev)      # logits -> tokens: the one home of sampling
        # uniform-noise models (no mask token): the paradigm's stages replace the masked ones (engine/uniform.py)
        self.uniform = UniformNoise(model, self.dc, self.mc) if self.mc.mask_token_id is None else None
        if self.uniform is not None and self.dc.sampler == "row":
            raise InputError("--sampler row is for masked models: a uniform-noise model draws its batch as transformers "
                             "does (docs/algorithms.md §9)")

    def check_prompts(self, prompts) -> list[list[int]]:
        return check_prompts(self.mc, self.dc, prompts)

    # ------------------------------------------------------------------ batch and blocks
    def _new_batch(self, prompts, gen_lengths: list[int] | None = None, seeds: list | None = None) -> Batch:
        """A batch of (checked) prompts; `gen_lengths`: one per prompt (default: the config's);
        `seeds`: one per prompt for `--sampler row` (default: the config's seed + the row)."""
        lengths = gen_lengths or [self.dc.gen_length] * len(prompts)
        batch = new_batch(self.mc, prompts, lengths, self.dc.block_length, self.graph.depth, len(self.graph),
                          self.model.device, self.dc.top_logprobs, aligned=self.dc.aligned(self.mc))
        batch.policy_state = self.policy.init_state(prompts, self.dc.seed, batch.gen_start, batch.gen_len,
                                                    batch.x.shape[1])          # None: a stateless policy
        batch.gens = self.sampler.generators(
            [self.dc.seed + i if s is None else s for i, s in enumerate(seeds or [None] * len(prompts))])
        return batch

    def _window(self, after: int) -> tuple[int, int]:
        """(width, ahead) of a block window with `after` canvas columns from its first on: the
        block, or ETE's blocks, up to the canvas's end; --cross-block: the next block where there is one."""
        L = self.dc.block_length
        width = min(self.dc.window_blocks * L, after)
        return width, L if self.dc.cross_block and width < after else 0

    def _open_block(self, batch: Batch, plan=None) -> BlockRun | None:
        """The rows that still generate and whose block (at the batch's cursor) is not complete
        (ETE may have filled it), after the block's first call; None if there are none. `plan`:
        the nodes to verify (rows joining an open block take its plan); default the full graph's,
        or with --draft-budget auto the budget's for this block."""
        if self.uniform is not None:
            return self.uniform.open_block(self, batch)
        L, P, N = self.dc.block_length, batch.prompt_width, batch.x.shape[1]
        lo = batch.cursor
        index = (lo - P) // L                    # the block index of the batch's first rows
        win = Window(P, L, lo, *self._window(N - lo), batch.span)
        todo = (batch.stop_at < 0) & (batch.x[:, lo:lo + L] == self.mc.mask_token_id).any(-1)
        if batch.retired is not None:
            todo &= ~batch.retired
        seqs = todo.nonzero()[:, 0]                                        # one sync per block
        if seqs.numel() == 0:
            return None
        x, valid, pos = batch.x[seqs], batch.valid[seqs], batch.pos[seqs]
        gens = Sampler.rows_of(batch.gens, seqs)                                            # --sampler row
        out = self._first_output(batch, seqs, x, valid, pos, win, gens)
        run = self._block_rows(batch, seqs, (x, valid, pos), win, index, self.full_plan if plan is None else plan,
                               out, gens)
        if self.budget is not None and plan is None:      # the nodes worth verifying in this block (one read)
            run.plan = self.budget.plan(run, lambda rows: psd_kernels.top1(self.cache_mode.call(   # no RNG draw
                run.x[rows], run.valid[rows], run.pos[rows], win, run.cache, rows), self.mc.mask_token_id))
        return run

    def _block_rows(self, batch: Batch, seqs, canvas, win: Window, index: int, plan, out, gens) -> BlockRun:
        """The open block's run of batch rows `seqs` (`canvas`: their x, valid, pos), from their first
        output `out` (`_first_output`'s)."""
        pred, conf, top, ahead, cache, fresh, step = out
        S, dev = seqs.numel(), batch.x.device
        span = slice(win.lo, win.lo + win.width + win.ahead)            # --cross-block: drafts reach the next block

        def zeros(dtype=torch.long):
            return torch.zeros(S, dtype=dtype, device=dev)

        return BlockRun(
            index=index, seqs=seqs, win=win, gen_start=batch.gen_start[seqs], x=canvas[0], valid=canvas[1],
            pos=canvas[2], cache=cache, pred=pred, conf=conf,
            calls=batch.calls[seqs] + fresh, rows=batch.rows[seqs] + fresh, step=step, stop_at=zeros() - 1,
            pending=zeros(torch.bool) | True, commits=batch.commits.take(seqs, span),
            depth_hist=batch.depth_hist[seqs], failed=zeros(), failed_call=zeros() - 1,
            nodes_hist=batch.nodes_hist[seqs], plan=plan, ahead_pred=ahead[0], ahead_conf=ahead[1],
            carry=zeros(torch.bool), ahead_step=zeros(), ahead_ok=fresh.bool(),
            policy_state=None if batch.policy_state is None else batch.policy_state.take(seqs, span), top=top,
            post=zeros() if self.policy.edits else None, gens=gens, first=zeros(torch.bool))

    def _first_output(self, batch: Batch, seqs, x, valid, pos, win, gens=None):
        """The block's first output (pred, conf [S, W], top [S, W, k, 2] or None), its next-block
        part, cache, calls made [S] and the step each row starts at (ahead.py: a draft may have
        taken steps here already)."""
        if self.dc.cross_block:
            return first_output(self, batch, seqs, x, valid, pos, win, gens)
        logits, cache = self.cache_mode.start(x, valid, pos, win)
        one = torch.ones(len(seqs), dtype=torch.long, device=x.device)
        return *self.sampler.predict(logits, batch.gen_start[seqs], win.lo, gens, valid), (None, None), cache, one, \
            one - 1

    def _close_block(self, batch: Batch, run: BlockRun) -> None:
        if self.uniform is not None:
            self.uniform.close(run)
        if (run.failed > 0).any():                                           # one read per block
            raise_failure(run)
        seqs, span = run.seqs, slice(run.win.lo, run.win.lo + run.win.width + run.win.ahead)
        if self.budget is not None:          # what this block's plan yielded: tokens, verification calls
            tokens = (run.commits.call >= 0).sum() - (batch.commits.call[seqs, span] >= 0).sum()
            self.budget.observe_block(run.plan, tokens, run.nodes_hist.sum() - batch.nodes_hist[seqs].sum())
        self.settle(batch, run)
        if self.dc.cross_block:
            carry_over(batch, run)

    @staticmethod
    def settle(batch: Batch, run: BlockRun, rows=slice(None), into=None) -> None:
        """Write the open block's state of its rows `rows` (all by default) into `batch`, at the
        batch rows `into` (default: those rows' own, `run.seqs`). A row that is done with the block
        can be settled early (engine.live answers a finished sequence in the call it ends)."""
        seqs = run.seqs[rows] if into is None else into
        span = slice(run.win.lo, run.win.lo + run.win.width + run.win.ahead)
        batch.x[seqs] = run.x[rows]
        batch.calls[seqs], batch.rows[seqs], batch.stop_at[seqs] = run.calls[rows], run.rows[rows], run.stop_at[rows]
        batch.commits.put(seqs, run.commits.take(rows), span)
        batch.depth_hist[seqs], batch.nodes_hist[seqs] = run.depth_hist[rows], run.nodes_hist[rows]
        if run.policy_state is not None:
            batch.policy_state.put(seqs, run.policy_state.take(rows), span)

    # ------------------------------------------------------------------ the three stages
    def _commit(self, run: BlockRun) -> torch.Tensor:
        """Stage 1: the policy commits on the latest verifier output; returns the masks [S, W]."""
        if self.uniform is not None:
            return self.uniform.commit(run)
        blk = run.block()
        masked = blk == self.mc.mask_token_id
        # a row with nothing masked is in an editing pass (policy.edits): it commits nothing
        bound = self.policy.step_bound(run.win.width)         # idling is bounded (Policy.step_bound)
        was_pending = run.pending.clone()
        may_idle = self.policy.may_idle(run.step) & (run.step < bound) | ~masked.any(-1)
        state = state_of(run, span=slice(0, run.win.width))
        commit = policy_select(self.policy, run.conf, masked, run.step, state) & run.pending[:, None]
        if self.budget is not None:
            self.budget.observe_commit(commit, was_pending)
        if self.policy.edits:        # token editing: committed generated tokens the same output replaces
            commit = commit | self.policy.edit(run.conf, run.pred, blk, ~masked & generated(run)) \
                & run.pending[:, None]
        W = run.win.width
        run.x[:, run.win.lo:run.win.hi] = torch.where(commit, run.pred, blk)
        run.commits.write(commit, cols=slice(0, W), call=run.calls[:, None], step=run.step[:, None],
                          prob=run.conf.double(), top=run.top)
        run.step = run.step + run.pending.long()
        run.policy_state = self.policy.update(run.policy_state, commit, run.step)     # None stays None
        if self.policy.edits:
            masked_after = settle_edits(run, self.policy, self.stop_ids, self.mc.mask_token_id, masked, commit,
                                        generated(run))
        else:
            masked_after = apply_stopping(run, self.stop_ids, self.mc.mask_token_id)
        guard_progress(run, was_pending, masked, masked_after, may_idle)
        return masked_after

    def _draft(self, run: BlockRun, act: torch.Tensor, masked: torch.Tensor):
        """Stage 2 for the active rows: drafts [A, K, W] (psd_kernels.assemble_drafts: ranks by
        the policy's draft key, index ops only), node membership [A, K, W] and valid [A, K] (every
        rank of the node exists this step). With --cross-block, W + L wide (ahead.draft_across)."""
        if run.win.ahead:
            return draft_across(run, act, masked, run.plan.node_ranks, self.stop_ids, self.mc.mask_token_id,
                                self._draft_key)
        blk, masked = run.block(act), masked[act]
        W = run.win.width
        if len(run.plan.graph) == 1:
            return blk[:, None], torch.zeros_like(blk, dtype=torch.bool)[:, None], torch.ones_like(masked[:, :1])
        key = self._draft_key(run.conf[act], masked, run.step[act], state_of(run, act, slice(0, W)))
        drafts, valid = psd_kernels.assemble_drafts(blk, masked, run.pred[act], key.float(), run.plan.node_ranks)
        # a drafted position was masked (mask id) and now holds a prediction (never the mask id)
        return drafts, drafts != blk[:, None], valid

    def _draft_key(self, conf, masked, step, state=None) -> torch.Tensor:
        """What σ ranks drafts by: the policy's own order (`Policy.draft_key`), or confidence
        whatever the policy (`--draft-order confidence`)."""
        if self.dc.draft_order == "confidence":
            return conf
        return policy_key(self.policy, conf, masked, step, state)

    def _canvases(self, run: BlockRun, act: torch.Tensor, drafts, valid):
        """The canvases of a verification call: (row, node) pairs [R'] (index into A·K), the
        sequence (cache row) of each canvas [R], and the canvases [R, N]. Every valid draft; with
        --static-rows every pair of every row of the block (an invalid node or a finished row
        repeats a root canvas; its output is never read), so R is the same for every call."""
        A, K, E = drafts.shape
        if K == 1 and not run.win.ahead and not self.dc.static_rows:    # the root alone: every row, no read
            pair = torch.arange(A, device=drafts.device)
        elif not self.dc.static_rows:
            pair = valid.reshape(-1).nonzero()[:, 0]
        else:
            drafts = torch.where(valid[..., None], drafts, drafts[:, :1])
            pair = torch.arange(len(run.seqs) * K, device=drafts.device)
            pair = torch.where(pair < A * K, pair, 0)            # the rows that are done: row 0's root
        seq_rows = act[pair // K]
        canvases = run.x[seq_rows]
        canvases[:, run.win.lo:run.win.lo + E] = drafts.reshape(-1, E)[pair]
        return pair[:A * K] if self.dc.static_rows else pair, seq_rows, canvases

    def _verify(self, run: BlockRun, act: torch.Tensor, drafts, in_node, valid, new=None) -> None:
        """Stage 3: one batched call over every valid draft of every active row, then each row
        keeps the draft its method's selection accepts, with that draft's verifier output. `new`:
        rolling rows whose block's first call this one is too."""
        A, K, E = drafts.shape                  # E = W, or W + L where drafts reach the next block
        win, dev, W = run.win, drafts.device, run.win.width
        pair, seq_rows, canvases = self._canvases(run, act, drafts, valid)
        n = len(seq_rows)
        if new is not None:                     # rolling rows: their blocks' first calls ride on this one
            seq_rows, canvases = torch.cat((seq_rows, new)), torch.cat((canvases, run.x[new]))
        logits = self.cache_mode.call(canvases, run.valid[seq_rows], run.pos[seq_rows], win, run.cache,
                                      seq_rows if run.cache_rows is None else run.cache_rows[seq_rows])
        gens = Sampler.rows_of(run.gens, seq_rows, A * K if self.dc.static_rows else None)     # --sampler row
        pred, conf, top = self.sampler.predict(logits, run.gen_start[seq_rows], win.lo, gens, run.valid[seq_rows])
        if new is not None:
            self._first_calls(run, new, (pred[n:], conf[n:], None if top is None else top[n:]))
        vpred = torch.zeros(A * K, E, dtype=pred.dtype, device=dev).index_copy_(0, pair, pred[:len(pair), :E]).view(A, K, E)
        vconf = torch.zeros(A * K, E, dtype=conf.dtype, device=dev).index_copy_(0, pair, conf[:len(pair), :E]).view(A, K, E)
        best, best_step, accepted = run.plan.select(drafts, in_node, valid, vpred, vconf, run.step[act], width=W,
                                                    state=state_of(run, act))
        if self.budget is not None:
            self.budget.observe(run.plan, accepted, valid)
        ar = torch.arange(A, device=dev)
        kept_in = in_node[ar, best]          # the tokens the kept draft committed (made by the previous call)
        first_step = torch.where(torch.arange(E, device=dev) < W, run.step[act, None], 0)   # its first step there
        drafted_conf = run.conf[act] if E == W else torch.cat((run.conf[act], run.ahead_conf[act].to(run.conf.dtype)), -1)
        run.commits.write(kept_in, act, call=run.calls[act, None], step=first_step, source=1,
                          prob=drafted_conf.double(),                        # the drafting output's
                          top=None if top is None else run.top[act])         # (no --cross-block here: E == W)
        if top is not None:
            vtop = top.new_zeros(A * K, E, *top.shape[2:]).index_copy_(0, pair, top[:len(pair), :E])
            run.top[act] = vtop.view(A, K, E, *top.shape[2:])[torch.arange(A, device=dev), best]
        run.depth_hist[act] = run.depth_hist[act].scatter_add(1, run.plan.node_size[best][:, None],
                                                              torch.ones_like(best)[:, None])
        run.nodes_hist[act, K] += 1
        run.calls[act] += 1
        run.rows[act] += valid.sum(-1)
        kept = drafts[ar, best]
        run.x[act, win.lo:win.lo + E] = kept
        run.pred[act], run.conf[act], run.step[act] = vpred[ar, best, :W], vconf[ar, best, :W], best_step
        if win.ahead:              # --cross-block: the kept draft's next-block output, and is it complete?
            keep_ahead(run, act, best, best_step, vpred, vconf, kept, self.mc.mask_token_id)
        if K > 1:      # a kept draft changed s: apply the stopping rule again (§3)
            apply_stopping(run, self.stop_ids, self.mc.mask_token_id, act)

    # ------------------------------------------------------------------ the step
    def start(self, prompts, gen_lengths: list[int] | None = None, live: bool = False,
              seeds: list | None = None, rolling: bool = False) -> BatchState:
        """A running batch of `prompts` (token-id lists; `gen_lengths`: one per prompt, default the
        config's), each checked; nothing is decoded until `step`. `live`: rows may join later
        (`join`; continuous batching, engine.live). `seeds`: each prompt's sampling seed with
        `--sampler row` (None, or None for a prompt: the config's seed + its row). `rolling`: rows
        keep their own block cursors (`rolls` says where they can): a row done with its block starts
        its next one with the next call, so the block closes (a boundary) only when every row is
        done; joins ride on the next call; leaves are at once (docs/loop.md, "Rolling rows")."""
        if rolling:
            self.require_rolls()
        if gen_lengths is not None and not isinstance(gen_lengths, (list, tuple)):
            raise InputError(f"gen_lengths must be a list (one gen length per prompt), got "
                             f"{type(gen_lengths).__name__}")
        checked = check_prompts(self.mc, self.dc, prompts, gen_length=gen_lengths)   # one per prompt, or None
        seeds = check_seeds(seeds, len(checked))
        lengths = None if gen_lengths is None else [exact_int(g) for g in gen_lengths]   # checked: numpy ints too
        return BatchState(self._new_batch(checked, lengths, seeds), live=live, rolling=rolling,
                          t0=time.perf_counter(), sent=[0] * len(checked))

    @_one_at_a_time
    def step(self, state: BatchState) -> StepOutput:
        """Advance `state` to its next model call and make it: the first call of the block at the
        batch's cursor, or one step of the open block (stage 1 on the latest output, stage 2, the one
        verification call, stage 3). Returns a `StepOutput`: `called` (its truth value) if a call
        was made; not at a block boundary (the open block had no step left and is closed, or a live
        batch has no row in the block at its cursor: rows may join and leave now) and when nothing is
        left (`done`, never set on a live batch: its caller decides when it ends); `final()`, what
        became final (read back only when asked)."""
        if state.broken:
            raise DecodingError(f"this batch cannot go on: a step stopped halfway ({state.broken}); start a new one")
        try:
            called = self._advance(state)
        except DecodingError as e:
            if e.sequence is None:
                state.broken = _said(e)
            raise                       # a row's failure: raised where the batch is whole (raise_failure)
        except BaseException as e:      # an error in a model call, an interrupt: its commits are half made
            state.broken = _said(e)
            raise
        finally:
            state.version += 1
        return StepOutput(state, called, self.mc.mask_token_id)

    def _advance(self, state: BatchState) -> bool:
        """`step`'s work on the state: True if a model call was made."""
        batch, L = state.batch, self.dc.block_length
        run = state.run
        if batch is None:                  # every row left (`leave`): nothing to decode until rows join
            state.done = not state.live
            return False
        if run is None:
            while batch.cursor < batch.end:
                run = self._open_block(batch)
                if run is not None:
                    state.run = run
                    return True
                batch.cursor += L
                if state.live:
                    return False
                if not (batch.stop_at < 0).any():
                    break
            state.done = not state.live
            if state.done:
                self.cache_mode.release()       # the batch is over: its KV memory goes (engine/kvstore.py)
            return False
        masked = self._commit(run)
        new, failed = None, False
        if state.rolling:                                # rows done with their block go on to their next
            act, new, masked, failed = self._roll(state, masked)
            batch = state.batch
        else:
            act = run.pending.nonzero()[:, 0]            # one small read-back per step
        if act.numel() == 0 and new is None:
            self._close_block(batch, run)
            batch.cursor += L
            state.run = None
            return False
        if self.trace is not None and self.uniform is None:
            key = self._draft_key(run.conf[act], masked[act], run.step[act],
                                  state_of(run, act, slice(0, run.win.width)))
            self.trace(run.seqs[act], run.index, run.step[act] - 1, rank_of(key.float(), masked[act]), run.pred[act])
        if self.uniform is not None:          # the next step's call (no drafts: docs/algorithms.md §9)
            self.uniform.call(run, act)
        elif act.numel() == 0:                # rolling rows only: their blocks' first call
            self._first_calls(run, new)
        else:
            self._verify(run, act, *self._draft(run, act, masked), new=new)
        if failed:                  # after the call: the next step commits its output, as for any step
            raise_failure(run)
        return True

    # ------------------------------------------------------------------ rolling rows (docs/loop.md)
    @property
    def rolls(self) -> bool:
        """Do the rows of a live batch keep their own block cursors ("Rolling rows", docs/loop.md): a
        row done with its block starts its next one in the next call instead of idling until the
        block's slowest row? With cache mode none on a masked model, one block per window (not ETE,
        not --cross-block), one plan for every block (not --draft-budget auto), calls of the rows
        there are (not --static-rows, --cuda-graphs) and no trace."""
        dc = self.dc
        return (self.uniform is None and dc.cache == "none" and dc.window_blocks == 1 and not dc.cross_block
                and self.budget is None and not dc.static_rows and not dc.cuda_graphs and self.trace is None)

    def require_rolls(self) -> None:
        """An InputError (one line, the reason) unless rows can roll here (`rolls`)."""
        if not self.rolls:
            raise InputError("rolling rows need cache none on a masked model without ETE, --cross-block, "
                             "--draft-budget auto, --static-rows, --cuda-graphs or a trace (Decoder.rolls)")

    def _roll(self, state: BatchState, masked: torch.Tensor):
        """After stage 1 of a rolling batch: the open block's rows that are done with their block and
        have another are settled and scrolled one block left (`Batch.scroll`), so that block is at
        the window, and await its first call. Returns (rows that verify drafts, rows awaiting their
        first call or None, the window's masks [S, W], whether a row failed: `_advance` raises it once
        the step's call is made, so the batch stays whole for its other rows)."""
        run, batch, L = state.run, state.batch, self.dc.block_length
        more = (batch.gen_start + batch.gen_len)[run.seqs] > run.win.lo + L
        roll = ~run.pending & ~run.first & (run.stop_at < 0) & (run.failed == 0) & more
        S = run.seqs.numel()
        *flags, failed = torch.cat((roll, run.pending, run.first, (run.failed > 0).any()[None])).tolist()  # one read
        rows = [i for i in range(S) if flags[i]]
        if rows:
            at = torch.tensor(rows, device=run.x.device)
            seqs = run.seqs[at]
            self.settle(batch, run, at)
            first = int(batch.valid[seqs].to(torch.uint8).argmax(1).min())        # room for them on the left?
            pos = lambda valid: position_ids(self.mc, valid)     # noqa: E731
            if first < L:
                state.batch = batch = batch.shift(L - first, 0, pos)
                self._reframe(run, batch, L - first, 0)
            batch.scroll(seqs, L, pos)
            run.put(rows, self._awaiting(batch, seqs, run))
            masked = run.block() == self.mc.mask_token_id
        dev = run.x.device
        act = torch.tensor([i for i in range(S) if flags[S + i]], dtype=torch.long, device=dev)
        new = [i for i in range(S) if flags[2 * S + i]] + rows
        return act, torch.tensor(new, device=dev) if new else None, masked, failed

    def _awaiting(self, batch: Batch, seqs: torch.Tensor, run: BlockRun) -> BlockRun:
        """Run rows of batch rows `seqs` at the open block's window with no call yet (`BlockRun.first`)."""
        S, W = seqs.numel(), run.win.width
        none = torch.zeros(S, dtype=torch.long, device=seqs.device)
        top = None if run.top is None else run.top.new_zeros(S, *run.top.shape[1:])
        out = run.pred.new_zeros(S, W), run.conf.new_zeros(S, W), top, (None, None), None, none, none
        rows = self._block_rows(batch, seqs, (batch.x[seqs], batch.valid[seqs], batch.pos[seqs]), run.win,
                                run.index, run.plan, out, Sampler.rows_of(batch.gens, seqs))
        rows.pending.zero_()
        rows.first.fill_(True)
        return rows

    def _first_calls(self, run: BlockRun, new: torch.Tensor, out=None) -> None:
        """Rolling rows `new` take their block's first output: `out` (pred, conf, top), their part of a
        call that verified other rows' drafts, or (None) a call of their own."""
        if out is None:
            logits = self.cache_mode.call(run.x[new], run.valid[new], run.pos[new], run.win, run.cache, new)
            out = self.sampler.predict(logits, run.gen_start[new], run.win.lo, Sampler.rows_of(run.gens, new),
                                       run.valid[new])
        pred, conf, top = out
        run.pred[new], run.conf[new] = pred[:, :run.win.width], conf[:, :run.win.width]
        if top is not None:
            run.top[new] = top
        run.calls[new] += 1
        run.rows[new] += 1
        run.first[new], run.pending[new] = False, True

    def _reframe(self, run: BlockRun, batch: Batch, left: int, right: int, keep_positions: bool = False) -> None:
        """The open block's rows on `batch`'s canvas, which gained `left` columns before its first
        and `right` after its last (lost, where negative: rolling rows, no cache). Positions are the
        batch's, or with `keep_positions` (left, right >= 0) those the block's cached keys were
        computed at (RoPE is relative; the new columns are padding): the next block's first call
        takes the batch's, and a fresh cache."""
        run.x = pad_columns(run.x, left, right, batch.pad_id)
        run.valid, run.gen_start = batch.valid[run.seqs], batch.gen_start[run.seqs]     # columns moved by `left`
        run.pos = torch.cat((run.pos[:, :1].expand(-1, left), run.pos, run.pos[:, -1:].expand(-1, right)), 1) \
            if keep_positions else batch.pos[run.seqs]
        run.stop_at = torch.where(run.stop_at >= 0, run.stop_at + left, run.stop_at)
        run.win = dataclasses.replace(run.win, lo=run.win.lo + left, prompt_width=run.win.prompt_width + left,
                                      span=batch.span)

    @property
    def drops_at_once(self) -> bool:
        """Do rows that leave an open block leave the batch at once (`leave`)? Not on a uniform-noise
        model, whose draws are the batch's shapes: its rows leave at the next boundary."""
        return self.uniform is None

    def _keep(self, state: BatchState, keep: list[int]) -> None:
        """Only batch rows `keep` (a non-empty list, in order) stay in `state`, renumbered, the open
        block's with them. The canvas is trimmed, but not under an open block with a cache: its
        columns stay (the block's cache is laid out on them) and the left rows' cache rows stay
        behind (`BlockRun.cache_rows`). No row left in the block: the state is at a boundary."""
        batch, run, dev = state.batch, state.run, state.batch.x.device
        at = torch.tensor(keep, device=dev)
        if run is not None:
            index = torch.full((batch.x.shape[0],), -1, dtype=torch.long, device=dev)
            index[at] = torch.arange(len(keep), device=dev)
            kept = set(keep)
            stay = [i for i, b in enumerate(run.seqs.tolist()) if b in kept]
            state.run = run.take(torch.tensor(stay, dtype=torch.long, device=dev)) if stay else None
            if state.run is not None:
                state.run.seqs = index[state.run.seqs]
        state.batch = batch = batch.take(at)
        if run is not None and not state.rolling:
            return
        left, right, span = batch.trim_shift(self.mc.logit_shift)
        state.batch = batch.shift(left, right, lambda valid: position_ids(self.mc, valid))
        state.batch.span = span                  # exact again (rows that left may have been the longest)
        if state.run is not None:
            self._reframe(state.run, state.batch, left, right)

    @property
    def joins_inside_a_block(self) -> bool:
        """Can rows join while a block is open (`can_join` says which)? Not on a uniform-noise model
        (its draws are the batch's): rows join it at the next block boundary."""
        return self.uniform is None

    def can_join(self, state: BatchState, prompts, gen_lengths: list[int] | None = None) -> bool:
        """May rows of these prompts and gen lengths join `state` now (`join`)? At a block boundary,
        yes; inside an open block where `joins_inside_a_block` and the open block's window is the
        one they would open with: ETE's window and --cross-block's next block end at the canvas's
        end, so a row that reaches further than the running ones joins at the next boundary."""
        lengths = gen_lengths or [self.dc.gen_length] * len(prompts)
        lead, decoded = layout([len(p) for p in prompts], lengths, self.dc.block_length, self.dc.aligned(self.mc))
        return self._fits(state, max(a + d for a, d in zip(lead, decoded)))

    def _fits(self, state: BatchState, after: int) -> bool:
        """`can_join` for rows whose canvas reaches `after` columns past their cursor."""
        run, b = state.run, state.batch
        if run is None or b is None:
            return True
        if not self.joins_inside_a_block:
            return False
        return self._window(max(b.x.shape[1] - b.cursor, after)) == (run.win.width, run.win.ahead)

    @_one_at_a_time
    def join(self, state: BatchState, prompts, gen_lengths: list[int], seeds: list | None = None) -> StepOutput:
        """Rows join `state`: each new row's first block opens at the batch's cursor, where the
        others' current (or next) block is (`engine.state.join` pads whichever side is shorter).
        At a block boundary that is all; inside an open block (`joins_inside_a_block`) the new rows
        take their block's first call now — one model call of the new rows — and then step with
        the others (rolling rows, `rolls`: that call rides on the next step's). Returns a
        `StepOutput` as `step` does (`called`: that first call was made)."""
        if state.done:
            raise InputError("this batch is done (step set state.done and released its cache): decode these "
                             "prompts in a new batch (Decoder.start; start(..., live=True) keeps a batch open "
                             "for joins)")
        new = self.start(prompts, gen_lengths, seeds=seeds).batch
        if not self._fits(state, new.x.shape[1] - new.cursor):       # refused: the state is as it was
            raise InputError("these rows join this running batch at a block boundary (state.run is open; "
                             "Decoder.can_join)")
        state.version += 1
        state.sent = state.sent + [0] * new.x.shape[0]
        return StepOutput(state, self._join(state, new), self.mc.mask_token_id)

    def _join(self, state: BatchState, new: Batch) -> bool:
        """`join`'s work on the state: True if the new rows' first call was made."""
        pos = lambda valid: position_ids(self.mc, valid)     # noqa: E731
        if state.batch is None or state.run is None:
            state.batch = new if state.batch is None else \
                join(state.batch, new, pos).trimmed(pos, self.mc.logit_shift)
            return False
        old, run = state.batch, state.run
        merged = join(old, new, pos)                # no trimming while the block is open: its columns stay
        left = merged.cursor - old.cursor
        rows = torch.arange(old.x.shape[0], merged.x.shape[0], device=merged.x.device)
        state.batch = merged
        if state.rolling:                           # their first call rides on the next step's
            self._reframe(run, merged, left, merged.x.shape[1] - old.x.shape[1] - left)
            state.run = run.joined(self._awaiting(merged, rows, run))
            return False
        self._widen(run, merged, left, merged.x.shape[1] - old.x.shape[1] - left)
        with self.cache_mode.appending(run.cache):      # their cache rows go after the open block's
            fresh = self._open_block(merged.take(rows), plan=run.plan)     # the new rows' first call
        if fresh is None:
            return False
        fresh.seqs = rows[fresh.seqs]
        state.run = run.joined(fresh, self.cache_mode.joined(run.cache, fresh.cache))
        if self.budget is not None:          # the block's time is no longer its plan's alone
            self.budget.joined(fresh.seqs.numel())
        return True

    def _widen(self, run: BlockRun, batch: Batch, left: int, right: int) -> None:
        """The open block's rows on `batch`'s wider canvas: `left` columns before (prompts of rows
        that joined are longer), `right` after; their cached keys padded with invisible ones. The
        block's calls take the batch's span (engine/cache.py: packed calls) even when nothing widens."""
        if left or right:
            self._reframe(run, batch, left, right, keep_positions=True)
        elif batch.span == run.win.span:
            return
        else:
            run.win = dataclasses.replace(run.win, span=batch.span)
        if run.cache is not None:     # every mode caches from column 0 on: `left` invisible keys first
            run.cache = self.cache_mode.widen(run.cache, run.win, run.x.shape[1], left, rows=batch.x.shape[0])

    @_one_at_a_time
    def leave(self, state: BatchState, rows: list[int], now: bool = False) -> None:
        """Batch rows `rows` leave `state`: at a block boundary they are dropped (the others keep
        their order, the canvas is trimmed; no row left: `state.batch` is None). In an open block
        they take no further call, in this block or any later one, and stay rows of the batch (its
        row indices unchanged; a caller drops them at the next boundary; their results stay what was
        settled) — unless `now` (where `drops_at_once`) or the batch rolls: then they are dropped at
        once too, the others renumbered in order (with a cache their cache rows stay behind, unused,
        until the block closes)."""
        rows = _batch_rows(state, rows)
        state.version += 1
        if state.batch is None or state.run is not None and not rows:
            return
        if state.run is not None and not (state.rolling or now and self.drops_at_once):
            gone = torch.tensor(rows, device=state.run.seqs.device)
            state.run.retire(torch.isin(state.run.seqs, gone))
            b = state.batch
            b.retired = torch.zeros_like(b.stop_at, dtype=torch.bool) if b.retired is None else b.retired
            b.retired[gone] = True                       # and no later block's calls
            return
        gone = set(rows)
        keep = [b for b in range(state.batch.x.shape[0]) if b not in gone]     # (none left: trimmed only)
        state.sent = [state.sent[b] for b in keep]
        if not keep:                     # a live batch waits for joins; another is done
            state.batch = state.run = None
            state.done = not state.live
            if state.done:
                self.cache_mode.release()
            return
        self._keep(state, keep)

    def results(self, state: BatchState, rows=None, seconds=None) -> list[SequenceResult]:
        """The `SequenceResult`s of the batch's rows (all, or `rows`), from what is settled."""
        secs = time.perf_counter() - state.t0 if seconds is None else seconds
        if state.batch is None:          # every row left
            _batch_rows(state, rows or [])
            return []
        return collect_results(state.batch, self.dc.block_length, secs, rows=None if rows is None else
                               _batch_rows(state, rows))

    def stream(self, prompts, seeds: list | None = None):
        """Decode like `generate`, yielding a `StreamUpdate` after every model call: per sequence,
        the tokens that became final with that call (the left-most fully committed prefix grows;
        tokens committed out of order inside a block wait for the masks before them). The last
        update also carries the `SequenceResult`s; its pieces end every sequence, so the pieces
        of a sequence concatenate to exactly its `token_ids` (their `commits` to its `per_token()`:
        `probs` to its `commit_prob`, `tops` to its `commit_top`).
        Reads back [B] values per call. `seeds`: as for `start`."""
        state = self.start(prompts, seeds=seeds)
        with torch.no_grad():
            while not state.done:
                if out := self.step(state):
                    f = out.final()
                    yield StreamUpdate(f.pieces, commits=f.commits)
        results, sent = self.results(state), state.sent
        yield StreamUpdate([r.token_ids[n:] for r, n in zip(results, sent)], results,
                           [r.per_token(n) for r, n in zip(results, sent)])

    @torch.no_grad()
    @_one_at_a_time
    def generate(self, prompts) -> list[SequenceResult]:
        state = self.start(prompts)
        while not state.done:
            self.step(state)
        return self.results(state)


def _said(e: BaseException) -> str:
    """What an exception was, on one line: its type and its message's first line."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _check_config(config) -> None:
    if config is not None and not isinstance(config, DecodeConfig):
        raise InputError(f"config must be an engine.DecodeConfig (or None), got {type(config).__name__}; "
                         f"options go as keywords: generate(model, prompts, method=..., ...)")


def _batch_rows(state: BatchState, rows) -> list[int]:
    """`rows` as ints, each a row of `state`'s batch (0 .. B-1, no negative index); else InputError."""
    n = 0 if state.batch is None else state.batch.x.shape[0]
    try:
        out = [exact_int(r) for r in rows]
    except TypeError:
        raise InputError(f"rows must be a list of batch row indices, got {rows!r}") from None
    for r in out:
        if not 0 <= r < n:
            raise InputError(f"row {r!r} is not a row of this batch (its rows are 0 to {n - 1})" if n else
                             f"row {r!r} is not a row of this batch (it has none left)")
    return out


def generate(model: Transformer, prompts, config: DecodeConfig | None = None, **options) -> list[SequenceResult]:
    """Decode a batch of prompts (lists of token ids); `options` override those of `config`."""
    _check_config(config)
    cfg = DecodeConfig(**options) if config is None else config.replace(**options) if options else config
    return Decoder(model, cfg).generate(prompts)
