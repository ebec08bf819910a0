"""`--draft-budget auto`: before each block, the draft nodes worth verifying (docs/algorithms.md §8).

A `CostModel` (engine/cost.py) gives the milliseconds of one verification call as a function of
the canvases it holds (rows of the whole batch). It is measured on the decoder's own rows at the
first block it plans (a few calls of 1..K rows per sequence, the fastest of three each; kept per
model shape, dtype, device, threads, cache mode, block length and canvas length, in this process
and on disk (engine/cost.py `store_dir`: $PSD_COST_CACHE, default ~/.cache/psd-engine/cost), so
later decoders and later runs of the same shape on the same machine pay nothing) and then scaled per node count by the measured wall time of the blocks decoded with it
(what a step costs beyond the model call: drafting, selection, bookkeeping); or read from a
`bench.speed --cost-curve` profile (`--cost-profile PATH`), or given explicitly (both used as they
are, so the choices are reproducible).

Per graph node k the budget counts how often k was accepted when it was verified and a parent of
it was accepted: q_k, its conditional acceptance rate, starts from a prior (the calibrated
graph's rates where the file has them, else an optimistic 0.8 so that a node is tried where it
could pay) worth `PRIOR_WEIGHT` observations. A node's parents are all its strict subsets in the
graph (§3), the always-accepted root among them, so q_k is also P(k), k's acceptance rate per
verification call.

`plan` then picks, for the batch's A rows, the parent-closed node set S (root always) that
maximises expected tokens per millisecond, (c + G(S)) / cost(A · |S|), with c the policy's
tokens per step (measured) and G(S) = Σ_{k∈S} P(k) · (|S_k| − max_{p∈S parent} |S_p|) (exact for
chains; an upper bound where siblings compete). Sets are grown greedily by P(k)·Δ, one per size,
and the best size wins, ties to the smaller. Everything it reads back is one small tensor per
block; the per-step bookkeeping stays on the device.

A measured curve is a prior, not the truth: measured under load it can make two nodes look as
cheap as one. So where the cost is measured, every node count run is costed by its own fastest
block's wall time (a count not run yet by its run neighbours', interpolated), and the policy alone, the
size every dearer set is compared with, is timed by its own blocks: before a dearer set is kept
a second block, and again after 8, 16, then every `RECHECK_MAX` blocks of dearer sets (a bounded
share of the blocks, at most 1 in 9, and deterministic in block counts, never in times). Which nodes are verified is
all the budget decides: the tokens of exact acceptance are the policy's whatever it picks.
"""
from __future__ import annotations

import time

import torch

from models.parallel import agree

from .cost import CostModel, load_curve, measure, read_profile, save_curve
from .graph import DraftGraph, Plan, make_plan

PRIOR_Q, PRIOR_WEIGHT = 0.8, 4.0
MARGIN = 1.05           # a dearer set must promise 5% more tokens per ms: the policy alone is the safe side
RECHECK_FIRST, RECHECK_MAX = 8, 32   # blocks of dearer sets between timings of the policy alone: 8, 16, 32, 32 ...
_MEASURED: dict[tuple, CostModel] = {}         # measured curves, shared by decoders of one shape


def shape_key(mc) -> tuple:
    """What a call's cost depends on in a model config: its shapes (not its weights or token ids)."""
    return (mc.family, mc.vocab_size, mc.hidden_size, mc.intermediate_size, mc.num_layers, mc.num_heads,
            mc.num_kv_heads, mc.head_dim, mc.attention, mc.num_experts, mc.num_experts_per_tok,
            mc.moe_intermediate_size, mc.shared_intermediate_size, mc.first_dense_layers, tuple(mc.layer_types),
            mc.sliding_window, mc.full_head_dim, mc.full_kv_heads)


