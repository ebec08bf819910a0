"""The OpenAI side of a request: errors in OpenAI's shape, the fields this server reads, and the
decoding options a request carries (at its top level or under `decoding`), merged over the
server's defaults."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..config import DecodeConfig
from ..errors import InputError
from ..graph import DraftGraph
from ..methods import METHODS
from ..options import OPTIONS, resolve, spellings

NESTED = "decoding"            # the nested object that may hold the decoding options of a request
MAX_STOP = 4                   # OpenAI's limit on stop sequences
MAX_MESSAGE = 600              # characters of an error message: a refused megabyte value is not echoed back
# integer options that are values, not counts of positions, steps or nodes: every other integer
# option a request sets is bounded by the model's maximum length (engine/serve/server.py)
NOT_SIZES = ("seed", "top_k")
# options a request may not set: a compile takes the worker for a minute; a profile is a server file;
# CUDA graphs hold device memory per captured (rows, block) shape
SERVER_ONLY = ("compile", "cost_profile", "cuda_graphs")


def one_line(text) -> str:
    return " ".join(str(text).split())


def short(text: str, limit: int = MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[:limit - 1] + "…"


class ApiError(Exception):
    """An HTTP error in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "invalid_request_error", 413: "invalid_request_error",
             429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, short(one_line(message)), code, param
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


# OpenAI fields this server reads. An unsupported feature is accepted at its neutral value and
# refused otherwise; a field that is neither an OpenAI field nor a decoding option is ignored, named
# in the X-PSD-Ignored-Fields header and the log (--strict: refused, as a misspelt engine option
# would otherwise be silently ignored).
COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
          "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "user", NESTED, "method",
          "min_tokens"}
# fields that are decoding options as well (engine/options.py): taken by request_options
ENGINE_FIELDS = ("method", "temperature", "seed", "top_p", "min_tokens")
MAX_N = 128                    # most choices per prompt
COMPLETION_FIELDS = COMMON | {"prompt", "echo", "best_of", "suffix"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "functions",
                        "function_call", "response_format", "parallel_tool_calls", "store", "metadata",
                        "service_tier", "modalities"}
IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls"}   # accepted, no effect
NEUTRAL = {            # field -> (is the value neutral?, what the message says)
    "best_of": (lambda v: v == 1 and not isinstance(v, bool), "best_of must be 1"),
    "presence_penalty": (lambda v: v == 0 and not isinstance(v, bool), "presence_penalty is not supported (only 0)"),
    "frequency_penalty": (lambda v: v == 0 and not isinstance(v, bool), "frequency_penalty is not supported (only 0)"),
    "logit_bias": (lambda v: v == {}, "logit_bias is not supported"),
    "suffix": (lambda v: v == "", "suffix (insertion) is not supported"),
    "tools": (lambda v: v == [], "tools are not supported"),
    "functions": (lambda v: v == [], "functions are not supported"),
    "tool_choice": (lambda v: v == "none", "tool_choice is not supported"),
    "function_call": (lambda v: v == "none", "function_call is not supported"),
    "response_format": (lambda v: v == {"type": "text"},
                        "response_format is not supported (only {\"type\": \"text\"})"),
    "modalities": (lambda v: v == ["text"], "modalities other than [\"text\"] are not supported"),
}


# ------------------------------------------------------------------------------------------ the body
def too_large(limit: int, what: str) -> ApiError:
    # the connection is closed after the answer: the rest of the body is not read
    return ApiError(413, f"the request body {what} exceeds the server's limit of {limit} bytes (--max-body-bytes)",
                    "body_too_large", headers={"Connection": "close"})


def check_length_header(value: str | None, limit: int) -> None:
    """A Content-Length over the limit is refused before a byte of the body is read."""
    if value is None:
        return
    if not value.strip().isdigit() or not value.isascii():
        raise bad(f"the Content-Length header {value[:40]!r} is not a byte count", None, "invalid_header")
    if int(value) > limit:
        raise too_large(limit, f"of {int(value)} bytes")


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON value")


PLAIN = {int, bool, type(None)}      # JSON values that need no check past the parser


def parse_body(raw: bytes) -> dict:
    """The JSON object of a request body. NaN and Infinity (not JSON), numbers beyond a double and
    strings holding a lone UTF-16 surrogate (which no tokenizer can encode) are refused here,
    naming where they are."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:     # (UnicodeDecodeError is a ValueError)
        raise bad(f"the body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object", None, "invalid_json")
    # every container once, its place as a linked (parent place, key) pair: a body of a million
    # values costs no string per value; a place is spelt out only for the message
    stack = [(body, None)]
    while stack:
        container, place = stack.pop()
        if isinstance(container, list) and set(map(type, container)) <= PLAIN:
            continue                             # token ids: nothing to check, and checked fast
        for key, v in (container.items() if isinstance(container, dict) else enumerate(container)):
            if isinstance(key, str) and not _unicode(key):
                raise _surrogate(key, f"a key in {_spell(place) or 'the body'}", place)
            if isinstance(v, (dict, list)):
                if v:
                    stack.append((v, (place, key)))
            elif isinstance(v, str):
                if not _unicode(v):
                    raise _surrogate(v, _spell((place, key)), (place, key))
            elif isinstance(v, float) and not math.isfinite(v):
                raise bad(f"{_spell((place, key))}: the number is out of range (beyond a double)", _field((place, key)))
    return body


def _unicode(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _keys(place) -> list:
    keys = []
    while place is not None:
        place, key = place
        keys.append(key)
    return keys[::-1]


def _spell(place) -> str:
    """`messages[0].content`; a key with a lone surrogate escaped."""
    out = ""
    for key in _keys(place):
        out += f"[{key}]" if isinstance(key, int) else f".{ascii(key)[1:-1]}" if out else ascii(key)[1:-1]
    return out


def _field(place) -> str | None:
    """The request's top-level field at `place`."""
    keys = _keys(place)
    return ascii(keys[0])[1:-1] if keys else None


