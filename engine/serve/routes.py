"""The HTTP side: FastAPI routes over a `Server` and the middleware every answer passes (API key,
X-Request-Id): a request's body read within its limits, parsed (request.py), queued (the
scheduler), then relayed (relay.py) in OpenAI's shapes (responses.py). fastapi is imported only
when the app is built.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations, and
`request: Request` must resolve to fastapi's class imported inside `build_app`.)"""
import asyncio
import hmac
import json
import re
import sys
import time
import traceback
import uuid

from .answer import Answer
from .metrics import Metrics
from .protocol import MAX_ECHOED, ApiError, check_length_header, parse_body, shown, too_large
from .relay import Run, collect, sse
from .request import no_such_model
from .responses import health_body, version_body
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
        server.metrics.request(request.url.path, status, since_arrival(request.scope))
        return error(ApiError(status, f"{request.method} {request.url.path}: {exc.detail}",
                              "not_found" if status == 404 else None, headers=exc.headers))   # a 405's Allow

    def get(path):       # GET and HEAD (RFC 9110: HEAD wherever GET; the server sends the headers only)
        return app.api_route(path, methods=["GET", "HEAD"])

    @get("/health")
    async def health():
        return JSONResponse(health_body(server), status_code=200 if server.status == "ok" else 503)

    @get("/version")
    async def version():
        return version_body(server)

    @get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics.render(server.scheduler), media_type="text/plain; version=0.0.4")

    def card():
        return {"id": server.name, "object": "model", "created": server.created, "owned_by": "psd-engine",
                "max_model_len": server.mc.max_length}

    @get("/v1/models")
    async def models():
        return {"object": "list", "data": [card()]}

    @get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != server.name:
            return error(no_such_model(model_id, server.name))
        return card()

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
                self.metrics.request(scope.get("path", ""), 401, since_arrival(scope))
                what = "a wrong API key" if got else "no API key"
                response = error(ApiError(401, f"{what}: this server needs the header 'Authorization: Bearer "
                                               f"KEY' (--api-key)", "invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"}))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestId:
    """X-Request-Id on every answer: the client's own (printable ASCII without spaces, at most 128
    characters) or a new one; with --access-log, one line per request naming it. An exception out
    of the app (a bug) is answered here, a JSON 500 with the id, and logged once: the server goes on."""

    def __init__(self, app, log: bool):
        self.app, self.log = app, log

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope = origin_form(scope)
        got = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
        rid = got.decode("ascii") if got is not None and REQUEST_ID.fullmatch(got) else uuid.uuid4().hex
        t0, status = time.perf_counter(), None
        scope = {**scope, ARRIVED: t0}            # for the answers counted inside (since_arrival)

        async def send_with_id(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [(k, v) for k, v in message.get("headers", ()) if k.lower() != b"x-request-id"]
                message = {**message, "headers": headers + [(b"x-request-id", rid.encode("ascii"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except Exception as exc:                  # noqa: BLE001 -- a bug: answered, logged, the server goes on
            traceback.print_exception(exc)
            if status is not None:                # the answer had started (a stream): nothing more to say
                return
            await error(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error"))(
                scope, receive, send_with_id)
        finally:
            if self.log:       # the path as sent (h11 admits printable ASCII only there), never decoded
                host, port = scope.get("client") or ("-", 0)
                path = scope.get("raw_path", b"").decode("ascii", "replace")
                print(f"access: {host}:{port} \"{scope['method']} {path} HTTP/{scope.get('http_version', '1.1')}\" "
                      f"{status or '-'} {time.perf_counter() - t0:.3f}s request_id={rid}", file=sys.stderr, flush=True)


ARRIVED = "psd.arrived"           # the scope key RequestId sets: when the request's head was read


def since_arrival(scope) -> float:
    """Seconds since RequestId saw the request (0 where it did not: an app built without it)."""
    t0 = scope.get(ARRIVED)
    return 0.0 if t0 is None else time.perf_counter() - t0


def origin_form(scope: dict) -> dict:
    """`scope` with an absolute-form request target (`GET http://host/health HTTP/1.1`, which RFC 9112
    says a server must accept, as proxies send it) reduced to its path, so routing and the API key's
    open paths see `/health`; any other scope as it is."""
    path = scope.get("path") or "/"
    if path.startswith("/"):
        return scope
    from urllib.parse import unquote, urlsplit

    raw = urlsplit(scope.get("raw_path") or path.encode("latin-1", "replace")).path or b"/"
    return {**scope, "raw_path": raw, "path": unquote(raw.decode("latin-1"))}


def head_timeout_protocol(seconds: float, log: bool = False, metrics=None):
    """uvicorn's h11 protocol with a deadline for every request's line and headers: a connection
    that has not sent them within `seconds` of opening, or of its previous answer, is closed.
    (uvicorn's own keep-alive timer stops at the first byte, so a client that sends part of a
    request line and stalls would hold its connection forever.) A request that is not valid HTTP,
    which the app never sees, is answered 400 in OpenAI's shape with an X-Request-Id (`log`: and
    an access line; counted in `metrics`), as every other answer."""
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

        def send_400_response(self, msg: str) -> None:      # uvicorn's, for what h11 cannot parse
            not_http(self, log)
            if metrics is not None:
                metrics.request("", 400, 0.0)

    return HeadTimeout


def not_http(protocol, log: bool) -> None:
    """The answer to a request h11 cannot parse (uvicorn's was plain text without an id): a 400 in
    OpenAI's shape with a new X-Request-Id, and with `log` its access line; the connection closes."""
    import h11

    rid = uuid.uuid4().hex
    body = json.dumps(ApiError(400, "not a valid HTTP/1.1 request", "invalid_http").body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               (b"connection", b"close"), (b"x-request-id", rid.encode("ascii"))]
    for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                  h11.EndOfMessage()):
        protocol.transport.write(protocol.conn.send(event))
    protocol.transport.close()
    if log:
        host, port = protocol.client or ("-", 0)
        print(f"access: {host}:{port} \"- - HTTP/1.1\" 400 0.000s request_id={rid}", file=sys.stderr, flush=True)


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
    try:
        server.scheduler.submit(*jobs)          # all of a request's choices or none
    except QueueFull as e:
        raise ApiError(429, f"the server's queue is full ({e.args[0]} of {server.scheduler.max_queue} choices "
                            f"waiting, this request has {len(jobs)}); retry later", "queue_full",
                       headers={"Retry-After": RETRY_AFTER}) from None
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
    answers = [Answer(server.tok, j.spec.max_tokens, j.spec.stop, server.mc.stop_token_ids, j.spec.config.min_tokens,
                      after_text=not chat) for j in jobs]
    run = Run(server, jobs, answers, rid, t0, path)
    if spec.stream:
        return StreamingResponse(sse(run), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **headers})
    out = await collect(run, request)
    if isinstance(out, ApiError):
        return error(out)
    from fastapi.responses import JSONResponse
    return JSONResponse(out, headers=headers)
