"""`--draft-budget auto`: before each block, the draft nodes worth verifying (docs/algorithms.md §8).

A `CostModel` gives the milliseconds of one verification call as a function of the canvases it
holds (rows of the whole batch). It is measured on the decoder's own rows at the first block it
plans (a few calls of 1..K rows per sequence, the fastest of three each; cached per model, cache
mode, block length and canvas length, so later decoders of the same shape pay nothing), read
from a `bench.speed --cost-curve` profile (`--cost-profile PATH`), or given explicitly.

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
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError
from .graph import DraftGraph

PROFILE_FORMAT = "psd-cost-profile/1"
PRIOR_Q, PRIOR_WEIGHT = 0.8, 4.0
_MEASURED: dict[tuple, "CostModel"] = {}       # measured curves, shared by decoders of one shape


class CostModel:
    """ms of one call holding `n` canvases: piecewise linear through measured points, linear in
    n (through the last point) beyond them."""

    def __init__(self, canvases, ms, source: str = "given"):
        pts = sorted(zip(canvases, ms))
        if not pts or any(n < 1 or not (t > 0 and math.isfinite(t)) for n, t in pts):
            raise InputError(f"a cost model needs points (canvases >= 1, ms > 0); got {list(zip(canvases, ms))}")
        self.n = [float(n) for n, _ in pts]
        self.ms_at = [float(t) for _, t in pts]
        self.source = source

    def ms(self, n: float) -> float:
        xs, ys = self.n, self.ms_at
        if n <= xs[0]:
            return ys[0]
        if n >= xs[-1]:
            return ys[-1] * n / xs[-1]
        i = next(i for i in range(1, len(xs)) if xs[i] >= n)
        w = (n - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + w * (ys[i] - ys[i - 1])

    @classmethod
    def from_profile(cls, path: str | Path, cache: str, block_length: int, prefix: int) -> "CostModel":
        """The curves of a `bench.speed --cost-curve` profile for this cache mode and block length,
        at the profiled prefix nearest to `prefix`; points = (batch · rows, ms)."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise InputError(f"cost profile {path} not found") from None
        except (OSError, ValueError) as e:
            raise InputError(f"cannot read cost profile {path}: {e}") from None
        curves = raw.get("curves") if isinstance(raw, dict) else None
        if not isinstance(curves, list) or (isinstance(raw, dict) and raw.get("format", PROFILE_FORMAT) != PROFILE_FORMAT):
            raise InputError(f"cost profile {path} is not a {PROFILE_FORMAT} file (bench.speed --cost-curve writes one)")
        try:
            fit = [c for c in curves if c["cache"] == cache and c["block_length"] == block_length]
            have = sorted({(str(c["cache"]), str(c["block_length"])) for c in curves})
            near = min({c["prefix"] for c in fit}, key=lambda s: abs(math.log(max(s, 1) / max(prefix, 1))),
                       default=None)
            pts = [(c["batch"] * r, t) for c in fit if c["prefix"] == near for r, t in zip(c["rows"], c["ms"])]
        except (KeyError, TypeError, ValueError):
            raise InputError(f"cost profile {path}: every curve needs cache, block_length, prefix, batch, rows "
                             f"and ms") from None
        if not fit:
            raise InputError(f"cost profile {path} has no curve for cache {cache} and block length {block_length} "
                             f"(it has {', '.join(f'{a}/{b}' for a, b in have) or 'none'})")
        best: dict[int, float] = {}
        for n, t in pts:                          # one time per canvas count: the fastest measured
            best[n] = min(t, best.get(n, float("inf")))
        return cls(list(best), list(best.values()), f"{path} (prefix {near})")


def measure(call, counts: list[int], device, reps: int = 3) -> CostModel:
    """Time `call(n)` (one model call of n canvases) for every n, interleaved, fastest of `reps`."""
    best = {n: float("inf") for n in counts}
    call(counts[0])                                  # warm-up (allocations, kernel choice)
    for _ in range(reps):
        for n in counts:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            call(n)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best[n] = min(best[n], (time.perf_counter() - t0) * 1e3)
    return CostModel(counts, [best[n] for n in counts], "measured")


