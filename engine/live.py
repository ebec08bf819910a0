"""Continuous batching: sequences join a running batch between two model calls and leave it when they
are done or cancelled (docs/loop.md, "Continuous batching").

A `LiveBatch` is a short loop over `Decoder.step` (one model call each) on one running batch
(`Decoder.start`). Where the decoder can (`Decoder.rolls`: cache none), the batch rolls: every row
keeps its own block cursor, a row done with its block starts its next one with the next call, a
joining sequence's first call rides on the next call, and an answered or cancelled sequence's row
leaves in the step that ends it (docs/loop.md, "Rolling rows"). Otherwise rows share one block
cursor: at each block boundary (`step` returns False) rows that finished or were cancelled leave
(`Decoder.leave`) and waiting sequences join (`Decoder.join`; inside an open block where
`Decoder.can_join` says so); a cancelled one takes no model call after `cancel` (its row stays, idle,
until the boundary); the batch is laid out so that every row's next block starts at one column, the
batch's cursor (a joining sequence's prompt ends there; `engine.state.join` pads whichever side is
shorter), so one block window serves every row whatever its progress. A sequence is answered by
the step that commits its last tokens (stage 1 on its last call's output, at the start of the next
step). Each block is its own unit in the loop (its first call builds its cache; only
`--cross-block` carries state, per row, to the next), so a sequence decodes as it would alone: at
temperature 0 its tokens are those of a single-request run.

    live = LiveBatch(Decoder(model, config), max_rows=32)
    h = live.add(prompt_ids)                  # joins with the next step (its first call made then)
    while (update := live.step()) is not None:     # at most one model call per step
        update.pieces.get(h)                  # tokens that became final with that call
        update.commits.get(h)                 # and their per-token record (update.probs: its commit_prob)
        update.done.get(h)                    # its SequenceResult, once it is done
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .config import check_prompts, check_seeds, exact_int
from .errors import DecodingError, InputError
from .results import SequenceResult, collect_results, ended_rows
from .state import Batch
from .uniform import check_batchable


@dataclass
class LiveUpdate:
    """What one `LiveBatch.step` did: per handle, the tokens that became final, and the results of
    the sequences that ended (a cancelled sequence ends without a result)."""

    pieces: dict[int, list[int]] = field(default_factory=dict)
    done: dict[int, SequenceResult] = field(default_factory=dict)
    commits: dict[int, dict[str, list]] = field(default_factory=dict)   # the pieces' per-token record, by field
    rows: int = 0                       # sequences in the batch during this call
    handles: tuple = ()                 # and their handles (rows that ended with it have left by now)

    @property
    def probs(self) -> dict[int, list[float]]:          # the pieces' commit_prob
        return {h: c["prob"] for h, c in self.commits.items()}

    @property
    def tops(self) -> dict[int, list | None]:           # and commit_top (None without --top-logprobs)
        return {h: c.get("top") for h, c in self.commits.items()}


class LiveBatch:
    """A running batch over one `Decoder`: `add` queues a sequence, `step` runs at most one model call
    (none when it only reports what a block boundary ended: the last update before it returns None)."""

    def __init__(self, decoder, max_rows: int | None = None, rolling: bool | None = None):
        """`rolling`: rows keep their own block cursors (`Decoder.start`); default where the decoder
        can (`Decoder.rolls`)."""
        if max_rows is not None:
            try:
                max_rows = exact_int(max_rows)
            except TypeError:
                raise InputError(f"max_rows must be an integer, got {max_rows!r}") from None
            if max_rows < 1:
                raise InputError(f"max_rows must be >= 1, got {max_rows}")
        check_batchable(decoder.mc)
        self.dec, self.max_rows = decoder, max_rows
        if rolling:
            decoder.require_rolls()
        self.rolling = decoder.rolls if rolling is None else rolling
        self.waiting: list[tuple[int, list[int], int, int | None]] = []   # (handle, prompt ids, gen length, seed)
        self.handles: list[int] = []                             # the batch's rows, in order
        self.joined: dict[int, float] = {}
        self.cancelled: set[int] = set()
        self.answered: set[int] = set()                          # reported done before their row left
        self.issued = 0                                          # handles given out: 0 .. issued-1
        self.state = None                                        # the running batch (Decoder.start), or None
        self._ended: LiveUpdate = LiveUpdate()                   # what the last block boundary ended

    # ------------------------------------------------------------------ the caller's side
    def add(self, prompt_ids, gen_length: int | None = None, seed: int | None = None) -> int:
        """Queue one sequence (token ids); it joins with the next step (at the next block boundary where
        `Decoder.can_join` says no). `seed`: its own sampling seed (`--sampler row`;
        default the config's seed + its row). Checked now: an InputError for a bad prompt or length.
        A gen length is a positive multiple of the block length, or any where blocks are counted from
        each sequence's start (`--align sequence`; auto on a block-causal model), as `generate` takes."""
        dc = self.dec.dc
        g = dc.gen_length if gen_length is None else gen_length
        ids = check_prompts(self.dec.mc, dc, [prompt_ids], gen_length=g)[0]       # and the gen length
        seed = check_seeds([seed], 1)[0]
        handle, self.issued = self.issued, self.issued + 1
        self.waiting.append((handle, ids, exact_int(g), seed))       # checked: a numpy int as an int
        return handle

    def cancel(self, handle: int) -> None:
        """Stop decoding `handle`: no model call after this one includes it (its row leaves the
        batch at the next block boundary; a waiting one never joins); no result is reported for it.
        A handle that has finished or was cancelled already is left as it is; one `add` never
        returned is an InputError."""
        try:
            index = exact_int(handle)
        except TypeError:
            index = -1
        if not 0 <= index < self.issued:
            raise InputError(f"cancel: {handle!r} is not a handle this batch gave out (add returns them)")
        handle = index
        if any(w[0] == handle for w in self.waiting):
            self.waiting = [w for w in self.waiting if w[0] != handle]
        elif handle in self.handles:
            self.cancelled.add(handle)
            if self.state is not None and self.dec.drops_at_once:           # its row leaves now
                self._release([self.handles.index(handle)])
            elif self.state is not None and self.state.run is not None:     # out of the open block's next calls
                self.dec.leave(self.state, [self.handles.index(handle)])

    @property
    def running(self) -> int:
        return len(self.handles)

    @property
    def rows_held(self) -> int:
        """The rows this batch holds or has promised: its sequences and those waiting to join
        (what a scheduler's row bound counts)."""
        return len(self.handles) + len(self.waiting)

    @property
    def idle(self) -> bool:
        return not self.handles and not self.waiting

    @torch.no_grad()
    def step(self) -> LiveUpdate | None:
        """Run the batch up to its next model call and report what became final; None when there
        is nothing to decode (no running and no waiting sequence). A sequence whose decoding fails
        raises a DecodingError whose `handle` is that sequence's: `cancel` it and the others go on
        (an error with no handle: the batch cannot go on)."""
        if self.state is None and not self.waiting:
            return None
        try:
            return self._step()
        except DecodingError as e:
            if e.sequence is not None:
                e.handle = self.handles[e.sequence]
            raise

    def _step(self) -> LiveUpdate | None:
        while True:
            if self.state is None or self.state.at_boundary:     # rows leave and join between two blocks
                self._between()
                if self.state is None or self.state.batch.cursor >= self.state.batch.end:
                    self.state = None
                    update, self._ended = self._ended, LiveUpdate()
                    return update
            elif self.waiting and self._room() > 0 and self.dec.joins_inside_a_block and \
                    (out := self._admit(time.perf_counter(), inside=True)):
                break                                            # they joined the open block: their first call
            if out := self.dec.step(self.state):
                break
        update, self._ended = self._ended, LiveUpdate()
        update.rows, update.handles = len(self.handles), tuple(self.handles)
        final = out.final()              # per row, in the batch's order (the state counts what was handed out)
        for h, piece, rec in zip(self.handles, final.pieces, final.commits):
            if piece and h not in self.cancelled:
                update.pieces[h], update.commits[h] = piece, rec
        over = [b for b, (h, e) in enumerate(zip(self.handles, final.ended))
                if e and h not in self.answered and h not in self.cancelled]
        if over:
            self._answer(self.state.batch, self.state.run, over, update)
            if self.state.rolling:              # their rows leave now: the room is the next sequence's (with a
                self._release(over)             # cache they wait for the boundary: joins there share one first call)
        return update

    def _answer(self, batch: Batch, run, rows: list[int], update: LiveUpdate) -> None:
        """Report the sequences of batch rows `rows`, over with this call, now: their results from
        a copy of their rows with the open block written in (the batch itself is settled at the
        block boundary, as for every row)."""
        idx = torch.tensor(rows, device=batch.x.device)
        done = batch.take(idx)
        at = {b: i for i, b in enumerate(run.seqs.tolist())}
        self.dec.settle(done, run, torch.tensor([at[b] for b in rows], device=idx.device),
                        into=torch.arange(len(rows), device=idx.device))
        now = time.perf_counter()
        secs = [now - self.joined[self.handles[b]] for b in rows]
        for b, res in zip(rows, collect_results(done, self.dec.dc.block_length, secs)):
            self._report(b, res, update)
            self.answered.add(self.handles[b])

    def _report(self, b: int, res: SequenceResult, update: LiveUpdate) -> None:
        """`res` as batch row b's result in `update`, with the tokens not handed out yet as its last piece."""
        h, sent = self.handles[b], self.state.sent
        rest = res.token_ids[sent[b]:]
        if rest:
            update.pieces[h] = update.pieces.get(h, []) + rest
            had = update.commits.get(h, {})
            update.commits[h] = {k: had.get(k, []) + v for k, v in res.per_token(sent[b]).items()}
        sent[b] = len(res.token_ids)
        update.done[h] = res

    # ------------------------------------------------------------------ between two blocks
    def _between(self) -> None:
        """At a block boundary: finished and cancelled rows leave, waiting sequences join."""
        now = time.perf_counter()
        if self.state is not None and self.handles:
            self._leave(now)
        if self._room() > 0 and self.waiting:
            self._admit(now)
        if not self.handles:
            self.state = None

    def _room(self) -> int:
        return len(self.waiting) if self.max_rows is None else self.max_rows - len(self.handles)

    def _admit(self, now: float, inside: bool = False):
        """Waiting sequences join, as many as there is room for: at a block boundary, or `inside`
        the open block (`Decoder.join` makes their first call at once), those that may
        (`Decoder.can_join`; the others wait for the boundary). Returns `Decoder.join`'s StepOutput
        (None when they start the batch or none may join now)."""
        fits = [w for w in self.waiting if not inside or self.dec.can_join(self.state, [w[1]], [w[2]])]
        joining = fits[:self._room()]
        if not joining:
            return None
        self.waiting = [w for w in self.waiting if w not in joining]
        prompts, lengths, seeds = [w[1] for w in joining], [w[2] for w in joining], [w[3] for w in joining]
        seeds = None if all(s is None for s in seeds) else seeds
        out = None
        if self.state is None:
            self.state = self.dec.start(prompts, lengths, live=True, seeds=seeds, rolling=self.rolling)
        else:
            out = self.dec.join(self.state, prompts, lengths, seeds=seeds)
        for h, *_ in joining:
            self.handles.append(h)
            self.joined[h] = now
        return out

    def _leave(self, now: float) -> None:
        """Collect the rows that are done (a stop token, or no block left) and drop those and the
        cancelled ones."""
        batch = self.state.batch
        done = ended_rows(batch, None).tolist()
        gone = self.cancelled | self.answered                    # leave without a result (now)
        out = [b for b, h in enumerate(self.handles) if done[b] or h in gone]
        if not out:
            self.dec.leave(self.state, [])           # trimmed: rows that joined inside a block widened it
            return
        finished = [b for b in out if self.handles[b] not in gone]
        if finished:          # rows that ended in no call of theirs (e.g. a block ETE had filled)
            secs = [now - self.joined[self.handles[b]] for b in finished]
            for b, res in zip(finished, self.dec.results(self.state, finished, secs)):
                self._report(b, res, self._ended)
        self._release(out)

    def _release(self, rows: list[int]) -> None:
        """Batch rows `rows` leave (`Decoder.leave`), their handles forgotten."""
        for b in rows:
            h = self.handles[b]
            self.joined.pop(h, None)
            self.cancelled.discard(h), self.answered.discard(h)
        self.handles = [h for b, h in enumerate(self.handles) if b not in set(rows)]
        self.dec.leave(self.state, rows, now=True)
        if self.state.batch is None:
            self.state = None
