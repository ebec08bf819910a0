"""The OpenAI side of a request: errors in OpenAI's shape, the fields this server reads, and the
decoding options a request carries (at its top level or under `decoding`), merged over the
server's defaults."""
from __future__ import annotations

import json
from dataclasses import dataclass

from ..config import DecodeConfig
from ..errors import InputError
from ..graph import DraftGraph
from ..methods import METHODS
from ..options import OPTIONS, resolve, spellings

NESTED = "decoding"            # the nested object that may hold the decoding options of a request
MAX_STOP = 4                   # OpenAI's limit on stop sequences
# options a request may not set: a compile takes the worker for a minute; a profile is a server file
SERVER_ONLY = ("compile", "cost_profile")


def one_line(text) -> str:
    return " ".join(str(text).split())


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
             500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, one_line(message), code, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


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


def int_field(body, name, lo=1):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{name} must be an integer, got {json.dumps(v)[:60]}", name)
    if v < lo:
        raise bad(f"{name} must be >= {lo}, got {v}", name)
    return v


def stop_field(body) -> list[str]:
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
        if name in SERVER_ONLY:
            raise bad(f"{OPTIONS[name].what} is set when the server starts, not per request", key)
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
