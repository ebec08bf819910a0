"""The OpenAI side of a request: errors in OpenAI's shape, the fields this server reads, and the
decoding options a request carries (at its top level or under `decoding`), merged over the
server's defaults."""
from __future__ import annotations

import difflib
import json
import math
from dataclasses import dataclass
from urllib.parse import quote

from ..config import DecodeConfig
from ..errors import InputError
from ..graph import DraftGraph
from ..methods import METHODS
from ..options import OPTIONS, resolve, spellings

NESTED = "decoding"            # the nested object that may hold the decoding options of a request
MAX_STOP = 4                   # OpenAI's limit on stop sequences
MAX_MESSAGE = 600              # characters of an error message: a refused megabyte value is not echoed back
MAX_UNKNOWN = 64               # unknown fields a request may carry (each is checked for a near miss)
MAX_ECHOED = 16                # of them named in the header, the log line and psd.ignored_fields
MAX_NAME = 64                  # characters of a field name echoed back
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
        self.status, self.message, self.code = status, short(one_line(message)), code
        self.param = param if param is None else short(param, 2 * MAX_NAME)    # a field's name: a key of any length
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code, param)


# OpenAI fields this server reads (engine/serve/server.py). A field that would change what is decoded
# elsewhere (OpenAI, vLLM and other servers) is accepted at its neutral value and refused otherwise
# (NEUTRAL); so is a field of the other endpoint (`messages` sent to completions) and a near miss of
# a known name (`treshold`). Any other field is ignored, named in the X-PSD-Ignored-Fields header and
# the log (--strict: refused).
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
ENDPOINTS = {"/v1/completions": COMPLETION_FIELDS, "/v1/chat/completions": CHAT_FIELDS}
# accepted, no effect on the answer: bookkeeping, caching, scheduling, latency hints (OpenAI's
# `prediction` speeds an answer up, never changes it); special tokens are never shown, so their spacing
IGNORED = {"user", "store", "metadata", "service_tier", "parallel_tool_calls", "prediction", "prompt_cache_key",
           "safety_identifier", "priority", "request_id", "cache_salt", "spaces_between_special_tokens"}
CLOSE = 0.8                    # difflib ratio from which an unknown name is a misspelling of a known one

# field -> (its neutral values, what another value does). A value equal to a neutral one (a number
# as a number: true is not 1) asks for nothing and is accepted; a field with no neutral value is
# refused whenever it is not null. A vLLM `guided_*` field is GUIDED.
NEUTRAL = {
    # OpenAI
    "best_of": ((1,), "it returns the likeliest of best_of samples"),
    "presence_penalty": ((0,), "it penalises tokens already in the text"),
    "frequency_penalty": ((0,), "it penalises tokens by how often they are in the text"),
    "logit_bias": (({},), "it biases chosen tokens' logits"),
    "suffix": (("",), "it inserts the answer before a suffix"),
    "tools": (([],), "it lets the model call tools"),
    "functions": (([],), "it lets the model call functions"),
    "tool_choice": (("none",), "it makes the model call a tool"),
    "function_call": (("none",), "it makes the model call a function"),
    "response_format": (({"type": "text"},), "it constrains the answer to JSON"),
    "modalities": ((["text"],), "it asks for audio"),
    "audio": ((), "it asks for audio"),
    "reasoning_effort": ((), "it sets a reasoning model's effort"),
    "verbosity": (("medium",), "it makes the answer shorter or longer"),
    "web_search_options": ((), "it searches the web"),
    # vLLM's sampling and prompt fields
    "use_beam_search": ((False,), "it decodes by beam search"),
    "length_penalty": ((1,), "it weighs beam-search answers by their length"),
    "repetition_penalty": ((1,), "it penalises tokens already in the prompt or the text"),
    "min_p": ((0,), "it drops tokens less likely than min_p times the likeliest"),
    "stop_token_ids": (([],), "it ends the answer at these tokens"),
    "include_stop_str_in_output": ((False,), "it keeps the stop string in the answer"),
    "bad_words": (([],), "it bans words"),
    "allowed_token_ids": ((), "it restricts the answer to these tokens"),
    "logits_processors": (([],), "it runs logits processors"),
    "prompt_logprobs": ((), "it scores the prompt's tokens"),
    "truncate_prompt_tokens": ((), "it cuts the prompt"),
    "skip_special_tokens": ((True,), "it shows special tokens in the text"),
    "add_special_tokens": ((True,), "it encodes the prompt without the tokenizer's special tokens"),
    "add_generation_prompt": ((True,), "it leaves the answer's turn unopened"),
    "continue_final_message": ((False,), "it continues the last message instead of answering it"),
    "chat_template": ((), "it renders the messages with another template (this server's: --chat-template)"),
    "chat_template_kwargs": (({},), "it passes variables to the chat template"),
    "documents": (([],), "it adds documents to the chat template"),
    "structured_outputs": ((), "it constrains the answer to a schema, regex, choice or grammar"),
    "structural_tag": ((), "it constrains the answer to tagged structures"),
    # SGLang, TGI, llama.cpp and Hugging Face generate
    "regex": ((), "it constrains the answer to a regular expression"),
    "ebnf": ((), "it constrains the answer to a grammar"),
    "json_schema": ((), "it constrains the answer to a JSON schema"),
    "grammar": ((), "it constrains the answer to a grammar"),
    "typical_p": ((1,), "it samples among the locally typical tokens"),
    "num_beams": ((1,), "it decodes by beam search"),
    "no_repeat_ngram_size": ((0,), "it bans repeated n-grams"),
}
GUIDED = ((), "it constrains the answer (vLLM's guided decoding)")


