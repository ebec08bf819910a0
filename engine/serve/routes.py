"""The HTTP side: FastAPI routes over a `Server`, answers in OpenAI's shapes, streaming as
server-sent events. fastapi is imported only when the app is built.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations, and
`request: Request` must resolve to fastapi's class imported inside `build_app`.)"""
import asyncio
import hmac
import json
import math
import re
import sys
import threading
import time
import traceback
import uuid

from .answer import Answer
from .protocol import MAX_ECHOED, MAX_NAME, ApiError, check_length_header, parse_body, shown, too_large
from .worker import Job, Owner, QueueFull

REQUEST_ID = re.compile(rb"[!-~]{1,128}")     # a client's X-Request-Id kept as it is: printable ASCII, no spaces
RETRY_AFTER = "1"                              # seconds, on a 429: a queue slot frees when any choice is admitted


def build_app(server):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, PlainTextResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="psd-engine", docs_url=None, redoc_url=None, openapi_url=None)
    if not hasattr(server, "metrics"):
        server.metrics = Metrics()
    key = getattr(server.args, "api_key", None)
    if key:
        app.add_middleware(BearerAuth, key=key, metrics=server.metrics)
    app.add_middleware(RequestId, log=bool(getattr(server.args, "access_log", False)))   # outermost: every answer

    @app.exception_handler(HTTPException)
    async def http_error(request, exc):          # unknown paths, wrong methods
        status = exc.status_code
        return error(ApiError(status, f"{request.method} {request.url.path}: {exc.detail}",
                              "not_found" if status == 404 else None))

    @app.exception_handler(Exception)
    async def any_error(request, exc):           # a bug: answered, logged, the server goes on
        traceback.print_exception(exc)
        return error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error"))

    @app.get("/health")
    async def health():
        return JSONResponse(health_body(server), status_code=200 if server.status == "ok" else 503)

    @app.get("/version")
    async def version():
        return version_body(server)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(server), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "psd-engine", "max_model_len": server.mc.max_length}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(server, request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(server, request, chat=True)

    return app


class BearerAuth:
    """--api-key: every path but /health needs `Authorization: Bearer KEY`, else 401 (a plain ASGI
    middleware: the routes' disconnect checks see the client as they would without it)."""

    OPEN = ("/health",)

    def __init__(self, app, key: str, metrics):
        self.app, self.key, self.metrics = app, key.encode(), metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("path") not in self.OPEN:
            got = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
            scheme, _, token = got.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                self.metrics.request(scope.get("path", ""), 401)
                what = "a wrong API key" if got else "no API key"
                response = error(ApiError(401, f"{what}: this server needs the header 'Authorization: Bearer "
                                               f"KEY' (--api-key)", "invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"}))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestId:
    """X-Request-Id on every answer: the client's own (printable ASCII without spaces, at most 128
    characters) or a new one; with --access-log, one line per request naming it."""

    def __init__(self, app, log: bool):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        got = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        rid = got.decode("ascii") if got is not None and REQUEST_ID.fullmatch(got) else uuid.uuid4().hex
        t0, status = time.perf_counter(), None

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid.encode("ascii"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.log:       # the path as sent (h11 admits printable ASCII only there), never decoded
                host, port = scope.get("client") or ("-", 0)
                path = scope.get("raw_path", b"").decode("ascii", "replace")
                print(f"access: {host}:{port} \"{scope['method']} {path} HTTP/{scope.get('http_version', '1.1')}\" "
                      f"{status or '-'} {time.perf_counter() - t0:.3f}s request_id={rid}", file=sys.stderr, flush=True)


def head_timeout_protocol(seconds: float):
    """uvicorn's h11 protocol with a deadline for every request's line and headers: a connection
    that has not sent them within `seconds` of opening, or of its previous answer, is closed.
    (uvicorn's own keep-alive timer stops at the first byte, so a client that sends part of a
    request line and stalls would hold its connection forever.)"""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeadTimeout(H11Protocol):
        head_timer = None

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self):
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:          # a request's head arrived
                self._disarm()

        def on_response_complete(self):
            super().on_response_complete()
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self._arm()                       # (not when a pipelined request already started)

        def _arm(self):
            self._disarm()
            self.head_timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self):
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None

        def _expired(self):
            self.head_timer = None
            if not self.transport.is_closing():
                self.transport.close()

    return HeadTimeout


