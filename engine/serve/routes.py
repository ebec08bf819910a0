"""The HTTP side: FastAPI routes over a `Server`, answers in OpenAI's shapes, streaming as
server-sent events. fastapi is imported only when the app is built.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations, and
`request: Request` must resolve to fastapi's class imported inside `build_app`.)"""
import asyncio
import json
import time
import traceback
import uuid

from .answer import Answer
from .protocol import ApiError, check_length_header, parse_body, too_large
from .worker import Job, QueueFull


def build_app(server):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="psd-engine", docs_url=None, redoc_url=None, openapi_url=None)

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


def error(e: ApiError):
    from fastapi.responses import JSONResponse

    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def read_body(request, limit: int) -> bytes:
    """The request body, at most `limit` bytes: a larger Content-Length is refused unread, and a body
    without one (chunked) is refused as soon as what arrived passes the limit."""
    from starlette.requests import ClientDisconnect

    check_length_header(request.headers.get("content-length"), limit)
    body = bytearray()
    try:
        async for piece in request.stream():
            body += piece
            if len(body) > limit:
                raise too_large(limit, "")
    except ClientDisconnect:
        raise ApiError(499, "the client disconnected", "client_disconnected") from None
    return bytes(body)


def health_body(server) -> dict:
    sch = server.scheduler
    body = {"status": server.status, "model": server.name, "queue": len(sch.waiting), "running": sch.running,
            "max_queue": sch.max_queue, "max_batch": sch.max_batch, "stats": dict(sch.stats)}
    if server.error:
        body["error"] = server.error
    return body


async def submit(server, request, chat: bool) -> Job:
    """The request checked, parsed and queued; every refusal is an ApiError."""
    if server.status == "loading":
        raise ApiError(503, "the model is still loading; retry when GET /health answers 200", "loading")
    if server.status != "ok":
        loaded = getattr(server, "model", None) is not None        # loaded: its worker stopped since
        raise ApiError(503, f"the server failed: {server.error}" if loaded else
                       f"the model failed to load: {server.error}", server.status)
    body = parse_body(await read_body(request, server.args.max_body_bytes))
    job = Job(server.parse(body, chat), asyncio.get_running_loop())
    try:
        server.scheduler.submit(job)
    except QueueFull:
        raise ApiError(429, f"the server's queue is full ({server.scheduler.max_queue} requests waiting); "
                            f"retry later", "queue_full") from None
    return job


async def handle(server, request, chat: bool):
    from fastapi.responses import StreamingResponse

    try:
        job = await submit(server, request, chat)
    except ApiError as e:
        return error(e)
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    answer = Answer(server.tok, job.spec.max_tokens, job.spec.stop, server.mc.stop_token_ids)
    if job.spec.stream:
        return StreamingResponse(sse(server, job, answer, rid), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await collect(server, request, job, answer, rid)


def usage(job: Job, answer: Answer, res) -> dict:
    n_prompt = len(job.spec.prompt_ids)
    return {"prompt_tokens": n_prompt, "completion_tokens": answer.completion_tokens,
            "total_tokens": n_prompt + answer.completion_tokens,
            # the engine's own figures: the whole decoded answer (gen length, up to its stop token)
            "calls": res.calls, "tpf": round(res.tpf, 4), "decoded_tokens": res.tokens,
            "batch_size": job.batch_size, "queue_seconds": round(job.started - job.submitted, 4),
            "decode_seconds": round(res.seconds, 4)}


def head(server, rid: str, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": server.name}


def event(obj: dict | str) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)) + "\n\n"


def chunk(server, rid, chat, text=None, finish=None, role=False) -> str:
    if chat:
        delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    return event({**head(server, rid, chat), "choices": [choice]})


async def sse(server, job: Job, answer: Answer, rid: str):
    """The answer as server-sent events; a client that goes away cancels its job."""
    chat, finished = job.spec.chat, False
    try:
        if chat:
            yield chunk(server, rid, chat, role=True)
        while not finished:
            kind, payload = await job.events.get()
            text = answer.add(payload) if kind == "tokens" else answer.finish() if kind == "done" else ""
            if text:
                yield chunk(server, rid, chat, text)
            if kind == "done":
                yield chunk(server, rid, chat, None if chat else "", answer.finish_reason)
                if job.spec.include_usage:
                    yield event({**head(server, rid, chat), "choices": [], "usage": usage(job, answer, payload)})
            elif kind != "tokens":                      # an ApiError: OpenAI's error object in the stream
                yield event(payload.body())
            finished = kind != "tokens"
        yield event("[DONE]")
    finally:                                            # the client disconnected: its row's output is dropped
        if not finished:
            server.scheduler.cancel(job)


async def collect(server, request, job: Job, answer: Answer, rid: str):
    """The whole answer as one JSON object; a client that goes away cancels its job."""
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(job.events.get(), timeout=0.5)
            except asyncio.TimeoutError:
                if await request.is_disconnected():
                    server.scheduler.cancel(job)
                    return error(ApiError(499, "the client disconnected", "client_disconnected"))
                continue
            if kind == "tokens":
                answer.add(payload)
            elif kind == "done":
                answer.finish()
                break
            else:
                return error(payload)
    except asyncio.CancelledError:
        server.scheduler.cancel(job)
        raise
    if job.spec.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": answer.shown},
                  "logprobs": None, "finish_reason": answer.finish_reason}
    else:
        choice = {"index": 0, "text": answer.shown, "logprobs": None, "finish_reason": answer.finish_reason}
    return {"id": rid, "object": "chat.completion" if job.spec.chat else "text_completion",
            "created": int(time.time()), "model": server.name, "choices": [choice],
            "usage": usage(job, answer, payload)}
