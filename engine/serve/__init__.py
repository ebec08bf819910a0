"""`python -m engine.serve`: an OpenAI-compatible HTTP server over the decoding engine (docs/serve.md).

    python -m engine.serve --model DIR [decoding options] [--host 127.0.0.1] [--port 8000]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template, or
--chat-template), GET /v1/models, GET /health, GET /metrics (Prometheus text), GET /version.
`stream: true` answers with server-sent events in OpenAI's chunk format ending with `data: [DONE]`.
`n` and prompt lists fan out into one job per (prompt, sample); every answer carries a `psd`
object (canvas length, seed, calls, TPF). --api-key (or PSD_API_KEY) requires a Bearer key on
every path but /health; unknown request fields are ignored with an X-PSD-Ignored-Fields header
(--strict refuses them). Decoding options (method, threshold, depth,
cache, policy, ...) are taken per request at the top level of the body (where the openai client
puts `extra_body`) or under a nested `"decoding": {...}` object, checked exactly like the CLI's
(DecodeConfig.validate); the command line gives the server's defaults.

One worker thread owns the model; the HTTP side is async. With continuous batching (the default)
requests with equal decoding options share a running `engine.live.LiveBatch`: a request joins it
between two model calls and leaves when its own sequence ends, batches of different options
taking turns one model call each, up to --max-batch rows in all, shared fairly between requests.
`--batching static` decodes the fair next request and every waiting request with an equal
DecodeConfig (up to --max-batch) as one `Decoder.stream` call from start to end.

No request can take the server down: every size it asks for is checked against the option table
and the model's length before anything is allocated, a body over --max-body-bytes is a 413 unread,
and hostile JSON is a 400 (docs/serve.md, "Limits and hostile input").

This package is an optional entry point (`pip install -e .[serve]`): nothing else in the engine
imports it, and it imports fastapi/uvicorn only when the server is built.

protocol.py    OpenAI errors, request fields, decoding options of a request merged over the defaults
request.py     a request's JSON checked into Specs: a pure function of the body and the server's limits
answer.py      the text of one answer: max_tokens, stop tokens, stop sequences, streamed pieces
responses.py   answers in OpenAI's shapes: completion objects, SSE chunks, usage, psd, logprobs,
               the /health and /version bodies
metrics.py     counters, gauges and histograms; the /metrics text
jobs.py        a Job (one choice), the Scheduler interface: the job queue and its fair order
continuous.py  ContinuousScheduler: running batches joined between two calls and left at block boundaries
static.py      StaticScheduler: batches decoded from start to end (--batching static)
worker.py      the scheduler chosen once at start-up from --batching
server.py      the checkpoint, the model loaded in the worker, the limits a request is checked against
relay.py       a request's job events merged, sent as SSE or gathered into one answer
routes.py      the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics,
               /version, the API key, X-Request-Id, the body's size and read timeout
cli.py         the command line
"""
from .answer import Answer
from .cli import build_parser, main
from .protocol import ApiError, Spec, merge_options, request_options
from .request import Limits, parse_request, render_chat
from .routes import build_app
from .server import Server
from .worker import ContinuousScheduler, Job, Scheduler, StaticScheduler, make_scheduler

__all__ = ["Answer", "ApiError", "ContinuousScheduler", "Job", "Limits", "Scheduler", "Server", "Spec",
           "StaticScheduler", "build_app", "build_parser", "main", "make_scheduler", "merge_options",
           "parse_request", "render_chat", "request_options"]
