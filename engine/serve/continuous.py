"""Continuous batching (the default): jobs with equal decoding options (but their generation
length, unless --batch-by-length) share a running `engine.live.LiveBatch` that they join between two of its model calls and leave when they are done,
so a short request sent after a long one can finish first, and an answer comes when its own
sequence ends. Batches of different options take turns, one model call each; --max-batch bounds
the rows of all of them together, a free row going to the fair next job (jobs.py)."""
from __future__ import annotations

import collections
import time

from ..config import DecodeConfig
from .jobs import Job, Scheduler, config_key, shutting_down, stopped


def live_key(dc: DecodeConfig, by_length: bool = False) -> tuple:
    """Jobs that may share a running batch: equal options but the generation length (a sequence
    keeps its own), unless a step count ties the schedule to it or `by_length` (--batch-by-length):
    a whole-canvas call is `rows × span` columns, `span` its longest row's, so a 32-token request
    beside a 64-token one computes the longer one's columns in each such call; one batch per
    length computes fewer columns, in smaller calls (docs/serve.md, "One running batch per length")."""
    return tuple((k, v) for k, v in config_key(dc) if k != "gen_length" or by_length or dc.steps is not None)


class _Live:
    """A running batch of one set of options and the jobs of its sequences (by handle)."""

    def __init__(self, batch):
        self.batch, self.jobs = batch, {}


class ContinuousScheduler(Scheduler):
    """Running batches (one per set of options) that jobs join between two calls and leave at block
    boundaries; `by_length`: one per generation length too (`live_key`)."""

    def __init__(self, max_queue: int, max_batch: int, batch_wait: float = 0.0, by_length: bool = False):
        super().__init__(max_queue, max_batch, batch_wait)
        self.by_length = by_length

    def run(self, model) -> None:
        """Admit waiting jobs into the running batch of their options (up to max_batch rows each),
        then advance one batch by one model call, batches taking turns; until closed."""
        lives: dict[tuple, _Live] = {}
        try:
            self._serve(model, lives)
        except BaseException as e:        # the worker stops (the server reports it): no running job waits on it
            self._tell_all(lives, stopped(e))
            raise

    @staticmethod
    def _tell_all(lives: dict, error) -> None:
        """Every job of every running batch gets `error` (the worker ends)."""
        for live in lives.values():
            for j in live.jobs.values():
                j.push("error", error)

    def _serve(self, model, lives: dict) -> None:
        turn: collections.deque = collections.deque()
        while True:
            with self.cond:
                while not self.closing and not self.waiting and not lives:
                    self.cond.wait()
                if self.closing:
                    self._tell_all(lives, shutting_down())
                    return
                self._drop_cancelled(lives)          # first: a gone client's row is free for this admission
                self._admit(model, lives, turn)
                self.running = self._rows(lives)
            if not turn:
                continue
            key = turn[0]
            turn.rotate(-1)
            if not self._advance(lives[key]):
                del lives[key]                           # idle or failed: its decoder goes
                turn.remove(key)
            self.running = self._rows(lives)             # (also 0 once the last batch is idle)

    @staticmethod
    def _rows(lives: dict) -> int:
        return sum(lv.batch.rows_held for lv in lives.values())

    def _drop_cancelled(self, lives: dict) -> None:
        """Clients that went away leave their batch now (`LiveBatch.cancel`; a uniform-noise model's
        rows at its next boundary)."""
        for live in lives.values():
            gone = [h for h, j in live.jobs.items() if j.cancelled]
            for h in gone:
                live.batch.cancel(h)
                del live.jobs[h]
            if gone and not live.jobs:       # every client of the batch went away: it stops
                self.stats["aborted_batches"] += 1

    def _admit(self, model, lives: dict, turn) -> None:
        """Free rows (--max-batch over all running batches) to the fair next jobs, each into the
        running batch of its options (a new one if there is none)."""
        rows = self._rows(lives)
        held: dict = {}                                  # rows each request holds now
        for lv in lives.values():
            for j in lv.jobs.values():
                held[id(j.owner)] = held.get(id(j.owner), 0) + 1
        while rows < self.max_batch and (job := self._fair(held)) is not None:
            self._take(job, held)
            try:
                live = self._live_for(model, job, lives, turn)
                handle = live.batch.add(job.spec.prompt_ids, gen_length=job.spec.config.gen_length,
                                        seed=job.spec.config.seed)
            except Exception as e:        # noqa: BLE001 -- its job's error (a 400 the decoder refuses); the rest go on
                self._failed([job], e)
                continue
            live.jobs[handle] = job
            rows += 1
            job.started = time.perf_counter()
            self.stats["rows"] += 1

    def _live_for(self, model, job: Job, lives: dict, turn) -> _Live:
        """The running batch of `job`'s options, formed now if there is none."""
        from ..distributed import decoder_class
        from ..live import LiveBatch

        key = live_key(job.spec.config, self.by_length)
        live = lives.get(key)
        if live is None:
            Decoder = decoder_class()                    # tensor parallel: rank 0 sends each model call to the others
            live = _Live(LiveBatch(Decoder(model, job.spec.config), max_rows=self.max_batch))
            lives[key] = live
            turn.append(key)
            self.stats["batches"] += 1                   # a running batch formed
        return live

    def _advance(self, live: _Live) -> bool:
        """One model call of one running batch, its tokens and results handed to their jobs;
        False when it is idle or failed (its jobs are told)."""
        try:
            update = live.batch.step()
        except Exception as e:            # noqa: BLE001 -- the worker survives whatever one batch does
            self._failed(live.jobs.values(), e, count_refusals=True)
            return False
        if update is None:
            return False
        if update.rows:
            self.stats["calls"] += 1
            self.stats["largest_batch"] = max(self.stats["largest_batch"], update.rows)
            for h in update.handles:             # the call's rows: an answer with no text piece counts too
                if h in live.jobs:
                    live.jobs[h].batch_size = max(live.jobs[h].batch_size, update.rows)
        for h, piece in update.pieces.items():
            j = live.jobs.get(h)
            if j is not None and not j.cancelled:
                j.push("tokens", (piece, update.commits[h]["prob"], update.commits[h].get("top")))
        for h, res in update.done.items():
            j = live.jobs.pop(h, None)
            if j is not None and not j.cancelled:
                j.push("done", res)
        return True
