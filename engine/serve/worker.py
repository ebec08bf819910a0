"""The decoding worker: a bounded queue of jobs and the one thread that owns the model.

Continuous batching (the default): jobs with equal decoding options share a running
`engine.live.LiveBatch` that they join at its next block boundary and leave when they are done,
so a short request sent after a long one can finish first, and an answer comes when its own
sequence ends. Batches of different options take turns, one model call each. Static batching
(`--batching static`, the earlier behaviour): a waiting job and every waiting job with an equal
config are decoded together from start to end.

Fair between requests: a request's jobs (its prompts times n) take rows in turn with other
requests' jobs. The next free row goes to the waiting job of the request that holds the fewest
rows now, ties to the request that has waited longest since it last got one (`Scheduler._fair`),
so k requests hold about max_batch / k rows each and one alone takes them all."""
from __future__ import annotations

import asyncio
import collections
import itertools
import threading
import time
import traceback

from ..config import DecodeConfig
from ..errors import InputError
from ..graph import DraftGraph
from .protocol import ApiError, Spec


class QueueFull(Exception):
    pass


class Owner:
    """The HTTP request that jobs belong to, as the fair scheduler sees it: when it last got a
    row (in the scheduler's ticks) and its order of arrival."""

    def __init__(self):
        self.last, self.seq = None, None


