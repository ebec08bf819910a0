"""`python -m engine.serve`: an OpenAI-compatible HTTP server over the decoding engine (docs/serve.md).

    python -m engine.serve --model DIR [decoding options] [--host 127.0.0.1] [--port 8000]

Endpoints: POST /v1/completions, POST /v1/chat/completions (the checkpoint's chat template, or
--chat-template), GET /v1/models, GET /health. `stream: true` answers with server-sent events
in OpenAI's chunk format ending with `data: [DONE]`. Decoding options (method, threshold, depth,
cache, policy, ...) are taken per request at the top level of the body (where the openai client
puts `extra_body`) or under a nested `"decoding": {...}` object, checked exactly like the CLI's
(DecodeConfig.validate); the command line gives the server's defaults.

One worker thread owns the model; the HTTP side is async. Requests that wait while a batch is
decoding are decoded together in the next batch: the oldest waiting request and every waiting
request with an equal DecodeConfig (up to --max-batch), as one `Decoder.stream` call.

This module is an optional entry point (`pip install -e .[serve]`): nothing else in the engine
imports it, and it imports fastapi/uvicorn only when the server is built.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from models import DTYPES, CheckpointError, ModelConfig, Tokenizer

from .cli import DEFAULT_MODEL_DIR, add_decoding_flags, decoding_options
from .config import DecodeConfig, check_prompts
from .errors import InputError
from .graph import DraftGraph
from .methods import METHODS
from .options import OPTIONS, resolve, spellings

DTYPE_CHOICES = [d for d in DTYPES if d != "float16"]
NESTED = "decoding"            # the nested object that may hold the decoding options of a request
MAX_STOP = 4                   # OpenAI's limit on stop sequences


def _one_line(text) -> str:
    return " ".join(str(text).split())


# ====================================================================== errors
class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, _one_line(message), code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


# ====================================================================== request fields
# OpenAI fields this server reads. An unsupported feature is accepted at its neutral value and
# refused otherwise; a field that is neither an OpenAI field nor a decoding option is refused
# (a misspelt engine option would otherwise be silently ignored).
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", NESTED, "method"}
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                        "function_call", "response_format", "parallel_tool_calls", "store", "metadata",
                        "service_tier", "modalities"}
IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls"}   # accepted, no effect
NEUTRAL = {            # field -> (is the value neutral?, what the message says)
    "n": (lambda v: v == 1 and not isinstance(v, bool),
          "n must be 1 (one choice per request; concurrent requests are batched)"),
    "best_of": (lambda v: v == 1 and not isinstance(v, bool), "best_of must be 1"),
    "top_p": (lambda v: v == 1 and not isinstance(v, bool), "top_p is not supported (only 1); use temperature"),
    "presence_penalty": (lambda v: v == 0 and not isinstance(v, bool), "presence_penalty is not supported (only 0)"),
    "frequency_penalty": (lambda v: v == 0 and not isinstance(v, bool), "frequency_penalty is not supported (only 0)"),
    "logit_bias": (lambda v: v == {}, "logit_bias is not supported"),
    "logprobs": (lambda v: v is False or (v == 0 and not isinstance(v, bool)), "logprobs are not supported"),
    "top_logprobs": (lambda v: v == 0 and not isinstance(v, bool), "top_logprobs are not supported"),
    "echo": (lambda v: v is False, "echo is not supported"),
    "suffix": (lambda v: v == "", "suffix (insertion) is not supported"),
    "tools": (lambda v: v == [], "tools are not supported"),
    "functions": (lambda v: v == [], "functions are not supported"),
    "tool_choice": (lambda v: v == "none", "tool_choice is not supported"),
    "function_call": (lambda v: v == "none", "function_call is not supported"),
    "response_format": (lambda v: v == {"type": "text"},
                        "response_format is not supported (only {\"type\": \"text\"})"),
    "modalities": (lambda v: v == ["text"], "modalities other than [\"text\"] are not supported"),
}


@dataclass
class Spec:
    """A checked request: what to decode and how to cut and report the answer."""

    prompt_ids: list[int]
    config: DecodeConfig
    max_tokens: int
    stop: list[str]
    stream: bool
    include_usage: bool
    chat: bool


def _int(body, name, lo=1):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{name} must be an integer, got {json.dumps(v)[:60]}", name)
    if v < lo:
        raise bad(f"{name} must be >= {lo}, got {v}", name)
    return v


def _stop(body) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP:
        raise bad(f"stop takes at most {MAX_STOP} sequences, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad("stop sequences must not be empty", "stop")
    return stops


def _engine_value(name: str, value):
    """A request's JSON value for an option: a draft graph arrives as a list of rank lists."""
    if OPTIONS[name].kind is DraftGraph:
        if not isinstance(value, list):
            raise bad("graph must be a list of rank lists in a request (the server reads no files)", "graph")
        return DraftGraph(value)
    return value


