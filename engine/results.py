"""What decoding returns: one `SequenceResult` per prompt, and statistics over many (§5)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from .state import Commits


def _commit_fields(cls):
    """Give `cls` (before @dataclass) a field `commit_<name>` for every field of `Commits` that it
    does not declare itself: per generated token, that field's host form (`Commits.lists`), None
    where the record does not keep it. So a new per-token output reaches every result without a
    line here."""
    for f in dataclasses.fields(Commits):
        name = f"commit_{f.name}"
        if name not in cls.__annotations__:
            cls.__annotations__[name] = "list | None"
            setattr(cls, name, None)
    return cls


@dataclass
@_commit_fields
class SequenceResult:
    """What one prompt produced, and how (docs/algorithms.md §5). The `commit_*` fields are per
    generated token, one per field of `engine.state.Commits` (declared here where documented)."""

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
    commit_prob: list[float]      # per generated token: its confidence in the output that committed it (its
                                  # probability with --score prob, the default; untempered when sampled)
    commit_block: list[int]       # per generated token: its block index
    commit_top: list[list[tuple[int, float]]] | None = None   # --top-logprobs k: per generated token, the k most
                                  # likely (id, probability) in the output that committed it, most likely first
    accepted_depth: dict[int, int] = field(default_factory=dict)  # |S_k*| of the kept node per verification call
    draft_nodes: dict[int, int] = field(default_factory=dict)     # the plan's graph nodes (root incl.) per such call (fewer are verified where ranks run out)
    text: str | None = None

    def per_token(self, start: int = 0) -> dict[str, list]:
        """Tokens `start`.. of every kept field of the per-token record (`engine.state.Commits`), by
        field name: what a `StreamUpdate`'s or `LiveUpdate`'s `commits` holds for them."""
        kept = ((f.name, getattr(self, f"commit_{f.name}")) for f in dataclasses.fields(Commits))
        return {name: v[start:] for name, v in kept if v is not None}

    def as_dict(self) -> dict:
        """JSON-ready: every field (a per-token one only where kept), histograms keyed by str."""
        d = {"text": self.text}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name != "text" and not (v is None and f.name.startswith("commit_")):
                d[f.name] = {str(k): c for k, c in sorted(v.items())} if isinstance(v, dict) else _plain(v)
        return d


def _plain(v):
    """Tuples (a top alternative's (id, probability)) as lists, all the way down."""
    return [_plain(e) for e in v] if isinstance(v, (list, tuple)) else v


class _Pieces:
    """`probs` and `tops`: two fields of the pieces' per-token records (`commits`), per sequence
    (`tops` None without --top-logprobs; both None where `commits` is)."""

    commits: list[dict[str, list]] | None

    @property
    def probs(self) -> list[list[float]] | None:     # per sequence: those tokens' commit_prob
        return None if self.commits is None else [c["prob"] for c in self.commits]

    @property
    def tops(self) -> list[list | None] | None:      # and commit_top (--top-logprobs), else None
        return None if self.commits is None else [c.get("top") for c in self.commits]


@dataclass
class StreamUpdate(_Pieces):
    """What `Decoder.stream` yields after every model call (and once at the end): per sequence, the
    tokens that became final and their per-token record (`commits`: each field of
    `engine.state.Commits` the decoder keeps, as `SequenceResult.per_token` gives it)."""

    pieces: list[list[int]]                          # per sequence: token ids that became final
    results: list[SequenceResult] | None = None      # the last update only: what generate returns
    commits: list[dict[str, list]] | None = None     # per sequence: those tokens' record, by field


@dataclass
class Final(_Pieces):
    """Per batch row (in the batch's order): the tokens that became final and were not handed out
    before, their per-token record (`commits`, by field: `probs` and `tops` are two of them, `tops`
    None without --top-logprobs), and whether the row's sequence is over (`final_pieces`)."""

    pieces: list[list[int]]
    commits: list[dict[str, list]]
    ended: list[bool]


class StepOutput:
    """What one `Decoder.step` did to its `BatchState`.

    `called`: it made a model call (also the output's truth value); `boundary`: the state is at a
    block boundary now (rows may join and leave); `done`: nothing is left to decode. `final()`: per
    batch row, what became final and was not handed out by an earlier `final()` of this state (the
    state counts each row's tokens handed out, `BatchState.sent`), so asked after every step it is
    what that step made final. It is read back from the device only when asked (streaming and
    continuous batching; `generate` never asks: no host read is added to its steps), and only until
    the state changes again (the next step, a join or a leave): later it raises RuntimeError."""

    __slots__ = ("called", "boundary", "done", "_state", "_mask_id", "_version", "_final")

    def __init__(self, state, called: bool, mask_id: int | None):
        self.called, self.boundary, self.done = called, state.run is None, state.done
        self._state, self._mask_id, self._version, self._final = state, mask_id, state.version, None

    def __bool__(self) -> bool:
        return self.called

    def __repr__(self) -> str:
        return f"StepOutput(called={self.called}, boundary={self.boundary}, done={self.done})"

    def final(self) -> Final:
        st = self._state
        if self._final is None:
            if st.version != self._version:
                raise RuntimeError("StepOutput.final(): the state changed since this step (ask before the next "
                                   "step, join or leave)")
            self._final = Final([], [], []) if st.batch is None else \
                Final(*final_pieces(st.batch, st.run, self._mask_id, st.sent))
        return self._final


def aggregate(results: list[SequenceResult]) -> dict:
    """Statistics over many sequences: totals, TPF = all tokens / all calls, rows per call, the
    summed accepted-depth histogram and the share of tokens from accepted drafts."""
    calls = sum(r.calls for r in results)
    tokens = sum(r.tokens for r in results)
    rows = sum(r.rows_per_call * r.calls for r in results)
    hist: dict[int, int] = {}
    nodes: dict[int, int] = {}
    for r in results:
        for d, c in r.accepted_depth.items():
            hist[d] = hist.get(d, 0) + c
        for n, c in r.draft_nodes.items():
            nodes[n] = nodes.get(n, 0) + c
    drafted = sum(sum(r.commit_source) for r in results)
    return {"sequences": len(results), "tokens": tokens, "calls": calls, "tpf": tokens / max(calls, 1),
            "rows_per_call": rows / max(calls, 1), "draft_token_share": drafted / max(tokens, 1),
            "accepted_depth": {str(d): c for d, c in sorted(hist.items())},
            "draft_nodes": {str(n): c for n, c in sorted(nodes.items())},
            "stopped": sum(r.stopped for r in results)}


def collect_results(batch, block_length: int, seconds, rows=None) -> list[SequenceResult]:
    """One SequenceResult per row of a decoded batch (engine.state.Batch), read back once; `rows`:
    only these rows (default all); `seconds`: one wall time for all, or one per row."""
    rows = list(range(batch.x.shape[0])) if rows is None else list(rows)
    idx = torch.tensor(rows, dtype=torch.long, device=batch.x.device)
    kept = batch.gen_len if batch.out_len is None else batch.out_len
    x, start, length = batch.x[idx].cpu(), batch.gen_start[idx].tolist(), kept[idx].tolist()
    lead = ((batch.gen_start[idx] - batch.prompt_width) % block_length).tolist()   # --align sequence: prompt in block 0
    calls, n_rows, stop_at = batch.calls[idx].tolist(), batch.rows[idx].tolist(), batch.stop_at[idx].tolist()
    rec = batch.commits.take(idx).map(lambda _, t: t.cpu())
    depth_hist, nodes_hist = batch.depth_hist[idx].tolist(), batch.nodes_hist[idx].tolist()
    secs = seconds if isinstance(seconds, (list, tuple)) else [seconds] * len(rows)
    out = []
    for b in range(len(rows)):
        g0 = start[b]
        stopped = 0 <= stop_at[b] - g0 < length[b]         # (a stop token past gen length is not kept)
        n = stop_at[b] - g0 + 1 if stopped else length[b]
        span = slice(g0, g0 + n)
        ncall = calls[b]
        out.append(SequenceResult(
            token_ids=x[b, span].tolist(), calls=ncall, tokens=n, tpf=n / max(ncall, 1), seconds=secs[b],
            rows_per_call=n_rows[b] / max(ncall, 1), stopped=stopped,
            commit_block=[(lead[b] + i) // block_length for i in range(n)],
            **{f"commit_{name}": v for name, v in rec.lists(b, span).items()},
            accepted_depth={d: int(c) for d, c in enumerate(depth_hist[b]) if c},
            draft_nodes={k: int(c) for k, c in enumerate(nodes_hist[b]) if c}))
    return out


def final_lengths(batch, run, mask_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [B, N] with the open block's rows written in (`run`; None at a block boundary), final
    length [B]): per row, the count of its generated tokens that are final now, up to its first
    masked position or its stop token."""
    x, stop_at = batch.x, batch.stop_at
    if run is not None:
        x, stop_at = x.clone(), stop_at.clone()
        x[run.seqs], stop_at[run.seqs] = run.x, run.stop_at    # the open block's rows
    N = x.shape[1]
    col = torch.arange(N, device=x.device)
    gen = (col >= batch.gen_start[:, None]) & (col < (batch.gen_start + batch.gen_len)[:, None])
    first_masked = torch.where(gen & (x == mask_id), col, N).min(-1).values if mask_id is not None else \
        torch.full_like(stop_at, N)                 # uniform noise: no masks (an open block is not final: below)
    kept = batch.gen_len if batch.out_len is None else batch.out_len
    end = torch.minimum(first_masked, batch.gen_start + kept)
    end = torch.where(stop_at >= 0, torch.minimum(end, stop_at + 1), end)
    if run is not None and (run.post is not None or run.noise is not None):   # token editing, uniform noise: the open block's tokens
        open_rows = torch.zeros_like(stop_at, dtype=torch.bool)           # may change until the block closes
        open_rows[run.seqs] = run.pending if run.noise is None else True
        end = torch.where(open_rows, torch.minimum(end, batch.gen_start.clamp_min(run.win.lo)), end)
    return x, (end - batch.gen_start).clamp_min(0)


def ended_rows(batch, run) -> torch.Tensor:
    """[B] bool: the rows whose sequence is over with the latest call: in the open block, done with
    it (not pending, not failed), and stopped at a stop token or in their last block. At a block
    boundary (`run` None): the rows stopped or with no block left."""
    if run is None:
        return (batch.stop_at >= 0) | (batch.gen_start + batch.gen_len <= batch.cursor)
    ended = torch.zeros_like(batch.stop_at, dtype=torch.bool)
    last = (batch.gen_start + batch.gen_len)[run.seqs] <= run.win.lo + run.win.block_length
    over = ~run.pending & (run.failed == 0) & ((run.stop_at >= 0) | last)
    ended[run.seqs] = over if run.first is None else over & ~run.first    # (a rolling row awaiting its block's call)
    return ended


def final_pieces(batch, run, mask_id: int, sent: list[int]):
    """Tokens of every sequence that are final now and were not sent yet (updates `sent`): the
    generation up to its first masked position, or up to its stop token; and their per-token
    record (`Commits.lists`: a final token's is final too). Returns (pieces, commits, ended): a
    list each, `ended` the rows whose sequence is over (`ended_rows`); `run`: the open block, None
    at a block boundary. Reads back [B] values, then the new tokens and their record in one read
    per field for all rows (streaming and continuous batching only; generate never calls this)."""
    x, final = final_lengths(batch, run, mask_id)
    rec = batch.commits
    if run is not None:                                                    # the open block's rows
        rec = rec.map(lambda _, t: t.clone())
        rec.put(run.seqs, run.commits, slice(run.win.lo, run.win.lo + run.commits.prob.shape[1]))
    final, start, ended = torch.stack((final, batch.gen_start, ended_rows(batch, run).long())).tolist()  # one read
    fresh = [b for b, n in enumerate(final) if n > sent[b]]               # rows with nothing new read nothing
    pieces, commits = [[] for _ in final], [{k: [] for k in rec.kept()} for _ in final]
    if fresh:                    # the fresh rows' columns, read back once for all of them
        lo, hi = min(start[b] + sent[b] for b in fresh), max(start[b] + final[b] for b in fresh)
        idx = torch.tensor(fresh, device=x.device)
        xs, host = x[idx, lo:hi].cpu(), rec.take(idx, slice(lo, hi)).map(lambda _, t: t.cpu())
        for i, b in enumerate(fresh):
            new = slice(start[b] + sent[b] - lo, start[b] + final[b] - lo)
            pieces[b], commits[b] = xs[i, new].tolist(), host.lists(i, new)
    for b, n in enumerate(final):
        sent[b] = max(sent[b], n)
    return pieces, commits, [bool(e) for e in ended]
