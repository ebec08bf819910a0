"""A request's jobs relayed to its client: the worker's events of every choice merged (`Run`),
then sent as server-sent events (`sse`) or gathered into one answer (`collect`). The shapes come
from responses.py, the HTTP response itself from routes.py; nothing here imports fastapi."""
from __future__ import annotations

import asyncio
import time

from .protocol import ApiError
from .responses import chunk, completion, event, logprob_entries, prompt_tokens, psd, usage, usage_chunk


class Run:
    """The jobs of one request (one per choice), their answers, and their events merged."""

    def __init__(self, server, jobs, answers, rid, t0, path):
        self.server, self.jobs, self.answers, self.rid, self.t0, self.path = server, jobs, answers, rid, t0, path
        self.chat = jobs[0].spec.chat
        self.results = [None] * len(jobs)
        self.offsets = [len(job.spec.echo) for job in jobs]     # completions' text_offset of streamed logprobs
        self.first = None
        self.queue: asyncio.Queue = asyncio.Queue()
        self.tasks = [asyncio.ensure_future(self._pump(i, j)) for i, j in enumerate(jobs)]

    async def _pump(self, i, job):
        while True:
            event = await job.events.get()
            self.queue.put_nowait((i, *event))
            if event[0] != "tokens":
                return

    def event(self, i, kind, payload) -> str:
        """Apply one event; the new text of choice i."""
        if kind == "tokens":
            if self.first is None:
                self.first = time.perf_counter() - self.t0
                self.server.metrics.first_token(self.first)
            return self.answers[i].add(*payload)
        if kind == "done":
            self.results[i] = payload
            return self.answers[i].finish()
        return ""

    def stream_logprobs(self, i) -> dict | None:
        """The logprobs of choice i's tokens that were not streamed yet and whose text is out
        (None if there are none); their text offsets continue the choice's."""
        ids, probs, tops = self.answers[i].unreported()
        if not ids:
            return None
        spec = self.jobs[i].spec
        out, self.offsets[i] = logprob_entries(self.server.tok, spec, ids, probs, tops, self.offsets[i])
        return out

    def cancel(self, gone: bool = True) -> None:
        """The client went away (`gone`) or one choice failed: the unfinished jobs are cancelled."""
        for job, res in zip(self.jobs, self.results):
            if res is None:
                self.server.scheduler.cancel(job, gone)

    def close(self, status: int) -> None:
        for t in self.tasks:
            t.cancel()
        self.server.metrics.request(self.path, status, time.perf_counter() - self.t0)
        if status == 200:
            self.server.metrics.answered(prompt_tokens(self.jobs), self.results, self.answers, self.jobs)

    def usage(self) -> dict:
        return usage(self.jobs, self.answers, self.results)

    def psd(self) -> dict:
        return psd(self.jobs, self.results)


async def sse(run: Run):
    """The answer as server-sent events, the choices' chunks interleaved; a client that goes away
    cancels its jobs."""
    model, rid, chat = run.server.name, run.rid, run.chat
    left, status = len(run.jobs), 499
    try:
        for job in run.jobs:
            if chat:
                yield chunk(model, rid, chat, role=True, index=job.spec.index)
            elif job.spec.echo:
                yield chunk(model, rid, chat, job.spec.echo, index=job.spec.index)
        while left:
            i, kind, payload = await run.queue.get()
            spec = run.jobs[i].spec
            index = spec.index
            text = run.event(i, kind, payload)
            logprobs = run.stream_logprobs(i) if spec.logprobs and kind in ("tokens", "done") else None
            if text or logprobs:
                yield chunk(model, rid, chat, text, index=index, logprobs=logprobs)
            if kind == "done":
                left -= 1
                yield chunk(model, rid, chat, None if chat else "", run.answers[i].finish_reason, index=index)
            elif kind != "tokens":                      # an ApiError: OpenAI's error object in the stream
                status = payload.status
                yield event(payload.body())
                break
        if not left:
            status = 200
            if run.jobs[0].spec.include_usage:
                yield usage_chunk(model, rid, chat, run.usage(), run.psd())
        yield event("[DONE]")
    finally:                                            # the client disconnected: its rows' output is dropped
        if status != 200:
            run.cancel(gone=status == 499)
        run.close(status)


async def collect(run: Run, request) -> dict | ApiError:
    """The whole answer as one JSON object, or the ApiError that ended it; a client that goes
    away cancels its jobs the moment its connection closes (a task waits for that, beside the
    answer's events)."""
    left = len(run.jobs)
    gone = asyncio.ensure_future(disconnected(request))
    try:
        while left:
            event = asyncio.ensure_future(run.queue.get())
            await asyncio.wait((event, gone), return_when=asyncio.FIRST_COMPLETED)
            if not event.done():
                event.cancel()
                run.cancel()
                run.close(499)
                return ApiError(499, "the client disconnected", "client_disconnected")
            i, kind, payload = event.result()
            run.event(i, kind, payload)
            if kind == "done":
                left -= 1
            elif kind != "tokens":
                run.cancel(gone=False)
                run.close(payload.status)
                return payload
    except asyncio.CancelledError:
        run.cancel()
        run.close(499)
        raise
    finally:
        gone.cancel()
    body = completion(run.server.name, run.rid, run.server.tok, run.jobs, run.answers, run.results)
    run.close(200)
    return body


async def disconnected(request) -> None:
    """Returns when the client of `request` (its body already read) closes the connection."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