class DraftBudget:
    """Per-block choice of the verified nodes, from a cost model and online acceptance rates."""

    def __init__(self, graph: DraftGraph, selection, device, cost: CostModel | None = None,
                 profile: str | None = None, cache: str = "none", key: tuple = ()):
        """`cost` or `profile` fix the cost model; without either it is measured (per `key`, the
        model's shape) and corrected by block times. `cache` names the cache mode (profile curves)."""
        self.full, self.selection, self.device = graph, selection, device
        self.cost, self.profile, self.cache, self.key = cost, profile, cache, key
        self.timed = cost is None and profile is None    # measured costs are corrected by block times
        # a profile is read and checked now, before anything is decoded (a bad one is one InputError)
        self.curves = read_profile(profile) if cost is None and profile is not None else None
        K = len(graph)
        self.tried = torch.zeros(K, device=device)            # verified with an accepted parent
        self.accepted = torch.zeros(K, device=device)
        self.tokens1 = torch.zeros((), device=device)          # stage-1 tokens and steps (the policy's c)
        self.steps1 = torch.zeros((), device=device)
        self.prior = [PRIOR_Q] * K
        rates = getattr(graph, "acceptance", None)           # P(node) from a calibrated graph file
        if rates:
            self.prior[1:] = rates[1:]
        self.size_tokens = torch.zeros(K + 1, device=device)  # per plan size: tokens committed in its blocks
        self.size_calls = torch.zeros(K + 1, device=device)   # and the verification calls they took
        self.plans: dict[tuple, Plan] = {}
        self.chosen: list[int] = []                           # nodes chosen per planned block
        self.ratio: list[float | None] = [None] * (K + 1)     # per plan size: measured / modelled, fastest block
        self._open, self._pending = None, []
        self.row_blocks, self.block_length = 0, 32          # rows × blocks observed; the block length
        self.since_policy, self.recheck = 0, 1              # dearer blocks since the policy alone; the gap due

    # ------------------------------------------------------------------ on the device, per step
    def observe_commit(self, commit: torch.Tensor, pending: torch.Tensor) -> None:
        self.tokens1 += commit.sum()
        self.steps1 += pending.sum()

    def observe(self, plan: Plan, accepted: torch.Tensor, valid: torch.Tensor) -> None:
        if len(plan.graph) == 1:                 # no drafts verified: nothing to learn
            return
        parent_ok = (accepted.float() @ plan.parents) > 0                       # [A, m]
        self.tried.index_add_(0, plan.index, (parent_ok & valid).float().sum(0))
        self.accepted.index_add_(0, plan.index, (accepted & valid).float().sum(0))

    def observe_block(self, plan: Plan, tokens: torch.Tensor, calls: torch.Tensor) -> None:
        """A block decoded under `plan` committed `tokens` in `calls` verification calls (all rows);
        its wall time since `plan` (the caller has synchronised) corrects the cost model."""
        m = len(plan.graph)
        self.size_tokens[m] += tokens
        self.size_calls[m] += calls
        if self._open is not None:
            rows, t0 = self._open
            if t0 is None:                       # rows joined it (`joined`): counted, not timed
                self.row_blocks += rows
            else:
                self.record(m, rows, (time.perf_counter() - t0) * 1e3, calls)
            self._open = None

    def joined(self, rows: int) -> None:
        """`rows` rows joined the open block (`Decoder.join`), with its plan: their first call is in
        its time, so the block is not timed; its rows count."""
        if self._open is not None:
            self._open = (self._open[0] + rows, None)

    def record(self, m: int, rows: int, ms: float, calls) -> None:
        """A block of `rows` rows verified `m` nodes per call in `calls` verification calls (all rows,
        a number or a device scalar, read at the next plan) and took `ms` after its plan."""
        if self.timed:
            self._pending.append((m, rows, ms, calls / max(rows, 1)))
        self.row_blocks += rows

    # ------------------------------------------------------------------ once per block
    def rates(self) -> tuple[list[float], float, list[float], list[float]]:
        """(q per node, the policy's tokens per step, tokens and calls observed per plan size)."""
        K = len(self.full)
        pending = [torch.as_tensor(p[3], dtype=torch.float32, device=self.device).reshape(1) for p in self._pending]
        stats = torch.cat([self.tried, self.accepted, self.tokens1[None], self.steps1[None], self.size_tokens,
                           self.size_calls, *pending]).tolist()
        tried, acc = stats[:K], stats[K:2 * K]
        self._fold_times(stats[len(stats) - len(pending):])
        q = [(acc[k] + PRIOR_WEIGHT * self.prior[k]) / (tried[k] + PRIOR_WEIGHT) for k in range(K)]
        c = stats[2 * K] / stats[2 * K + 1] if stats[2 * K + 1] > 0 else 1.0
        return q, c, stats[2 * K + 2:3 * K + 3], stats[3 * K + 3:4 * K + 4]

    def candidates(self, q: list[float]) -> list[tuple[list[int], float, float]]:
        """Nested parent-closed sets, one per size, grown by the largest P(k)·Δ; with G(S) and
        Σ P(k) (expected accepted nodes)."""
        g = self.full
        size = [len(s) for s in g.nodes]
        # P(k): the root, a parent of every node, is always accepted. A node is never counted as
        # likelier than a parent of it other than the root (a prior's 0.8 is not kept above a
        # parent's measured rate: drafts that extend a rejected one are rejected too)
        reach = [1.0] + [None] * (len(g) - 1)
        chosen, gain, levels, out = [0], 0.0, 0.0, [([0], 0.0, 0.0)]
        while len(chosen) < len(g):
            best, best_v = None, -1.0
            for k in range(len(g)):
                if k in chosen or not all(p in chosen for p in g.parents[k]):
                    continue
                reach[k] = min([q[k]] + [reach[p] for p in g.parents[k] if p != 0])
                v = reach[k] * (size[k] - max(size[p] for p in g.parents[k]))
                if v > best_v:
                    best, best_v = k, v
            chosen, gain, levels = chosen + [best], gain + best_v, levels + reach[best]
            out.append((list(chosen), gain, levels))
        return out

    def choose(self, rows: int, q: list[float], c: float, tokens=None, calls=None) -> list[int]:
        """The node set with the most expected tokens per millisecond (a set whose call costs more
        must promise MARGIN more; ties to the smaller set): per
        row, a block's first call, cost(rows) over the tokens a block yields, plus a verification
        call, cost(rows · |S|), over tpc. tpc (tokens per verification call) is what blocks decoded with that
        many nodes committed, blended with the estimate f · (c + G(S)) worth PRIOR_WEIGHT calls,
        f = measured / estimated tokens over the sizes tried (the estimate's shared error). A
        larger set never tried whose optimistic value (every accepted node worth a whole policy
        step, c · (1 + Σ P(k))) beats the best (of the sets tried) is tried first, the cheapest
        such set: accepting a draft also lets the next step start from a more decided state,
        which the additive estimate does not see. With a measured cost, a dearer set gives way to
        the policy alone when that is due to be timed again (`check_due`)."""
        tokens = tokens or [0.0] * (len(self.full) + 1)
        calls = calls or [0.0] * (len(self.full) + 1)
        cands = self.candidates(q)
        # the estimate's error, shared by every size: measured tokens / estimated tokens where tried
        est = sum(calls[len(n)] * (c + g) for n, g, _ in cands)
        f = min(4.0, max(0.25, sum(tokens[len(n)] for n, _, _ in cands) / est)) if est > 0 else 1.0
        per_block = sum(tokens) / self.row_blocks if self.row_blocks else float(self.block_length)
        start = self.call_ms(rows, 1) / max(per_block, 1e-9)      # ms per token, every set

        def rate(m, tpc):
            return 1.0 / (start + self.call_ms(rows, m) / max(tpc, 1e-9))

        best, best_rate = [0], -1.0
        for nodes, gain, _ in cands:
            m = len(nodes)
            if m > 1 and calls[m] == 0:          # never tried: only as a try (below)
                continue
            tpc = (tokens[m] + PRIOR_WEIGHT * f * (c + gain)) / (calls[m] + PRIOR_WEIGHT)
            rate_m = rate(m, tpc)
            dearer = self.call_ms(rows, m) > 1.01 * self.call_ms(rows, len(best))   # free rows: no margin
            if rate_m > best_rate * (MARGIN if dearer else 1 + 1e-9):
                best, best_rate = nodes, rate_m
        # larger sets never tried that could pay: try the cheapest (a block of the whole graph is
        # what a short run cannot pay back at a large model; a small set's measured rates bound the
        # larger ones'), among sets of that call cost the most promising
        could = [(self.call_ms(rows, len(n)), rate(len(n), c * (1 + lv)), n) for n, _, lv in cands
                 if len(n) > len(best) and calls[len(n)] == 0]
        could = [x for x in could if x[1] > best_rate * MARGIN]
        if could:
            cheapest = min(x[0] for x in could)
            best = max((x for x in could if x[0] <= 1.01 * cheapest), key=lambda x: x[1])[2]
        return [0] if len(best) > 1 and self.check_due() else sorted(best)

    def check_due(self) -> bool:
        """Is the policy alone to be timed again before a dearer set runs? Only with a measured cost
        (given costs and profiles are used as they are): after the first block of dearer sets, then
        after RECHECK_FIRST, twice that, ... RECHECK_MAX of them. Its own blocks' time is what every dearer set's is
        compared with; borrowed from a dearer set's blocks, the curve's ratio between the two (which
        load can make wrong) would never be measured."""
        return self.timed and self.since_policy >= self.recheck

    def call_ms(self, rows: int, m: int) -> float:
        """ms of one verification call of `m` nodes for `rows` rows: the cost model times `correction`."""
        return self.correction(m) * self.cost.ms(rows * m)

    def plan(self, run, call) -> Plan:
        """The nodes block `run` verifies; `call(rows)` runs one verification-shaped call of the
        run's rows `rows` (used to measure the cost where none was given)."""
        if self.timed:
            self.cost = self._measured(run, call)
        elif self.cost is None:
            self.cost = CostModel.from_profile(self.profile, self.cache, run.win.block_length, run.win.lo,
                                               self.curves)
        self.block_length = run.win.block_length
        nodes = self.next_nodes(run.seqs.numel())
        key = tuple(nodes)
        if key not in self.plans:
            self.plans[key] = make_plan(self.full, nodes, self.selection, self.device)
        self._open = (run.seqs.numel(), time.perf_counter())
        return self.plans[key]

    def next_nodes(self, rows: int) -> list[int]:
        """The nodes the next block of `rows` rows verifies, from everything observed so far."""
        q, c, tokens, calls = self.rates()
        nodes = agree(self.choose(rows, q, c, tokens, calls))   # tensor-parallel ranks: rank 0's times decide
        self.chosen.append(len(nodes))
        self.count(len(nodes))
        return nodes

    def _fold_times(self, calls_per_row: list[float]) -> None:
        """Blocks timed since the last plan: measured ms against V · cost(A · m) (V verification
        calls per row), per size. Their ratio scales the cost model for that size, so what a call
        costs beyond the model call (drafting, selection, bookkeeping) is counted too; the fastest
        block's, as the curve keeps the fastest call: load only ever adds time, and a block timed
        under load must not make its size look dearer than the others for good."""
        for (m, rows, ms, _), v in zip(self._pending, calls_per_row):
            if v > 0:
                r = ms / (v * self.cost.ms(rows * m))
                self.ratio[m] = r if self.ratio[m] is None else min(self.ratio[m], r)
        self._pending = []

    def count(self, m: int) -> None:
        """Count a planned block of `m` nodes for `check_due`: a block of the policy alone that was
        due sets the next gap (RECHECK_FIRST, then doubled up to RECHECK_MAX); any block of it
        restarts the count."""
        if m > 1:
            self.since_policy += 1
            return
        if self.since_policy >= self.recheck:
            self.recheck = min(max(RECHECK_FIRST, 2 * self.recheck), RECHECK_MAX)
        self.since_policy = 0

    def correction(self, m: int) -> float:
        """Measured / modelled call time for size m: its own fastest block's where it ran; else, between
        two sizes that ran, interpolated between theirs, else the nearest's (1 before any)."""
        sizes = [s for s in range(1, len(self.ratio)) if self.ratio[s] is not None]
        if not sizes:
            return 1.0

        def own(s):
            return min(4.0, max(0.25, self.ratio[s]))

        below, above = [s for s in sizes if s <= m], [s for s in sizes if s >= m]
        if below and above:
            a, b = max(below), min(above)
            return own(a) if a == b else own(a) + (own(b) - own(a)) * (m - a) / (b - a)
        return own(max(below) if below else min(above))

    def _measured(self, run, call) -> CostModel:
        """The measured curve of this shape, extended (measured again) when this batch needs more
        canvases per call than it covers."""
        key = self.key + (1 << (run.x.shape[1] - 1).bit_length(),)     # canvas length, to a power of 2
        S, K = run.seqs.numel(), len(self.full)
        have = _MEASURED.get(key) or load_curve(key)         # this process, else an earlier one (cost.py)
        if have is None or have.n[-1] < S * K:
            counts = sorted({r for r in range(1, K + 1)} | {S * r for r in range(1, K + 1)})
            new = measure(lambda n: call(torch.arange(n, device=run.x.device) % S), counts, run.x.device)
            if have is not None:
                pts = dict(zip(have.n, have.ms_at))
                pts.update(zip(new.n, new.ms_at))
                new = CostModel(list(pts), list(pts.values()), "measured")
            save_curve(key, new)
            have = new
        _MEASURED[key] = have
        return have