def request_options(body: dict, fields: set) -> dict:
    """The decoding options of a request (method included), from its top level and/or its nested
    `decoding` object, by option name or alias; unknown fields are errors."""
    opts, where = {}, {}

    def take(key, value, place):
        if key == "method":
            name = "method"
        else:
            try:
                name = resolve(key).name
            except InputError:
                if place == NESTED:
                    raise bad(f"unknown decoding option {key!r} in {NESTED}; options: "
                              f"{', '.join(['method'] + spellings())}", NESTED, "unknown_field") from None
                raise bad(f"unknown field {key!r}: neither an OpenAI field of this endpoint nor a decoding "
                          f"option ({', '.join(['method'] + spellings())})", key, "unknown_field") from None
        if name in opts:
            raise bad(f"the decoding option {name} is given twice ({where[name]!r} and {key!r})", key)
        opts[name], where[name] = (value if name == "method" else _engine_value(name, value)), key

    for key, value in body.items():
        if value is not None and (key not in fields or key in ("method", "temperature", "seed")):
            take(key, value, "top")
    nested = body.get(NESTED)
    if nested is not None:
        if not isinstance(nested, dict):
            raise bad(f"{NESTED} must be an object of decoding options", NESTED)
        for key, value in nested.items():
            if value is not None:
                take(key, value, NESTED)
    return opts


def merge_options(server: dict, request: dict) -> dict:
    """The server's defaults overridden by a request's options. Server options that the request's
    method does not take are dropped (a server started with --method confidence --threshold 0.9
    still answers a request for method greedy), as is the server's depth/graph when the request
    gives the other."""
    method = request.get("method", server["method"])
    if not isinstance(method, str) or method not in METHODS:
        raise InputError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    for name, value in request.items():
        if name != "method":
            OPTIONS[name].validate(value)
    merged = {**server, **request, "method": method}
    for a, b in (("depth", "graph"), ("graph", "depth")):
        if a in request and b not in request:
            merged.pop(b, None)
    probe = DecodeConfig(**merged)
    takes = METHODS[method].takes(probe)
    for name in list(merged):
        if name != "method" and name not in request and not OPTIONS[name].general and name not in takes:
            del merged[name]
    return merged