# ------------------------------------------------------------------------------------------ metrics
class Histogram:
    def __init__(self, buckets):
        self.buckets, self.counts, self.sum, self.count = tuple(buckets), [0] * len(buckets), 0.0, 0

    def observe(self, v: float) -> None:
        self.sum += v
        self.count += 1
        for i, b in enumerate(self.buckets):
            if v <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{b:g}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}",
                      f"{name}_count {self.count}"]


SECONDS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """What GET /metrics reports (Prometheus text format 0.0.4), counted on the HTTP side."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests: dict[tuple[str, int], int] = {}
        self.prompt_tokens = self.completion_tokens = self.decoded_tokens = self.sequence_calls = 0
        self.choices = 0
        self.latency, self.ttft = Histogram(SECONDS), Histogram(SECONDS)
        self.batch = Histogram((1, 2, 4, 8, 16, 32, 64, 128, 256))

    def request(self, path: str, status: int, seconds: float | None = None) -> None:
        with self.lock:
            key = (path if path in ("/v1/completions", "/v1/chat/completions") else "other", status)
            self.requests[key] = self.requests.get(key, 0) + 1
            if seconds is not None:
                self.latency.observe(seconds)

    def first_token(self, seconds: float) -> None:
        with self.lock:
            self.ttft.observe(seconds)

    def answered(self, prompt_tokens: int, results: list, answers: list, jobs: list) -> None:
        with self.lock:
            self.prompt_tokens += prompt_tokens
            self.choices += len(results)
            for res, answer, job in zip(results, answers, jobs):
                self.completion_tokens += answer.completion_tokens
                self.decoded_tokens += res.tokens
                self.sequence_calls += res.calls
                self.batch.observe(job.batch_size)

    def render(self, server) -> str:
        sch = server.scheduler
        stats = getattr(sch, "stats", {}) or {}
        with self.lock:
            families = [
                ("psd_requests_total", "counter", "HTTP requests answered, by endpoint and status",
                 [f'psd_requests_total{{endpoint="{e}",status="{s}"}} {c}'
                  for (e, s), c in sorted(self.requests.items())]),
                ("psd_choices_total", "counter", "choices decoded (one per prompt and sample)",
                 [f"psd_choices_total {self.choices}"]),
                ("psd_prompt_tokens_total", "counter", "prompt tokens of answered requests",
                 [f"psd_prompt_tokens_total {self.prompt_tokens}"]),
                ("psd_completion_tokens_total", "counter", "tokens returned (after max_tokens and stop cuts)",
                 [f"psd_completion_tokens_total {self.completion_tokens}"]),
                ("psd_generated_tokens_total", "counter", "tokens the engine decoded (gen length up to a stop token)",
                 [f"psd_generated_tokens_total {self.decoded_tokens}"]),
                ("psd_model_calls_total", "counter", "model forward calls of the decoding worker",
                 [f"psd_model_calls_total {stats.get('calls', self.sequence_calls)}"]),
                ("psd_sequence_calls_total", "counter", "model calls summed over the sequences in them",
                 [f"psd_sequence_calls_total {self.sequence_calls}"]),
                ("psd_tokens_per_forward", "gauge", "generated tokens / sequence calls since the start (TPF)",
                 [f"psd_tokens_per_forward {self.decoded_tokens / max(self.sequence_calls, 1):.6f}"]),
                ("psd_queue_length", "gauge", "requests with a choice waiting for the decoding worker",
                 [f"psd_queue_length {sch.queued()}"]),
                ("psd_running_batch_size", "gauge", "rows (choices) in the running batches now",
                 [f"psd_running_batch_size {getattr(sch, 'running', 0)}"]),
                ("psd_batch_size", "histogram", "the batch size each choice was decoded in", self.batch.lines("psd_batch_size")),
                ("psd_request_latency_seconds", "histogram", "request arrival to the last byte of the answer",
                 self.latency.lines("psd_request_latency_seconds")),
                ("psd_time_to_first_token_seconds", "histogram", "request arrival to the first final token",
                 self.ttft.lines("psd_time_to_first_token_seconds")),
            ]
        out = []
        for name, kind, what, lines in families:
            out += [f"# HELP {name} {what}", f"# TYPE {name} {kind}", *lines]
        return "\n".join(out) + "\n"


def version_body(server) -> dict:
    from importlib import metadata

    import torch

    try:
        version = metadata.version("psd-engine")
    except metadata.PackageNotFoundError:
        version = None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"version": version, "torch": torch.__version__, "triton": triton_version, "python": sys.version.split()[0],
            "model": server.name, "model_dir": str(server.model_dir), "family": server.mc.family,
            "max_model_len": server.mc.max_length}


def error(e: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_body(request, limit: int, timeout: float | None = None) -> bytes:
    """The request body, at most `limit` bytes: a larger Content-Length is refused unread, and a body
    without one (chunked) is refused as soon as what arrived passes the limit; one that has not
    arrived within `timeout` seconds is a 408 (the connection is closed)."""
    from starlette.requests import ClientDisconnect

    check_length_header(request.headers.get("content-length"), limit)
    body = bytearray()

    async def read():
        async for piece in request.stream():
            body.extend(piece)
            if len(body) > limit:
                raise too_large(limit, "")
    try:
        await asyncio.wait_for(read(), timeout)
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected", "client_disconnected") from None
    except asyncio.TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s (--read-timeout)",
                       "request_timeout", headers={"Connection": "close"}) from None
    return bytes(body)


def health_body(server) -> dict:
    sch = server.scheduler
    body = {"status": server.status, "model": server.name, "queue": sch.queued(), "queued_choices": len(sch.waiting),
            "running": sch.running,
            "max_queue": sch.max_queue, "max_batch": sch.max_batch, "stats": dict(sch.stats)}
    if server.error:
        body["error"] = server.error
    return body


async def submit(server, request, chat: bool) -> list[Job]:
    """The request checked, parsed and queued (one job per choice); every refusal is an ApiError."""
    if server.status == "loading":
        raise ApiError(503, "the model is still loading; retry when GET /health answers 200", "loading")
    if server.status != "ok":
        loaded = getattr(server, "model", None) is not None        # loaded: its worker stopped since
        raise ApiError(503, f"the server failed: {server.error}" if loaded else
                       f"the model failed to load: {server.error}", server.status)
    body = parse_body(await read_body(request, server.args.max_body_bytes, getattr(server.args, "read_timeout", None)))
    loop = asyncio.get_running_loop()
    owner = Owner()                             # the scheduler shares rows fairly between requests
    jobs = [Job(spec, loop, owner) for spec in server.parse(body, chat)]
    for n, job in enumerate(jobs):
        try:
            server.scheduler.submit(job)
        except BaseException as e:
            for queued in jobs[:n]:             # all of a request's choices or none
                server.scheduler.cancel(queued)
            if isinstance(e, QueueFull):
                raise ApiError(429, f"the server's queue is full ({server.scheduler.max_queue} requests waiting); "
                                    f"retry later", "queue_full", headers={"Retry-After": RETRY_AFTER}) from None
            raise
    return jobs


async def handle(server, request, chat: bool):
    from fastapi.responses import StreamingResponse

    t0 = time.perf_counter()
    path = request.url.path
    try:
        jobs = await submit(server, request, chat)
    except ApiError as e:
        server.metrics.request(path, e.status, time.perf_counter() - t0)
        return error(e)
    spec = jobs[0].spec
    headers = {}
    if spec.ignored:
        # field names are the client's data: percent-encoded to printable ASCII (no CR, LF or NUL
        # splits the header or forges a log line), each cut, the first MAX_ECHOED of them named
        names = [shown(k) for k in spec.ignored[:MAX_ECHOED]]
        more = f" and {len(spec.ignored) - MAX_ECHOED} more" if len(spec.ignored) > MAX_ECHOED else ""
        headers["X-PSD-Ignored-Fields"] = ",".join(names)
        headers["X-PSD-Ignored-Count"] = str(len(spec.ignored))
        print(f"warning: {path}: ignored unknown fields {', '.join(names)}{more} (--strict refuses them)",
              file=sys.stderr, flush=True)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    answers = [Answer(server.tok, j.spec.max_tokens, j.spec.stop, server.mc.stop_token_ids, j.spec.config.min_tokens)
               for j in jobs]
    run = Run(server, jobs, answers, rid, t0, path)
    if spec.stream:
        return StreamingResponse(sse(run), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    out = await collect(run, request)
    if isinstance(out, dict):
        from fastapi.responses import JSONResponse
        out = JSONResponse(out, headers=headers)
    return out


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
        out, self.offsets[i] = logprob_entries(self.server, spec, ids, probs, tops, self.offsets[i])
        return out

    def cancel(self) -> None:
        """The client went away or one choice failed: the unfinished jobs are cancelled."""
        for job, res in zip(self.jobs, self.results):
            if res is None:
                self.server.scheduler.cancel(job)

    def close(self, status: int) -> None:
        for t in self.tasks:
            t.cancel()
        self.server.metrics.request(self.path, status, time.perf_counter() - self.t0)
        if status == 200:
            self.server.metrics.answered(self.prompt_tokens(), self.results, self.answers, self.jobs)

    def prompt_tokens(self) -> int:
        """Each prompt once (its n samples share it), as OpenAI counts."""
        return sum(len(job.spec.prompt_ids) for job in self.jobs if job.spec.sample == 0)

    def usage(self) -> dict:
        p = self.prompt_tokens()
        c = sum(a.completion_tokens for a in self.answers)
        calls = sum(r.calls for r in self.results)
        decoded = sum(r.tokens for r in self.results)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                # the engine's own figures: the whole decoded answers (gen length, up to a stop token)
                "calls": calls, "tpf": round(decoded / max(calls, 1), 4), "decoded_tokens": decoded,
                "batch_size": max(j.batch_size for j in self.jobs),
                "queue_seconds": round(max((j.started or j.submitted) - j.submitted for j in self.jobs), 4),
                "decode_seconds": round(max(r.seconds for r in self.results), 4)}

    def psd(self) -> dict:
        """The engine's side of the answer: what was decoded for max_tokens, with which seed."""
        first = self.jobs[0].spec
        dc = first.config
        out = {"method": dc.method, "max_tokens": first.max_tokens, "gen_length": dc.gen_length,
               "block_length": dc.block_length, "temperature": dc.temperature,
               "seed": dc.seed if dc.temperature > 0 else None, "calls": sum(r.calls for r in self.results),
               "tpf": round(sum(r.tokens for r in self.results) / max(sum(r.calls for r in self.results), 1), 4)}
        out["choices"] = [{"index": j.spec.index, "seed": j.spec.config.seed if dc.temperature > 0 else None,
                           "max_tokens": j.spec.max_tokens, "gen_length": j.spec.config.gen_length,
                           "calls": r.calls, "tpf": round(r.tpf, 4), "decoded_tokens": r.tokens}
                          for j, r in zip(self.jobs, self.results)]
        if first.ignored:          # JSON carries any name as data; the first MAX_ECHOED, each cut
            out["ignored_fields"] = [k[:MAX_NAME] for k in first.ignored[:MAX_ECHOED]]
            out["ignored_count"] = len(first.ignored)
        return out