class Job:
    """One choice of a request between the HTTP side (an asyncio queue of events) and the worker
    thread; the jobs of one request share an `Owner`."""

    def __init__(self, spec: Spec, loop: asyncio.AbstractEventLoop, owner: Owner | None = None):
        self.spec, self.loop = spec, loop
        self.owner = owner or Owner()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False                # the client went away: output is discarded
        self.submitted = time.perf_counter()
        self.started = None
        self.batch_size = 0
        self.key = _config_key(spec.config)

    def push(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:                  # the event loop is closed (shutdown)
            pass


def _config_key(dc: DecodeConfig) -> tuple:
    def freeze(v):
        return tuple(tuple(sorted(s)) for s in v.nodes) if isinstance(v, DraftGraph) else v
    return tuple(sorted((k, freeze(v)) for k, v in dc.as_dict().items()))


def live_key(dc: DecodeConfig) -> tuple:
    """Jobs that may share a running batch: equal options but the generation length (a sequence
    keeps its own), unless a step count ties the schedule to it."""
    return tuple((k, v) for k, v in _config_key(dc) if k != "gen_length" or dc.steps is not None)


class Scheduler:
    """A bounded queue of waiting jobs and the one thread that decodes them batch by batch."""

    def __init__(self, max_queue: int, max_batch: int, batch_wait: float = 0.0, continuous: bool = True):
        self.max_queue, self.max_batch, self.batch_wait = max_queue, max_batch, batch_wait
        self.continuous = continuous
        self.cond = threading.Condition()
        self.waiting: list[Job] = []
        self.running = 0
        self.closing = False
        self.tick = 0                         # rows handed out so far: the fair order's clock
        self.arrivals = itertools.count()
        self.stats = {"requests": 0, "batches": 0, "rows": 0, "largest_batch": 0, "calls": 0, "cancelled": 0,
                      "aborted_batches": 0, "errors": 0}

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closing:
                raise ApiError(503, "the server is shutting down", "shutting_down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull()
            if job.owner.seq is None:         # a new request waits from now: before those served since
                job.owner.seq, job.owner.last = next(self.arrivals), self.tick - 0.5
            self.waiting.append(job)
            self.cond.notify()

    def cancel(self, job: Job) -> None:
        """The client of `job` went away: drop it if it still waits, else discard its output."""
        with self.cond:
            if job.cancelled:
                return
            job.cancelled = True
            self.stats["cancelled"] += 1
            if job in self.waiting:
                self.waiting.remove(job)

    def close(self) -> None:
        with self.cond:
            self.closing = True
            for job in self.waiting:
                job.push("error", ApiError(503, "the server is shutting down", "shutting_down"))
            self.waiting.clear()
            self.cond.notify_all()

    def queued(self) -> int:
        """Requests with a job waiting."""
        with self.cond:
            return len({id(j.owner) for j in self.waiting})

    def _fair(self, rows: dict, key=None) -> Job | None:
        """The waiting job (of config `key`, if given) that gets the next row: the oldest one of the
        request holding the fewest rows (`rows`: by id of owner), ties to the request that waited
        longest since its last row. Taking it (`_take`) counts its row and moves its request back."""
        best, rank = None, None
        for j in self.waiting:
            if key is not None and j.key != key:
                continue
            r = (rows.get(id(j.owner), 0), j.owner.last, j.owner.seq)
            if rank is None or r < rank:
                best, rank = j, r
        return best

    def _take(self, job: Job, rows: dict) -> None:
        self.waiting.remove(job)
        rows[id(job.owner)] = rows.get(id(job.owner), 0) + 1
        self.tick += 1
        job.owner.last = self.tick

    def _next_batch(self) -> list[Job] | None:
        """A waiting job (`_fair`) and waiting jobs with an equal config, up to max_batch, taken in
        the fair order (round-robin over their requests)."""
        with self.cond:
            idle = not self.waiting
            while True:
                while not self.waiting and not self.closing:
                    self.cond.wait()
                if idle and self.batch_wait > 0 and self.max_batch > 1:   # requests sent together start together
                    self.cond.wait_for(lambda: self.closing or len(self.waiting) >= self.max_batch, self.batch_wait)
                    idle = False
                if self.closing:
                    return None
                if self.waiting:             # (a waiting client may have gone away meanwhile)
                    break
            rows: dict = {}
            key = self._fair(rows).key
            batch = []
            while len(batch) < self.max_batch and (job := self._fair(rows, key)) is not None:
                self._take(job, rows)
                batch.append(job)
            self.running = len(batch)
            return batch

    def run(self, model) -> None:
        from ..distributed import decoder_class

        if self.continuous:
            return self._run_continuous(model)
        Decoder = decoder_class()                      # tensor parallel: rank 0 sends each model call to the others

        while True:
            batch = self._next_batch()
            if batch is None:
                return
            now = time.perf_counter()
            for j in batch:
                j.started, j.batch_size = now, len(batch)
            st = self.stats
            st["batches"] += 1
            st["rows"] += len(batch)
            st["largest_batch"] = max(st["largest_batch"], len(batch))
            try:
                self._decode(Decoder(model, batch[0].spec.config), batch)
            except InputError as e:
                for j in batch:
                    j.push("error", ApiError(400, str(e)))
            except Exception as e:        # noqa: BLE001 -- the worker survives whatever one batch does
                st["errors"] += 1
                traceback.print_exc()
                for j in batch:
                    j.push("error", ApiError(500, f"decoding failed: {type(e).__name__}: {e}", "decoding_failed"))
            except BaseException as e:    # the worker stops (the server reports it): its clients are told
                for j in batch:
                    j.push("error", ApiError(500, f"decoding stopped: {type(e).__name__}: {e}", "decoding_failed"))
                raise
            finally:
                st["requests"] += len(batch)
                self.running = 0

    def _decode(self, decoder, batch: list[Job]) -> None:
        stream = decoder.stream([j.spec.prompt_ids for j in batch])
        try:
            for update in stream:
                if self.closing:
                    for j in batch:
                        j.push("error", ApiError(503, "the server is shutting down", "shutting_down"))
                    return
                self.stats["calls"] += update.results is None     # one update per model call, then the end
                live = False
                for j, piece, probs, tops in zip(batch, update.pieces, update.probs, update.tops):
                    if not j.cancelled:
                        live = True
                        if piece:
                            j.push("tokens", (piece, probs, tops))
                if update.results is not None:
                    for j, res in zip(batch, update.results):
                        if not j.cancelled:
                            j.push("done", res)
                elif not live:                # every client of the batch went away: stop decoding it
                    self.stats["aborted_batches"] += 1
                    return
        finally:
            stream.close()

    # ------------------------------------------------------------------ continuous batching
    def _run_continuous(self, model) -> None:
        """Admit waiting jobs into the running batch of their options (up to max_batch rows each),
        then advance one batch by one model call, batches taking turns; until closed."""
        lives: dict[tuple, _Live] = {}
        turn: collections.deque = collections.deque()
        while True:
            with self.cond:
                while not self.closing and not self.waiting and not lives:
                    self.cond.wait()
                if self.closing:
                    for live in lives.values():
                        for j in live.jobs.values():
                            j.push("error", ApiError(503, "the server is shutting down", "shutting_down"))
                    return
                self._admit(model, lives, turn)
                for live in lives.values():          # clients that went away leave at the next boundary
                    gone = [h for h, j in live.jobs.items() if j.cancelled]
                    for h in gone:
                        live.batch.cancel(h)
                        del live.jobs[h]
                    if gone and not live.jobs:       # every client of the batch went away: it stops
                        self.stats["aborted_batches"] += 1
                self.running = self._rows(lives)
            if not turn:
                continue
            key = turn[0]
            turn.rotate(-1)
            live = lives[key]
            if not self._advance(live):
                del lives[key]                           # idle or failed: its decoder goes
                turn.remove(key)
            self.running = self._rows(lives)             # (also 0 once the last batch is idle)

    @staticmethod
    def _rows(lives: dict) -> int:
        return sum(lv.batch.running + len(lv.batch.waiting) for lv in lives.values())

    def _admit(self, model, lives: dict, turn) -> None:
        from ..distributed import decoder_class
        from ..live import LiveBatch

        Decoder = decoder_class()                        # tensor parallel: rank 0 sends each model call to the others
        rows = self._rows(lives)
        held: dict = {}                                  # rows each request holds now
        for lv in lives.values():
            for j in lv.jobs.values():
                held[id(j.owner)] = held.get(id(j.owner), 0) + 1
        # --max-batch bounds the rows of all running batches; a free row goes to the fair next job
        while rows < self.max_batch and (job := self._fair(held)) is not None:
            self._take(job, held)
            key = live_key(job.spec.config)
            live = lives.get(key)
            if live is None:
                try:
                    live = _Live(LiveBatch(Decoder(model, job.spec.config), max_rows=self.max_batch))
                except InputError as e:
                    job.push("error", ApiError(400, str(e)))
                    continue
                lives[key] = live
                turn.append(key)
                self.stats["batches"] += 1                 # a running batch formed
            try:
                handle = live.batch.add(job.spec.prompt_ids, gen_length=job.spec.config.gen_length)
            except InputError as e:
                job.push("error", ApiError(400, str(e)))
                continue
            live.jobs[handle] = job
            rows += 1
            job.started = time.perf_counter()
            self.stats["requests"] += 1
            self.stats["rows"] += 1

    def _advance(self, live: "_Live") -> bool:
        """One model call of one running batch, its tokens and results handed to their jobs;
        False when it is idle or failed (its jobs are told)."""
        st = self.stats
        try:
            update = live.batch.step()
        except Exception as e:            # noqa: BLE001 -- the worker survives whatever one batch does
            st["errors"] += 1
            code = 400 if isinstance(e, InputError) else 500
            if code == 500:
                traceback.print_exc()
            for j in live.jobs.values():
                j.push("error", ApiError(code, str(e)) if code == 400 else
                       ApiError(500, f"decoding failed: {type(e).__name__}: {e}", "decoding_failed"))
            return False
        except BaseException as e:        # the worker stops (the server reports it): its clients are told
            for j in live.jobs.values():
                j.push("error", ApiError(500, f"decoding stopped: {type(e).__name__}: {e}", "decoding_failed"))
            raise
        if update is None:
            return False
        if update.rows:
            st["calls"] += 1
            st["largest_batch"] = max(st["largest_batch"], update.rows)
            for h in live.batch.handles:         # the call's rows: an answer with no text piece counts too
                if h in live.jobs:
                    live.jobs[h].batch_size = max(live.jobs[h].batch_size, update.rows)
        for h, piece in update.pieces.items():
            j = live.jobs.get(h)
            if j is not None and not j.cancelled:
                j.push("tokens", (piece, update.probs[h], update.tops.get(h)))
        for h, res in update.done.items():
            j = live.jobs.pop(h, None)
            if j is not None and not j.cancelled:
                j.push("done", res)
        return True


class _Live:
    """A running batch of one set of options and the jobs of its sequences (by handle)."""

    def __init__(self, batch):
        self.batch, self.jobs = batch, {}