# ====================================================================== text of an answer
class Answer:
    """The text of one answer, from its final tokens as they arrive: cut to `max_tokens` tokens,
    at the first stop token (EOS, ...) and at the first stop sequence. `add` returns the text that
    became certain (an incomplete UTF-8 character and a possible start of a stop sequence wait),
    so the streamed pieces concatenate to the text of the whole answer."""

    def __init__(self, tok: Tokenizer, max_tokens: int, stop: list[str], stop_ids):
        self.tok, self.max_tokens, self.stop, self.stop_ids = tok, max_tokens, stop, set(stop_ids)
        self.tokens: list[int] = []
        self.shown = ""
        self.done = False
        self.finish_reason = None
        self.completion_tokens = 0

    def add(self, piece: list[int]) -> str:
        if self.done:
            return ""
        self.tokens += piece
        return self._update(final=False)

    def finish(self) -> str:
        """All tokens are in (the decoder ended): the rest of the text."""
        return "" if self.done else self._update(final=True)

    def _update(self, final: bool) -> str:
        toks = self.tokens[:self.max_tokens]
        eos = next((i for i, t in enumerate(toks) if t in self.stop_ids), None)
        if eos is not None:
            toks = toks[:eos + 1]
        text = self.tok.decode(toks)
        complete = final or eos is not None or len(self.tokens) >= self.max_tokens
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            text, complete = text[:cut], True
            self.finish_reason = "stop"
            self.completion_tokens = next((n for n in range(1, len(toks) + 1)
                                           if any(s in self.tok.decode(toks[:n]) for s in self.stop)), len(toks))
        elif complete:
            self.finish_reason = "stop" if eos is not None else "length"
            self.completion_tokens = len(toks)
        else:
            text = text.rstrip("\ufffd")          # an incomplete UTF-8 character waits for its bytes
            hold = max((n for s in self.stop for n in range(min(len(s) - 1, len(text)), 0, -1)
                        if text.endswith(s[:n])), default=0)
            text = text[:len(text) - hold]
        new = ""
        if text.startswith(self.shown) and len(text) > len(self.shown):
            new, self.shown = text[len(self.shown):], text
        self.done = complete
        return new


# ====================================================================== the decoding worker
class QueueFull(Exception):
    pass


class Job:
    """One request between the HTTP side (an asyncio queue of events) and the worker thread."""

    def __init__(self, spec: Spec, loop: asyncio.AbstractEventLoop):
        self.spec, self.loop = spec, loop
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


class Scheduler:
    """A bounded queue of waiting jobs and the one thread that decodes them batch by batch."""

    def __init__(self, max_queue: int, max_batch: int, batch_wait: float = 0.0):
        self.max_queue, self.max_batch, self.batch_wait = max_queue, max_batch, batch_wait
        self.cond = threading.Condition()
        self.waiting: list[Job] = []
        self.running = 0
        self.closing = False
        self.stats = {"requests": 0, "batches": 0, "rows": 0, "largest_batch": 0, "calls": 0, "cancelled": 0,
                      "aborted_batches": 0, "errors": 0}

    def submit(self, job: Job) -> None:
        with self.cond:
            if self.closing:
                raise ApiError(503, "the server is shutting down", "shutting_down")
            if len(self.waiting) >= self.max_queue:
                raise QueueFull()
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

    def _next_batch(self) -> list[Job] | None:
        """The oldest waiting job and every waiting job with an equal config (up to max_batch)."""
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
            key = self.waiting[0].key
            batch = [j for j in self.waiting if j.key == key][:self.max_batch]
            for j in batch:
                self.waiting.remove(j)
            self.running = len(batch)
            return batch

    def run(self, model) -> None:
        from .loop import Decoder

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
                for j, piece in zip(batch, update.pieces):
                    if not j.cancelled:
                        live = True
                        if piece:
                            j.push("tokens", piece)
                if update.results is not None:
                    for j, res in zip(batch, update.results):
                        if not j.cancelled:
                            j.push("done", res)
                elif not live:                # every client of the batch went away: stop decoding it
                    self.stats["aborted_batches"] += 1
                    return
        finally:
            stream.close()