def _same(value, neutral) -> bool:
    """JSON equality that keeps booleans apart from numbers (1 == True in Python)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    return value == neutral


def neutral_problem(key: str, value) -> ApiError | None:
    """The 400 for a field that would change decoding with this value (NEUTRAL), else None."""
    rule = NEUTRAL.get(key) or (GUIDED if key.startswith("guided_") else None)
    if rule is None or value is None or any(_same(value, n) for n in rule[0]):
        return None
    only = " or ".join(json.dumps(n) for n in rule[0])
    return bad(f"{key} is not supported: {rule[1]}, which this server does not do; "
               + (f"only {only} (no effect) is accepted" if only else "leave it out"), key, "unsupported")


def shown(key: str) -> str:
    """A field name as a header value or a log line may carry it: printable ASCII, the rest (and %,
    a comma, a space) percent-encoded as UTF-8, at most MAX_NAME characters of it."""
    cut = key[:MAX_NAME]
    return quote(cut, safe=SAFE) + ("..." if len(key) > MAX_NAME else "")


SAFE = "".join(chr(c) for c in range(33, 127) if chr(c) not in "%,")


def _normal(name: str) -> str:
    return name.lower().replace("-", "_")


def near_miss(key: str, names) -> str | None:
    """The known name that `key` misspells (difflib's ratio >= CLOSE, case and - for _ aside), or None."""
    if len(key) > 2 * MAX_NAME:            # far longer than any name: not a misspelling (and not worth the time)
        return None
    by_normal = {_normal(n): n for n in names}
    hit = difflib.get_close_matches(_normal(key), list(by_normal), 1, CLOSE)
    return by_normal[hit[0]] if hit else None


def known_names() -> list[str]:
    """Every name a misspelling is looked for among: the decoding options (plugins' too) and the
    fields of either endpoint that change the answer."""
    fields = (COMPLETION_FIELDS | CHAT_FIELDS | set(NEUTRAL)) - IGNORED
    return sorted(fields | {"method", *spellings()})


def unknown_field(key: str, value, fields: set, names: list[str]) -> ApiError | None:
    """The 400 for a top-level field that is neither this endpoint's nor a decoding option, if it
    is refused: the other endpoint's field (but a switch turned off) or a misspelt known name; None
    for one that is ignored (IGNORED: silently; any other: named in the answer)."""
    if key in IGNORED:
        return None
    for path, theirs in ENDPOINTS.items():
        if key in theirs:                                # (key is not a field of this endpoint)
            if value is False:
                return None                              # a switch turned off asks for nothing
            ours = next((p for p, f in ENDPOINTS.items() if f is fields), "this endpoint")
            hint = {"prompt": "; chat takes messages", "messages": "; completions take a prompt",
                    "max_completion_tokens": "; completions take max_tokens"}.get(key, "")
            return bad(f"{key} is a field of {path}, not of {ours}{hint}", key, "unsupported")
    known = near_miss(key, names)
    if known is not None:
        return bad(f"unknown field {shown(key)!r}: did you mean {known!r}? (a misspelt field is refused: "
                   f"ignoring it would change the answer silently)", key, "unknown_field")
    return None


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
    `decoding` object, by option name or alias. Every other top-level field that is not one of
    `fields` (the endpoint's) is checked here: one that would change decoding at its value
    (NEUTRAL), the other endpoint's and a misspelt known name are 400s; an unknown one is an error
    too unless `ignored` is a list: its name is appended to it (at most MAX_UNKNOWN of them). Fields
    whose value is null are absent. With `max_length`, a draft graph's ranks are checked against it
    before the graph is built."""
    opts, where = {}, {}
    names = None                 # the known names, listed when a field first needs them

    def take(key, value, place):
        name = "method" if key == "method" else resolve(key).name
        if name == "top_logprobs":       # set from the logprobs fields (engine/serve/server.py), never as an option
            raise bad("top_logprobs is not a decoding option in a request: completions ask for K alternatives "
                      "with logprobs: K, chat with logprobs: true and top_logprobs: K", key, "unsupported")
        if name in SERVER_ONLY:
            raise bad(f"{OPTIONS[name].what} is set when the server starts, not per request", key)
        if name in opts:
            raise bad(f"the decoding option {name} is given twice ({where[name]!r} and {key!r})", key)
        opts[name], where[name] = (value if name == "method" else _engine_value(name, value, max_length)), key

    for key, value in body.items():
        if value is None or (key in fields and key not in ENGINE_FIELDS and key not in NEUTRAL):
            continue
        if key == "method" or _is_option(key):
            take(key, value, "top")
            continue
        problem = neutral_problem(key, value)
        if problem is not None:
            raise problem
        if key in NEUTRAL or key.startswith("guided_"):
            continue                                     # at its neutral value: asks for nothing
        names = names or known_names()
        problem = unknown_field(key, value, fields, names)
        if problem is not None:
            raise problem
        if key in IGNORED or key in COMPLETION_FIELDS or key in CHAT_FIELDS:
            continue                                     # no effect, or the other endpoint's switch turned off
        if ignored is None:
            raise bad(f"unknown field {shown(key)!r}: neither an OpenAI field of this endpoint nor a decoding "
                      f"option ({', '.join(['method'] + spellings())})", key, "unknown_field")
        if len(ignored) == MAX_UNKNOWN:
            raise bad(f"more than {MAX_UNKNOWN} unknown fields ({', '.join(map(shown, ignored[:MAX_ECHOED]))}, "
                      f"...); a request may carry at most {MAX_UNKNOWN}", None, "unknown_field")
        ignored.append(key)
    nested = body.get(NESTED)
    if nested is not None:
        if not isinstance(nested, dict):
            raise bad(f"{NESTED} must be an object of decoding options", NESTED)
        for key, value in nested.items():
            if value is None:
                continue
            if key != "method" and not _is_option(key):
                known = near_miss(key, ["method", *spellings()])
                raise bad(f"unknown decoding option {shown(key)!r} in {NESTED}"
                          + (f": did you mean {known!r}?" if known else "")
                          + f"; options: {', '.join(['method'] + spellings())}", NESTED, "unknown_field")
            take(key, value, NESTED)
    return opts


def _is_option(key: str) -> bool:
    try:
        resolve(key)
    except InputError:
        return False
    return True


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