def head(server, rid: str, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": server.name}


def event(obj: dict | str) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)) + "\n\n"


def chunk(server, rid, chat, text=None, finish=None, role=False, index=0, logprobs=None) -> str:
    if chat:
        delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return event({**head(server, rid, chat), "choices": [choice]})


async def sse(run: Run):
    """The answer as server-sent events, the choices' chunks interleaved; a client that goes away
    cancels its jobs."""
    server, rid, chat = run.server, run.rid, run.chat
    left, status = len(run.jobs), 499
    try:
        for job in run.jobs:
            if chat:
                yield chunk(server, rid, chat, role=True, index=job.spec.index)
            elif job.spec.echo:
                yield chunk(server, rid, chat, job.spec.echo, index=job.spec.index)
        while left:
            i, kind, payload = await run.queue.get()
            spec = run.jobs[i].spec
            index = spec.index
            text = run.event(i, kind, payload)
            logprobs = run.stream_logprobs(i) if spec.logprobs and kind in ("tokens", "done") else None
            if text or logprobs:
                yield chunk(server, rid, chat, text, index=index, logprobs=logprobs)
            if kind == "done":
                left -= 1
                yield chunk(server, rid, chat, None if chat else "", run.answers[i].finish_reason, index=index)
            elif kind != "tokens":                      # an ApiError: OpenAI's error object in the stream
                status = payload.status
                yield event(payload.body())
                break
        if not left:
            status = 200
            if run.jobs[0].spec.include_usage:
                yield event({**head(server, rid, chat), "choices": [], "usage": run.usage(), "psd": run.psd()})
        yield event("[DONE]")
    finally:                                            # the client disconnected: its rows' output is dropped
        if status != 200:
            run.cancel()
        run.close(status)