# ====================================================================== server state
class Server:
    """The checkpoint's cheap parts (config, tokenizer, defaults) at once; the model in the background."""

    def __init__(self, args: argparse.Namespace):
        if args.model is None:
            args.model = str(DEFAULT_MODEL_DIR)
        self.model_dir = Path(args.model)
        if not self.model_dir.is_dir():
            raise CheckpointError(f"model directory {self.model_dir} does not exist or is not a directory")
        self.mc = ModelConfig.from_dir(self.model_dir)
        self.tok = Tokenizer(self.model_dir)
        if args.chat_template is not None:
            self._set_chat_template(args.chat_template)
        self.name = args.served_model_name or self.model_dir.resolve().name
        opts = decoding_options(args)
        for name, value in _generation_defaults(self.model_dir).items():   # the checkpoint's suggestion
            opts.setdefault(name, value)
        self.defaults = {"method": args.method, **opts}
        DecodeConfig(**self.defaults).validate()          # bad server flags fail before the server starts
        self.args = args
        self.status, self.error = "loading", None
        self.scheduler = Scheduler(args.max_queue, args.max_batch, args.batch_wait_ms / 1000)
        self.created = int(time.time())
        self.exit_code = 0

    def _set_chat_template(self, value: str) -> None:
        """--chat-template: a file, or the template text itself; compiled by the tokenizer's own
        sandbox (Tokenizer has no public setter; docs/serve.md)."""
        path = Path(value)
        if path.is_file():
            try:
                text, source = path.read_text(encoding="utf-8"), f"the chat template {path}"
            except (OSError, UnicodeDecodeError) as e:
                raise InputError(f"cannot read --chat-template {path}: {e}") from None
        elif "{{" in value or "{%" in value:
            text, source = value, "the --chat-template text"
        else:
            raise InputError(f"--chat-template {value!r} is neither a file nor a Jinja template")
        self.tok.chat_template, self.tok._template_source = text, source
        self.tok._template = self.tok._compile()

    def load_and_serve(self, http) -> None:
        """The worker thread: load the model, warm it up, then decode batches until shutdown."""
        try:
            if self.args.load_delay:
                time.sleep(self.args.load_delay)
            import torch

            from models import load_model

            from .loop import generate

            if self.args.threads:
                torch.set_num_threads(self.args.threads)
            t0 = time.perf_counter()
            model = load_model(self.model_dir, dtype=self.args.dtype, device=_device(self.args.device))
            generate(model, [self.tok.encode("a") or [self.mc.eos_token_id]], gen_length=1, block_length=1)
            self.model = model
            print(f"model {self.name} loaded on {model.device} in {time.perf_counter() - t0:.1f} s; ready",
                  file=sys.stderr, flush=True)
        except BaseException as e:     # noqa: BLE001 -- reported, then the server stops with status 2
            self.status, self.error = "failed", _one_line(e)
            print(f"error: {self.error}", file=sys.stderr, flush=True)
            self.exit_code = 2
            http.should_exit = True
            return
        self.status = "ok"
        self.scheduler.run(model)

    # ------------------------------------------------------------------ parsing a request
    def parse(self, body: dict, chat: bool) -> Spec:
        fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model is required (a string; GET /v1/models lists it)", "model")
        if model != self.name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                           "model_not_found", "model")
        for name, (neutral, message) in NEUTRAL.items():
            if name in fields and body.get(name) is not None and not neutral(body[name]):
                raise bad(message, name, "unsupported")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise bad("stream must be a boolean", "stream")
        so = body.get("stream_options")
        if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"}
                               or not isinstance(so.get("include_usage", False), bool)):
            raise bad('stream_options must be {"include_usage": true|false}', "stream_options")
        max_tokens = _int(body, "max_tokens")
        if chat:
            mct = _int(body, "max_completion_tokens")
            if mct is not None and max_tokens is not None and mct != max_tokens:
                raise bad("max_tokens and max_completion_tokens differ", "max_completion_tokens")
            max_tokens = mct if mct is not None else max_tokens
        stop = _stop(body)
        try:
            opts = request_options(body, fields)
            text = self._chat_prompt(body.get("messages")) if chat else None
            ids = self._chat_ids(text) if chat else self._prompt_ids(body.get("prompt"))
            config, max_tokens = self._config(opts, max_tokens, len(ids))
            check_prompts(self.mc, config, [ids])
        except InputError as e:
            raise bad(str(e).replace("prompt 0 ", "the prompt ", 1)) from None
        return Spec(ids, config, max_tokens, stop, bool(stream), bool((so or {}).get("include_usage")), chat)

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InputError("the prompt is empty")
            return self.tok.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, list) for t in prompt):
            raise InputError("one prompt per request (send several requests: concurrent requests are batched)")
        if isinstance(prompt, list) and prompt and all(isinstance(t, str) for t in prompt):
            raise InputError("one prompt per request (send several requests: concurrent requests are batched)")
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise InputError("the prompt is empty")
            return prompt
        if prompt is None:
            raise InputError("prompt is required")
        raise InputError("prompt must be a string or a list of token ids")

    def _chat_prompt(self, messages) -> str:
        if not isinstance(messages, list) or not messages:
            raise InputError("messages must be a non-empty list of {\"role\", \"content\"} objects")
        out = []
        for n, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise InputError(f"message {n} must be an object with a string role")
            if m["role"] not in ("system", "developer", "user", "assistant"):
                raise InputError(f"message {n} has the role {m['role']!r}; this server takes system, developer, "
                                 f"user and assistant messages")
            extra = set(m) - {"role", "content", "name"}
            if extra:
                raise InputError(f"message {n} has unsupported fields: {', '.join(sorted(extra))}")
            content = m.get("content")
            if isinstance(content, list):
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content):
                    raise InputError(f"message {n}: only text content parts are supported")
                content = "".join(p["text"] for p in content)
            if not isinstance(content, str):
                raise InputError(f"message {n} must have string content")
            out.append({"role": m["role"], "content": content})
        if not any(m["content"].strip() for m in out):
            raise InputError("the messages are empty")
        return render_chat(self.tok, out)

    def _chat_ids(self, text: str) -> list[int]:
        return self.tok.encode(text)

    def _config(self, opts: dict, max_tokens: int | None, prompt_len: int) -> tuple[DecodeConfig, int]:
        """The request's DecodeConfig: gen length = max_tokens rounded up to the block length."""
        merged = merge_options(self.defaults, opts)
        block = merged.get("block_length", OPTIONS["block_length"].default)
        OPTIONS["block_length"].validate(block)
        room = self.mc.max_length - prompt_len
        if room < 1:
            raise InputError(f"the prompt of {prompt_len} tokens leaves no room for an answer within the "
                             f"model's maximum length {self.mc.max_length}")
        if "gen_length" in opts:
            OPTIONS["gen_length"].validate(opts["gen_length"])
            if max_tokens is None:
                max_tokens = opts["gen_length"]
            elif max_tokens > opts["gen_length"]:
                raise InputError(f"max_tokens {max_tokens} exceeds the requested gen_length {opts['gen_length']}")
        else:
            if max_tokens is None:         # the server's gen length, or what fits in the model's length
                max_tokens = merged.get("gen_length", OPTIONS["gen_length"].default)
                if math.ceil(max_tokens / block) * block > room and room >= block:
                    max_tokens = room // block * block
            merged["gen_length"] = math.ceil(max_tokens / block) * block
        gen = merged.get("gen_length")
        if prompt_len + gen > self.mc.max_length:
            raise InputError(f"the prompt of {prompt_len} tokens plus max_tokens {max_tokens} (decoded as {gen} "
                             f"tokens, a multiple of the block length {block}) exceeds the model's maximum "
                             f"length {self.mc.max_length}")
        return DecodeConfig(**merged).validate(), max_tokens


