"""The decoding worker, chosen once at start-up (--batching): `ContinuousScheduler` (the default,
continuous.py) or `StaticScheduler` (static.py), both a `Scheduler` (jobs.py: the bounded queue
of jobs, their fair order, and the one thread that owns the model). The HTTP side sees only the
`Scheduler` interface."""
from __future__ import annotations

from .continuous import ContinuousScheduler, live_key
from .jobs import Job, Owner, QueueFull, Scheduler, config_key
from .static import StaticScheduler

SCHEDULERS = {"continuous": ContinuousScheduler, "static": StaticScheduler}


def make_scheduler(batching: str, max_queue: int, max_batch: int, batch_wait: float = 0.0,
                   by_length: bool = False) -> Scheduler:
    """The scheduler of `--batching` (continuous or static; `by_length`: --batch-by-length, continuous
    only: static batches are of one length already)."""
    if batching == "continuous":
        return ContinuousScheduler(max_queue, max_batch, batch_wait, by_length)
    return SCHEDULERS[batching](max_queue, max_batch, batch_wait)


__all__ = ["SCHEDULERS", "ContinuousScheduler", "Job", "Owner", "QueueFull", "Scheduler", "StaticScheduler",
           "config_key", "live_key", "make_scheduler"]