async def collect(run: Run, request):
    """The whole answer as one JSON object; a client that goes away cancels its jobs."""
    left = len(run.jobs)
    try:
        while left:
            try:
                i, kind, payload = await asyncio.wait_for(run.queue.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    run.cancel()
                    run.close(499)
                    return error(ApiError(499, "the client disconnected", "client_disconnected"))
                continue
            run.event(i, kind, payload)
            if kind == "done":
                left -= 1
            elif kind != "tokens":
                run.cancel()
                run.close(payload.status)
                return error(payload)
    except asyncio.CancelledError:
        run.cancel()
        run.close(499)
        raise
    choices = []
    for job, answer, res in zip(run.jobs, run.answers, run.results):
        spec = job.spec
        logprobs = token_logprobs(run.server, spec, answer, res) if spec.logprobs else None
        if spec.chat:
            choices.append({"index": spec.index, "message": {"role": "assistant", "content": answer.shown},
                            "logprobs": logprobs, "finish_reason": answer.finish_reason})
        else:
            choices.append({"index": spec.index, "text": spec.echo + answer.shown, "logprobs": logprobs,
                            "finish_reason": answer.finish_reason})
    run.close(200)
    return {"id": run.rid, "object": "chat.completion" if run.chat else "text_completion",
            "created": int(time.time()), "model": run.server.name, "choices": choices,
            "usage": run.usage(), "psd": run.psd()}


def token_logprobs(server, spec, answer: Answer, res) -> dict:
    """OpenAI's logprobs of one choice from the engine's probability of each committed token (the
    probability under the model output that committed it) and its alternatives in that output."""
    n = answer.completion_tokens
    tops = res.commit_top[:n] if res.commit_top is not None else [None] * n
    return logprob_entries(server, spec, res.token_ids[:n], res.commit_prob[:n], tops, len(spec.echo))[0]


def _by_text(alt: list[tuple[str, float]]) -> dict[str, float]:
    """Completions key alternatives by their text, most likely first; where two decode alike, the
    more likely one's log-prob stays."""
    out: dict[str, float] = {}
    for text, lp in alt:
        out.setdefault(text, lp)
    return out


def _logprob(p: float) -> float:
    return math.log(p) if p > 0 else -9999.0


def logprob_entries(server, spec, ids: list[int], probs: list[float], tops: list, offset: int) -> tuple[dict, int]:
    """The logprobs object of these tokens (chat's `content` list, or completions' parallel lists
    with text offsets from `offset`) and the offset after them. `tops`: per token its (id, prob)
    alternatives, most likely first, or None; the request's count of them is reported."""
    k = spec.config.top_logprobs
    text = server.tok.decode
    tokens = [text([t]) for t in ids]
    lps = [_logprob(p) for p in probs]
    alts = [[(text([i]), _logprob(p)) for i, p in (top or [])[:k]] for top in tops]
    if spec.chat:
        return {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode("utf-8")),
                             "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(a.encode("utf-8"))}
                                              for a, alp in alt]}
                            for t, lp, alt in zip(tokens, lps, alts)]}, offset
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top_logprobs = [_by_text(alt) for alt in alts] if k else None
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_logprobs, "text_offset": offsets}, offset