def render_chat(tok: Tokenizer, messages: list[dict]) -> str:
    """Messages through the checkpoint's chat template, ending with the generation prompt.
    `Tokenizer.apply_chat_template` takes one user text: a single user message goes through it
    (the CLI's --chat path); a conversation is rendered by the same compiled, sandboxed template."""
    if not tok.chat_template:
        raise InputError("this checkpoint has no chat template; use /v1/completions, or start the server with "
                         "--chat-template FILE (docs/serve.md)")
    try:
        if len(messages) == 1 and messages[0]["role"] == "user":
            return tok.apply_chat_template(messages[0]["content"])
        template = getattr(tok, "_template", None)
        if template is None:
            tok.apply_chat_template("")            # raises the tokenizer's own message (no jinja2, ...)
            raise InputError("the chat template cannot render a conversation")
        return template.render(messages=messages, add_generation_prompt=True,
                               bos_token=tok._specials.get("bos_token", ""),
                               eos_token=tok._specials.get("eos_token", ""))
    except CheckpointError as e:
        raise InputError(str(e)) from None
    except InputError:
        raise
    except Exception as e:      # noqa: BLE001 -- raise_exception(...) of the template, sandbox errors
        kind = "" if type(e).__name__ == "TemplateError" else f"{type(e).__name__}: "
        raise InputError(f"the chat template failed to render these messages: {kind}{_one_line(e)}") from None


