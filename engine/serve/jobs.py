"""Jobs and the scheduler interface. A `Job` is one choice of a request travelling between the
HTTP side (an asyncio queue of events) and the worker thread; a `Scheduler` is the bounded queue
of waiting jobs, its fair order, and the one thread (`run`) that owns the model and decodes them.
The HTTP side only ever calls `submit`, `cancel`, `close` and `queued` and reads `waiting`,
`running`, `stats`, `max_queue`, `max_batch`; the two schedulers (static.py, continuous.py) differ
only in `run`.

Fair between requests: a request's jobs (its prompts times n) take rows in turn with other
requests' jobs. The next free row goes to the waiting job of the request that holds the fewest
rows now, ties to the request that has waited longest since it last got one (`Scheduler._fair`),
so k requests hold about max_batch / k rows each and one alone takes them all."""
from __future__ import annotations

import asyncio
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
        self.gone = False                     # its client went away (counted once in `cancelled`)
        self.started = False                  # one of its jobs got a row (counted once in `requests`)


class Job:
    """One choice of a request between the HTTP side (an asyncio queue of events) and the worker
    thread; the jobs of one request share an `Owner`. Events: ("tokens", (piece, probs, tops)),
    ("done", SequenceResult), ("error", ApiError)."""

    def __init__(self, spec: Spec, loop: asyncio.AbstractEventLoop, owner: Owner | None = None):
        self.spec, self.loop = spec, loop
        self.owner = owner or Owner()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = False                # the client went away: output is discarded
        self.submitted = time.perf_counter()
        self.started = None
        self.batch_size = 0
        self.key = config_key(spec.config)

    def push(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:                  # the event loop is closed (shutdown)
            pass


def config_key(dc: DecodeConfig) -> tuple:
    """Jobs that may share a static batch: every option equal, but the seed with `--sampler row`
    (each row draws from its own generator, seeded with its job's seed)."""
    def freeze(v):
        return tuple(tuple(sorted(s)) for s in v.nodes) if isinstance(v, DraftGraph) else v
    per_row = dc.sampler == "row"
    return tuple(sorted((k, freeze(v)) for k, v in dc.as_dict().items() if not (per_row and k == "seed")))


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", "shutting_down")


def failure(e: Exception) -> ApiError:
    """What the jobs of a batch that raised `e` are told: a request the decoder refuses is a 400,
    anything else a 500 (the worker survives it)."""
    if isinstance(e, InputError):
        return ApiError(400, str(e), "invalid_value")
    return ApiError(500, f"decoding failed: {type(e).__name__}: {e}", "decoding_failed")


def stopped(e: BaseException) -> ApiError:
    """What the jobs of a batch are told when the worker itself stops (the server reports it)."""
    return ApiError(500, f"decoding stopped: {type(e).__name__}: {e}", "decoding_failed")


class Scheduler:
    """A bounded queue of waiting jobs, their fair order, and the worker loop `run(model)` that a
    subclass gives (StaticScheduler, ContinuousScheduler). Thread-safe: the HTTP side submits and
    cancels while the worker runs."""

    def __init__(self, max_queue: int, max_batch: int, batch_wait: float = 0.0):
        self.max_queue, self.max_batch, self.batch_wait = max_queue, max_batch, batch_wait
        self.cond = threading.Condition()
        self.waiting: list[Job] = []
        self.running = 0                      # rows decoding now (the /health and /metrics gauge)
        self.closing = False
        self.tick = 0                         # rows handed out so far: the fair order's clock
        self.arrivals = itertools.count()
        self.stats = {"requests": 0, "batches": 0, "rows": 0, "largest_batch": 0, "calls": 0, "cancelled": 0,
                      "aborted_batches": 0, "errors": 0}

    def run(self, model) -> None:
        """The worker thread: decode waiting jobs on `model` until `close`."""
        raise NotImplementedError

    def submit(self, *jobs: Job) -> None:
        """Queue a request's jobs: all of them, or none (QueueFull where they do not all fit in
        `max_queue`, the 503 `shutting_down` once closing)."""
        with self.cond:
            if self.closing:
                raise shutting_down()
            if len(self.waiting) + len(jobs) > self.max_queue:
                raise QueueFull(len(self.waiting))
            for job in jobs:
                if job.owner.seq is None:     # a new request waits from now: before those served since
                    job.owner.seq, job.owner.last = next(self.arrivals), self.tick - 0.5
                self.waiting.append(job)
            self.cond.notify()

    def cancel(self, job: Job, gone: bool = True) -> None:
        """Drop `job` if it still waits, else discard its output: its client went away (`gone`:
        counted in `cancelled` once per request), or another choice of its request failed."""
        with self.cond:
            if job.cancelled:
                return
            job.cancelled = True
            if gone and not job.owner.gone:
                job.owner.gone = True
                self.stats["cancelled"] += 1
            if job in self.waiting:
                self.waiting.remove(job)

    def close(self) -> None:
        with self.cond:
            self.closing = True
            for job in self.waiting:
                job.push("error", shutting_down())
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
        if not job.owner.started:             # `requests` counts requests, `rows` their choices
            job.owner.started = True
            self.stats["requests"] += 1

    def _failed(self, jobs, e: Exception, count_refusals: bool = False) -> None:
        """A batch raised `e`: its jobs are told; a 500 is counted in `errors` (a 400 too with
        `count_refusals`: the continuous scheduler counts every failed batch) with its traceback."""
        error = failure(e)
        if error.status == 500 or count_refusals:
            self.stats["errors"] += 1
        if error.status == 500:
            traceback.print_exc()
        for j in jobs:
            j.push("error", error)
