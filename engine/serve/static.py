"""Static batching (`--batching static`, the earlier scheduler): a waiting job and every waiting
job with an equal config (the gen length included), taken in the fair order, are decoded together
from start to end as one `Decoder.stream` call; a job that arrives meanwhile waits for the batch's
end."""
from __future__ import annotations

import time

from .jobs import Job, Scheduler, shutting_down, stopped


class StaticScheduler(Scheduler):
    """Batch after batch, each decoded from start to end."""

    def run(self, model) -> None:
        from ..distributed import decoder_class

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
            except Exception as e:        # noqa: BLE001 -- the worker survives whatever one batch does
                self._failed(batch, e)
            except BaseException as e:    # the worker stops (the server reports it): its clients are told
                for j in batch:
                    j.push("error", stopped(e))
                raise
            finally:
                self.running = 0

    def _next_batch(self) -> list[Job] | None:
        """A waiting job (`_fair`) and waiting jobs with an equal config, up to max_batch, taken in
        the fair order (round-robin over their requests); None once closed."""
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

    def _decode(self, decoder, batch: list[Job]) -> None:
        """One batch through `decoder.stream`: each model call's final pieces to their jobs, then
        the results; stops early when the server closes or every client went away."""
        stream = decoder.stream([j.spec.prompt_ids for j in batch], seeds=[j.spec.config.seed for j in batch])
        try:
            for update in stream:
                if self.closing:
                    for j in batch:
                        j.push("error", shutting_down())
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
