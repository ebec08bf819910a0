"""What decoding returns: one `SequenceResult` per prompt, and statistics over many (§5)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SequenceResult:
    """What one prompt produced, and how (docs/algorithms.md §5)."""

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
    draft_nodes: dict[int, int] = field(default_factory=dict)     # graph nodes verified (root incl.) per such call
    text: str | None = None

    def as_dict(self) -> dict:
        d = {k: getattr(self, k) for k in ("text", "token_ids", "calls", "tokens", "tpf", "seconds", "rows_per_call",
                                           "stopped", "commit_call", "commit_step", "commit_source", "commit_block")}
        d["accepted_depth"] = {str(k): v for k, v in sorted(self.accepted_depth.items())}
        d["draft_nodes"] = {str(k): v for k, v in sorted(self.draft_nodes.items())}
        return d


@dataclass
class StreamUpdate:
    """What `Decoder.stream` yields after every model call (and once at the end)."""

    pieces: list[list[int]]                          # per sequence: token ids that became final
    results: list[SequenceResult] | None = None      # the last update only: what generate returns


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


def collect_results(batch, block_length: int, seconds: float) -> list[SequenceResult]:
    """One SequenceResult per row of a decoded batch (engine.state.Batch), read back once."""
    P = batch.prompt_width
    gen, calls, rows, stop_at = batch.x[:, P:].cpu(), batch.calls.cpu(), batch.rows.cpu(), batch.stop_at.cpu()
    c_call, c_step, c_src = batch.commit_call.cpu(), batch.commit_step.cpu(), batch.commit_source.cpu()
    depth_hist, nodes_hist = batch.depth_hist.cpu(), batch.nodes_hist.cpu()
    out = []
    for b in range(gen.shape[0]):
        n = int(stop_at[b]) + 1 if stop_at[b] >= 0 else gen.shape[1]
        ncall = int(calls[b])
        out.append(SequenceResult(
            token_ids=gen[b, :n].tolist(), calls=ncall, tokens=n, tpf=n / max(ncall, 1), seconds=seconds,
            rows_per_call=int(rows[b]) / max(ncall, 1), stopped=bool(stop_at[b] >= 0),
            commit_call=c_call[b, :n].tolist(), commit_step=c_step[b, :n].tolist(),
            commit_source=c_src[b, :n].tolist(), commit_block=[i // block_length for i in range(n)],
            accepted_depth={d: int(c) for d, c in enumerate(depth_hist[b].tolist()) if c},
            draft_nodes={n: int(c) for n, c in enumerate(nodes_hist[b].tolist()) if c}))
    return out


def final_pieces(batch, run, mask_id: int, sent: list[int]) -> list[list[int]]:
    """Tokens of every sequence that are final now and were not sent yet (updates `sent`): the
    generation up to its first masked position, or up to its stop token. Reads back [B] lengths
    and the new tokens (streaming only; generate never calls this)."""
    P = batch.prompt_width
    gen, stop_at = batch.x[:, P:].clone(), batch.stop_at.clone()
    gen[run.seqs], stop_at[run.seqs] = run.x[:, P:], run.stop_at    # the open block's rows
    G = gen.shape[1]
    first_masked = torch.where(gen == mask_id, torch.arange(G, device=gen.device), G).min(-1).values
    final = torch.where(stop_at >= 0, torch.minimum(first_masked, stop_at + 1), first_masked).tolist()
    pieces = []
    for b, n in enumerate(final):
        pieces.append(gen[b, sent[b]:n].tolist() if n > sent[b] else [])
        sent[b] = max(sent[b], n)
    return pieces