def _surrogate(s: str, where: str, place) -> ApiError:
    at = next(i for i, c in enumerate(s) if "\ud800" <= c <= "\udfff")
    return bad(f"{where} holds a lone UTF-16 surrogate ({ascii(s[at])[1:-1]} at character {at}); strings must "
               f"be valid Unicode", _field(place), "invalid_string")


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
    index: int = 0                 # the choice's index in the answer: prompt index * n + sample index
    sample: int = 0                # the sample index (0 to n - 1)
    echo: str = ""                 # text before the answer (completions' echo: the prompt)
    logprobs: bool = False         # report the log-prob of every committed token (streamed too)
    ignored: tuple = ()            # unknown top-level fields that were ignored (not --strict)


def int_field(body, name, lo=1, hi=None, why=""):
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad(f"{name} must be an integer, got {json.dumps(v)[:60]}", name)
    if v < lo or (hi is not None and v > hi):
        raise bad(f"{name} must be >= {lo}, got {short(str(v), 30)}" if v < lo else
                  f"{name} must be <= {hi}{why}, got {short(str(v), 30)}", name)
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


def _engine_value(name: str, value, max_length: int | None):
    """A request's JSON value for an option: a draft graph arrives as a list of rank lists, each
    rank a position within the model's length (checked before the graph is built)."""
    if OPTIONS[name].kind is DraftGraph:
        if not isinstance(value, list):
            raise bad("graph must be a list of rank lists in a request (the server reads no files)", "graph")
        if max_length is not None:
            for node in value:
                if isinstance(node, list) and (len(node) > max_length or any(
                        isinstance(r, int) and not isinstance(r, bool) and r >= max_length for r in node)):
                    raise bad(f"graph: the node {short(json.dumps(node), 60)} names a rank beyond the model's "
                              f"maximum length {max_length}", "graph")
        try:
            return DraftGraph(value)
        except InputError as e:
            raise bad(str(e), "graph") from None
    return value


def request_options(body: dict, fields: set, max_length: int | None = None, ignored: list | None = None) -> dict:
    """The decoding options of a request (method included), from its top level and/or its nested
    `decoding` object, by option name or alias; unknown fields are errors, except at the top level
    when `ignored` is a list: their names are appended to it. With `max_length`, a draft graph's
    ranks are checked against it before the graph is built."""
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
                if ignored is not None:
                    ignored.append(key)
                    return
                raise bad(f"unknown field {key!r}: neither an OpenAI field of this endpoint nor a decoding "
                          f"option ({', '.join(['method'] + spellings())})", key, "unknown_field") from None
        if name in SERVER_ONLY:
            raise bad(f"{OPTIONS[name].what} is set when the server starts, not per request", key)
        if name in opts:
            raise bad(f"the decoding option {name} is given twice ({where[name]!r} and {key!r})", key)
        opts[name], where[name] = (value if name == "method" else _engine_value(name, value, max_length)), key

    for key, value in body.items():
        if value is not None and (key not in fields or key in ENGINE_FIELDS):
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
    """The server's defaults overridden by a request's options, each checked by the option table (a
    bad one is a 400 naming it). Server options that the request's
    method does not take are dropped (a server started with --method confidence --threshold 0.9
    still answers a request for method greedy), as is the server's depth/graph when the request
    gives the other."""
    method = request.get("method", server["method"])
    if not isinstance(method, str) or method not in METHODS:
        raise bad(f"unknown method {short(repr(method), 60)}; expected one of {', '.join(METHODS)}", "method")
    for name, value in request.items():
        if name != "method":
            try:                         # the table's own check: type, choices, range (engine/options.py)
                OPTIONS[name].validate(value)
            except InputError as e:
                raise bad(str(e), name) from None
            except (OverflowError, ValueError, TypeError):     # a plugin's check meeting an absurd value
                raise bad(f"{OPTIONS[name].what}: the value {short(repr(value), 40)} is out of range", name) from None
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


def size_problem(options: dict, max_length: int) -> tuple[str, str] | None:
    """Integer decoding options count positions, steps or nodes of one sequence (gen length, block
    length, steps, window, ...; seed is a value): none may exceed the model's maximum length.
    (option, message) for the first that does; checked before any of them sizes anything."""
    for name, value in options.items():
        if name in NOT_SIZES or name not in OPTIONS or OPTIONS[name].kind is not int:
            continue
        if isinstance(value, int) and not isinstance(value, bool) and value > max_length:
            return name, (f"{OPTIONS[name].what} must be <= the model's maximum length {max_length}, "
                          f"got {short(str(value), 30)}")
    return None