@dataclass
class Plan:
    """The draft nodes of one block: a sub-graph of the decoder's graph, parent-closed."""

    index: torch.Tensor            # [m] node indices into the full graph
    graph: DraftGraph
    node_ranks: torch.Tensor       # [m, D]
    node_size: torch.Tensor        # [m]
    select: object                 # the method's Selection over this sub-graph
    parents: torch.Tensor          # [m, m] float: parents[p, k] = 1 where p is a parent of k


def make_plan(full: DraftGraph, index: list[int], selection, device) -> Plan:
    graph = DraftGraph([sorted(full.nodes[k]) for k in index])
    m = len(index)
    par = torch.zeros(m, m, device=device)
    for k, ps in enumerate(graph.parents):
        par[ps, k] = 1.0
    return Plan(torch.tensor(index, device=device), graph, graph.node_ranks(device),
                torch.tensor([len(s) for s in graph.nodes], device=device), selection(graph), par)


class DraftBudget:
    """Per-block choice of the verified nodes, from a cost model and online acceptance rates."""

    def __init__(self, graph: DraftGraph, selection, device, cost: CostModel | None = None,
                 profile: str | None = None, key: tuple = ()):
        self.full, self.selection, self.device = graph, selection, device
        self.cost, self.profile, self.key = cost, profile, key
        self.given = cost is not None           # an explicit cost model (tests, callers) is never re-measured
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

    # ------------------------------------------------------------------ on the device, per step
    def observe_commit(self, commit: torch.Tensor, pending: torch.Tensor) -> None:
        self.tokens1 += commit.sum()
        self.steps1 += pending.sum()

    def observe(self, plan: Plan, accepted: torch.Tensor, valid: torch.Tensor) -> None:
        parent_ok = (accepted.float() @ plan.parents) > 0                       # [A, m]
        self.tried.index_add_(0, plan.index, (parent_ok & valid).float().sum(0))
        self.accepted.index_add_(0, plan.index, (accepted & valid).float().sum(0))

    def observe_block(self, plan: Plan, tokens: torch.Tensor, calls: torch.Tensor) -> None:
        """A block decoded under `plan` committed `tokens` in `calls` verification calls (all rows)."""
        m = len(plan.graph)
        self.size_tokens[m] += tokens
        self.size_calls[m] += calls

    # ------------------------------------------------------------------ once per block
    def rates(self) -> tuple[list[float], float, list[float], list[float]]:
        """(q per node, the policy's tokens per step, tokens and calls observed per plan size)."""
        K = len(self.full)
        stats = torch.cat([self.tried, self.accepted, self.tokens1[None], self.steps1[None], self.size_tokens,
                           self.size_calls]).tolist()
        tried, acc = stats[:K], stats[K:2 * K]
        q = [(acc[k] + PRIOR_WEIGHT * self.prior[k]) / (tried[k] + PRIOR_WEIGHT) for k in range(K)]
        c = stats[2 * K] / stats[2 * K + 1] if stats[2 * K + 1] > 0 else 1.0
        return q, c, stats[2 * K + 2:3 * K + 3], stats[3 * K + 3:]

    def candidates(self, q: list[float]) -> list[tuple[list[int], float]]:
        """Nested parent-closed sets, one per size, grown by the largest P(k)·Δ; with G(S) and
        Σ P(k) (expected accepted nodes)."""
        g = self.full
        size = [len(s) for s in g.nodes]
        reach = [1.0] + q[1:]              # P(k): the root, a parent of every node, is always accepted
        chosen, gain, levels, out = [0], 0.0, 0.0, [([0], 0.0, 0.0)]
        while len(chosen) < len(g):
            best, best_v = None, -1.0
            for k in range(len(g)):
                if k in chosen or not all(p in chosen for p in g.parents[k]):
                    continue
                v = reach[k] * (size[k] - max(size[p] for p in g.parents[k]))
                if v > best_v:
                    best, best_v = k, v
            chosen, gain, levels = chosen + [best], gain + best_v, levels + reach[best]
            out.append((list(chosen), gain, levels))
        return out

    def choose(self, rows: int, q: list[float], c: float, tokens=None, calls=None) -> list[int]:
        """The node set with the most expected tokens per millisecond, tpc / cost(rows · |S|), ties
        to the smaller set. tpc (tokens per verification call) is what blocks decoded with that
        many nodes committed, blended with the estimate f · (c + G(S)) worth PRIOR_WEIGHT calls,
        f = measured / estimated tokens over the sizes tried (the estimate's shared error). A
        larger set never tried whose optimistic value (every accepted node worth a whole policy
        step, c · (1 + Σ P(k))) beats the best is tried first: accepting a draft also lets the
        next step start from a more decided state, which the additive estimate does not see."""
        tokens = tokens or [0.0] * (len(self.full) + 1)
        calls = calls or [0.0] * (len(self.full) + 1)
        cands = self.candidates(q)
        # the estimate's error, shared by every size: measured tokens / estimated tokens where tried
        est = sum(calls[len(n)] * (c + g) for n, g, _ in cands)
        f = min(4.0, max(0.25, sum(tokens[len(n)] for n, _, _ in cands) / est)) if est > 0 else 1.0
        best, best_rate = [0], -1.0
        for nodes, gain, _ in cands:
            m = len(nodes)
            tpc = (tokens[m] + PRIOR_WEIGHT * f * (c + gain)) / (calls[m] + PRIOR_WEIGHT)
            rate = tpc / self.cost.ms(rows * m)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = nodes, rate
        explore, explore_rate = None, best_rate
        for nodes, _, levels in cands:          # larger sets never tried that could pay: try one
            m = len(nodes)
            optimistic = c * (1 + levels) / self.cost.ms(rows * m)
            if m > len(best) and calls[m] == 0 and optimistic > explore_rate * (1 + 1e-9):
                explore, explore_rate = nodes, optimistic
        return sorted(explore or best)

    def plan(self, run, call) -> Plan:
        """The nodes block `run` verifies; `call(rows)` runs one verification-shaped call of the
        run's rows `rows` (used to measure the cost where none was given)."""
        if self.profile is not None and self.cost is None:
            self.cost = CostModel.from_profile(self.profile, self.key[3], run.win.block_length, run.win.lo)
        elif self.profile is None and not self.given:
            self.cost = self._measured(run, call)
        q, c, tokens, calls = self.rates()
        nodes = self.choose(run.seqs.numel(), q, c, tokens, calls)
        self.chosen.append(len(nodes))
        key = tuple(nodes)
        if key not in self.plans:
            self.plans[key] = make_plan(self.full, nodes, self.selection, self.device)
        return self.plans[key]

    def _measured(self, run, call) -> CostModel:
        """The measured curve of this shape, extended (measured again) when this batch needs more
        canvases per call than it covers."""
        key = self.key + (1 << (run.x.shape[1] - 1).bit_length(),)     # canvas length, to a power of 2
        S, K = run.seqs.numel(), len(self.full)
        have = _MEASURED.get(key)
        if have is None or have.n[-1] < S * K:
            counts = sorted({r for r in range(1, K + 1)} | {S * r for r in range(1, K + 1)})
            new = measure(lambda n: call(torch.arange(n, device=run.x.device) % S), counts, run.x.device)
            if have is not None:
                pts = dict(zip(have.n, have.ms_at))
                pts.update(zip(new.n, new.ms_at))
                new = CostModel(list(pts), list(pts.values()), "measured")
            _MEASURED[key] = have = new
        return have