def _generation_defaults(model_dir: Path) -> dict:
    """gen_length / block_length of the checkpoint's generation_config.json (as the CLI reads them)."""
    f = model_dir / "generation_config.json"
    try:
        cfg = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}
    except (OSError, ValueError):
        cfg = {}
    return {k: cfg[k] for k in ("gen_length", "block_length") if isinstance(cfg, dict) and type(cfg.get(k)) is int}


def _device(name: str) -> str:
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device {name} requested but CUDA is not available")
    try:
        return str(torch.device(name))
    except RuntimeError:
        raise InputError(f"unknown device {name!r}") from None


# ====================================================================== HTTP
def build_app(server: Server):
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    # FastAPI reads the handlers' (string) annotations from this module's globals: `request: Request`
    # must resolve there for the request to be injected (fastapi is imported only here)
    globals()["Request"] = Request
    app = FastAPI(title="psd-engine", docs_url=None, redoc_url=None, openapi_url=None)

    def error(e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status)

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
        sch = server.scheduler
        body = {"status": server.status, "model": server.name, "queue": len(sch.waiting), "running": sch.running,
                "max_queue": sch.max_queue, "max_batch": sch.max_batch, "stats": dict(sch.stats)}
        if server.error:
            body["error"] = server.error
        return JSONResponse(body, status_code=200 if server.status == "ok" else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.name, "object": "model", "created": server.created,
                                            "owned_by": "psd-engine", "max_model_len": server.mc.max_length}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    async def handle(request: Request, chat: bool):
        try:
            if server.status != "ok":
                raise ApiError(503, "the model is still loading; retry when GET /health answers 200" if
                               server.status == "loading" else f"the model failed to load: {server.error}",
                               server.status)
            try:
                body = json.loads(await request.body())
            except (ValueError, RecursionError) as e:
                raise bad(f"the body is not valid JSON: {e}", None, "invalid_json") from None
            if not isinstance(body, dict):
                raise bad("the body must be a JSON object", None, "invalid_json")
            spec = server.parse(body, chat)
            job = Job(spec, asyncio.get_running_loop())
            try:
                server.scheduler.submit(job)
            except QueueFull:
                raise ApiError(429, f"the server's queue is full ({server.scheduler.max_queue} requests waiting); "
                                    f"retry later", "queue_full") from None
        except ApiError as e:
            return error(e)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        answer = Answer(server.tok, spec.max_tokens, spec.stop, server.mc.stop_token_ids)
        if spec.stream:
            return StreamingResponse(sse(job, answer, rid), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await collect(request, job, answer, rid)

    def usage(job: Job, answer: Answer, res) -> dict:
        n_prompt = len(job.spec.prompt_ids)
        return {"prompt_tokens": n_prompt, "completion_tokens": answer.completion_tokens,
                "total_tokens": n_prompt + answer.completion_tokens,
                # the engine's own figures: the whole decoded answer (gen length, up to its stop token)
                "calls": res.calls, "tpf": round(res.tpf, 4), "decoded_tokens": res.tokens,
                "batch_size": job.batch_size, "queue_seconds": round(job.started - job.submitted, 4),
                "decode_seconds": round(res.seconds, 4)}

    def head(rid: str, chat: bool) -> dict:
        return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": server.name}

    def chunk(rid, chat, text=None, finish=None, role=False) -> str:
        if chat:
            delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return "data: " + json.dumps({**head(rid, chat), "choices": [choice]}, ensure_ascii=False) + "\n\n"

    async def sse(job: Job, answer: Answer, rid: str):
        chat, finished = job.spec.chat, False
        try:
            if chat:
                yield chunk(rid, chat, role=True)
            while True:
                kind, payload = await job.events.get()
                if kind == "tokens":
                    text = answer.add(payload)
                    if text:
                        yield chunk(rid, chat, text)
                elif kind == "done":
                    text = answer.finish()
                    if text:
                        yield chunk(rid, chat, text)
                    yield chunk(rid, chat, None if chat else "", answer.finish_reason)
                    if job.spec.include_usage:
                        yield "data: " + json.dumps({**head(rid, chat), "choices": [],
                                                     "usage": usage(job, answer, payload)}) + "\n\n"
                    finished = True
                    yield "data: [DONE]\n\n"
                    return
                else:                                   # an ApiError: OpenAI's error object in the stream
                    finished = True
                    yield "data: " + json.dumps(payload.body()) + "\n\n"
                    yield "data: [DONE]\n\n"
                    return
        finally:                                        # the client disconnected: its row's output is dropped
            if not finished:
                server.scheduler.cancel(job)

    async def collect(request: Request, job: Job, answer: Answer, rid: str):
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
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": answer.shown, "logprobs": None, "finish_reason": answer.finish_reason}
            obj = "text_completion"
        return {"id": rid, "object": obj, "created": int(time.time()), "model": server.name,
                "choices": [choice], "usage": usage(job, answer, payload)}

    return app


# ====================================================================== command line
class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2, like python -m engine.generate
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine.serve", description=__doc__.split("\n")[0])
    p.add_argument("--model", help="checkpoint directory; default: the shipped models/default")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the model id clients send (default: the directory's name)")
    p.add_argument("--method", default="greedy", choices=list(METHODS),
                   help="default decoding method; requests may choose another")
    add_decoding_flags(p)
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--threads", type=int, help="torch CPU threads of the worker (default: torch's; on a shared "
                                               "CPU 1 is often fastest)")
    p.add_argument("--chat-template", help="Jinja chat template (a file, or the template text) for a checkpoint "
                                           "without one, or to replace its own")
    p.add_argument("--max-batch", type=int, default=32, help="most requests decoded together (1: one at a time)")
    p.add_argument("--max-queue", type=int, default=256, help="most requests waiting; more are answered 429")
    p.add_argument("--batch-wait-ms", type=float, default=10.0,
                   help="when idle, wait this long after a request for others to decode with it")
    p.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--access-log", action="store_true", help="log every request")
    p.add_argument("--load-delay", type=float, default=0.0, help=argparse.SUPPRESS)   # tests: a slow load
    return p


def main(argv=None) -> int:
    from .cli import guarded

    args = build_parser().parse_args(argv)
    return guarded(_main, args)


def _main(args) -> int:
    if args.max_batch < 1 or args.max_queue < 1:
        raise InputError("--max-batch and --max-queue must be >= 1")
    if not 0 <= args.batch_wait_ms <= 10_000:
        raise InputError("--batch-wait-ms must be in [0, 10000]")
    if args.threads is not None and args.threads < 1:
        raise InputError("--threads must be >= 1")
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise InputError("the server needs fastapi and uvicorn: pip install -e '.[serve]'") from None
    server = Server(args)
    http = uvicorn.Server(uvicorn.Config(build_app(server), host=args.host, port=args.port, log_level=args.log_level,
                                         access_log=args.access_log, timeout_graceful_shutdown=3))
    worker = threading.Thread(target=server.load_and_serve, args=(http,), name="psd-decoder", daemon=True)
    worker.start()
    print(f"serving {server.name} ({server.model_dir}) on http://{args.host}:{args.port} "
          f"(loading; GET /health answers 200 when ready)", file=sys.stderr, flush=True)
    http.run()
    server.scheduler.close()
    worker.join(timeout=10)
    if not http.started and server.exit_code == 0:
        return 1                                      # uvicorn could not bind (it logged why)
    return server.exit_code


if __name__ == "__main__":
    sys.exit(main())
