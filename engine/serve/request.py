"""An OpenAI request checked into `Spec`s, as a pure function of its JSON and the server's limits:
`parse_request(body, chat, limits)` returns one `Spec` per choice (prompt x sample) or raises one
`ApiError` with a one-line message. No server, no model and no HTTP: the limits hold the served
name, the checkpoint's config and tokenizer, the server's default options and its --max-choices /
--max-queue / --strict (tests/test_serve_request.py calls it directly).

Order of the checks: the model name, the OpenAI fields (stream, max_tokens, n, logprobs, echo,
stop), then every decoding option (engine/serve/protocol.py) before a prompt is encoded or
anything is sized, then each prompt against the model's length."""
from __future__ import annotations

import dataclasses
import json
import secrets
from dataclasses import dataclass, field
from typing import Callable

from models import CheckpointError, ModelConfig, Tokenizer

from ..config import DecodeConfig, check_prompts, text_ids
from ..uniform import for_model
from ..errors import InputError
from ..options import MAX_TOP_LOGPROBS, OPTIONS
from ..results import SequenceResult
from .protocol import (CHAT_FIELDS, COMPLETION_FIELDS, MAX_N, ApiError, Spec, bad, int_field, merge_options,
                       request_options, short, size_problem, stop_field)

# A long prompt is first measured piece by piece, this many characters at a time: the tokenizer
# takes about 200 bytes a character, so a prompt of a few MiB would take gigabytes to encode whole.
MEASURE_CHARS = 1 << 16
# A prompt whose pieces count more than this many times the model's length is refused unencoded
# (the seams between pieces change a count by a token or two, never by a factor).
MEASURE_SLACK = 2
# per-token log-probs need the probability of each committed token (SequenceResult.commit_prob)
LOGPROBS = "commit_prob" in {f.name for f in dataclasses.fields(SequenceResult)}
ROLES = ("system", "developer", "user", "assistant")


def fresh_seed() -> int:
    return secrets.randbits(63)


@dataclass(frozen=True)
class Limits:
    """What a request is checked against. `draw_seed` gives an unseeded sampled request its seed
    (reported in `psd.seed`): the one draw of the parse, replaceable in tests."""

    name: str                      # the served model id a request must name
    mc: ModelConfig
    tok: Tokenizer
    defaults: dict                 # the server's decoding options (its command line), method included
    max_choices: int               # prompts times n per request (already <= max_queue)
    max_queue: int
    strict: bool = False           # refuse unknown fields instead of ignoring them
    draw_seed: Callable[[], int] = field(default=fresh_seed, compare=False)


@dataclass(frozen=True)
class Fields:
    """The OpenAI fields of a request that shape its answer (not its prompt, not its options)."""

    max_tokens: int | None
    n: int
    logprobs: int | None           # alternatives per token (0: the token's own only); None: no logprobs
    echo: bool
    stop: list
    stream: bool
    include_usage: bool


def parse_request(body: dict, chat: bool, lim: Limits) -> list[Spec]:
    """The Specs of a request: one per (prompt, sample), in the order of the answer's choices
    (index = prompt index * n + sample index). Every refusal is an ApiError (400, 404 for an
    unknown model) with a one-line message."""
    f = openai_fields(body, chat, lim)
    limit = lim.mc.max_length
    ignored = None if lim.strict else []
    try:             # every option is checked (by the option table, and against the model's length)
        opts = request_options(body, CHAT_FIELDS if chat else COMPLETION_FIELDS, limit, ignored)
        merged = merge_options(lim.defaults, opts)   # before the prompt is encoded or anything is sized
        problem = size_problem(opts, limit)
        if problem:
            raise bad(problem[1], problem[0])
        prompts = [(encode(chat_prompt(body.get("messages"), lim.tok), lim, chat=True), None)] if chat else \
            prompt_list(body.get("prompt"), f.n, lim)
        return _specs(f, opts, merged, prompts, tuple(ignored or ()), chat, lim)
    except InputError as e:
        raise bad(str(e).replace("prompt 0 ", "the prompt ", 1)) from None


def openai_fields(body: dict, chat: bool, lim: Limits) -> Fields:
    """The model name and the answer-shaping fields, checked in this order."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model is required (a string; GET /v1/models lists it)", "model")
    if model != lim.name:
        raise no_such_model(model, lim.name)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    so = body.get("stream_options")
    if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"}
                           or not isinstance(so.get("include_usage", False), bool)):
        raise bad('stream_options must be {"include_usage": true|false}', "stream_options")
    limit = lim.mc.max_length
    room = (limit - 1, f" (the model's maximum length {limit} less one prompt token)")
    max_tokens = int_field(body, "max_tokens", 1, *room)
    if chat:
        mct = int_field(body, "max_completion_tokens", 1, *room)
        if mct is not None and max_tokens is not None and mct != max_tokens:
            raise bad("max_tokens and max_completion_tokens differ", "max_completion_tokens")
        max_tokens = mct if mct is not None else max_tokens
    n = int_field(body, "n", 1, MAX_N) or 1
    if chat and n > lim.max_choices:
        raise bad(too_many(1, n, lim), "n")
    logprobs = logprobs_field(body, chat)
    echo = None if chat else body.get("echo")
    if echo is not None and not isinstance(echo, bool):
        raise bad("echo must be a boolean", "echo")
    return Fields(max_tokens, n, logprobs, bool(echo), stop_field(body), bool(stream),
                  bool((so or {}).get("include_usage")))


def _specs(f: Fields, opts: dict, merged: dict, prompts: list, ignored: tuple, chat: bool, lim: Limits) -> list[Spec]:
    specs = []
    seed = merged.get("seed")
    sampled = merged.get("temperature", 0) > 0 or lim.mc.mask_token_id is None   # uniform noise always samples
    if sampled and seed is None:       # unseeded sampling: a fresh seed per request (reported)
        seed = lim.draw_seed()
    if sampled and lim.mc.mask_token_id is not None and "sampler" not in merged:
        merged["sampler"] = "row"      # each sample draws from its own seed's generator: any batch, same answer
    for i, (ids, text) in enumerate(prompts):
        config, cut = decode_config(opts, dict(merged), f.max_tokens, len(ids), lim.mc)
        check_prompts(lim.mc, config, [ids])
        if config.min_tokens > cut:
            raise bad(f"min_tokens {config.min_tokens} exceeds max_tokens {cut}", "min_tokens")
        if f.logprobs is not None and config.confidence_score != "prob":
            raise bad(f"logprobs need the confidence score prob (this request decodes with score "
                      f"{config.confidence_score}: its per-token figures are not probabilities)", "logprobs")
        # alternatives are recorded only for a request that reports them (a reporting option)
        config = config.replace(top_logprobs=f.logprobs or None)
        shown = "" if not f.echo else text if text is not None else lim.tok.decode(ids)
        for j in range(f.n):
            # temperature 0: every sample is the same answer; else sample j is seeded seed + j
            cfg = config.replace(seed=(seed + j) % 2 ** 64) if sampled else config
            specs.append(Spec(ids, cfg, cut, f.stop, f.stream, f.include_usage, chat, index=i * f.n + j,
                              sample=j, echo=shown, logprobs=f.logprobs is not None, ignored=ignored))
    return specs


def logprobs_field(body: dict, chat: bool) -> int | None:
    """How many top alternatives a request's logprobs ask for per token (0: the chosen token's
    own log-prob only), or None when it asks for no logprobs. Completions: `logprobs` is that
    count; chat: `logprobs` is a boolean and `top_logprobs` the count."""
    v = body.get("logprobs")
    name = "top_logprobs" if chat else "logprobs"          # the field that counts alternatives
    top = body.get(name)
    if not chat and top is False:                          # accepted as "no logprobs", as before
        top = None
    if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 0):
        raise bad(f"{name} must be an integer >= 0, got {short(json.dumps(top), 30)}", name)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise bad(f"{name} must be <= {MAX_TOP_LOGPROBS} (alternatives per token), got {short(str(top), 30)}",
                  name)
    if chat and v is not None and not isinstance(v, bool):
        raise bad("logprobs must be a boolean", "logprobs")
    if v is None or v is False:
        if chat and top:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        return None
    if not LOGPROBS:
        raise bad("logprobs are not supported by this engine version (no per-token probabilities)",
                  "logprobs", "unsupported")
    return top or 0


def too_many(prompts: int, n: int, lim: Limits) -> str:
    flag = "--max-choices" if lim.max_choices < lim.max_queue else "--max-queue"
    return (f"{prompts} prompt{'s' * (prompts != 1)} times n {n} is {prompts * n} choices, more than one request "
            f"may ask for ({lim.max_choices}, {flag})")


def prompt_list(prompt, n: int, lim: Limits) -> list[tuple[list[int], str | None]]:
    """(token ids, text) of every prompt of a completion request: a string, a list of token ids, or a
    list of either (at most --max-choices choices in all, counted before anything is encoded)."""
    many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
    prompts = prompt if many else [prompt]
    if len(prompts) * n > lim.max_choices:
        raise InputError(too_many(len(prompts), n, lim))
    out = []
    for i, p in enumerate(prompts):
        try:
            ids = prompt_ids(p, lim)
            out.append((ids, p if isinstance(p, str) else None))    # (ids decoded for echo once checked)
        except InputError as e:
            raise InputError(f"prompt {i}: {e}" if many and len(prompts) > 1 else str(e)) from None
    return out


def prompt_ids(prompt, lim: Limits) -> list[int]:
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InputError("the prompt is empty")
        return encode(prompt, lim)
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not prompt:
            raise InputError("the prompt is empty")
        room(len(prompt), lim.mc)
        return prompt
    if prompt is None:
        raise InputError("prompt is required")
    raise InputError("prompt must be a string or a list of token ids, or a list of those (several prompts)")


def chat_prompt(messages, tok: Tokenizer) -> str:
    """A chat request's messages checked, then rendered through the chat template."""
    if not isinstance(messages, list) or not messages:
        raise InputError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    out = []
    for n, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise InputError(f"message {n} must be an object with a string role")
        if m["role"] not in ROLES:
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
    return render_chat(tok, out)


def render_chat(tok: Tokenizer, messages: list[dict]) -> str:
    """Messages through the checkpoint's chat template, ending with the generation prompt."""
    if not tok.chat_template:
        raise InputError("this checkpoint has no chat template; use /v1/completions, or start the server with "
                         "--chat-template FILE (docs/serve.md)")
    try:
        return tok.apply_chat_template(messages)
    except CheckpointError as e:
        raise InputError(str(e)) from None


def encode(text: str, lim: Limits, chat: bool = False) -> list[int]:
    """The prompt's token ids (`chat`: a rendered template, `config.text_ids`); a prompt that cannot
    fit in the model's length is refused before it is encoded whole (a long one is measured piece
    by piece, each piece cut at a space)."""
    limit = lim.mc.max_length
    if len(text) > MEASURE_CHARS:
        count, lo = 0, 0
        while lo < len(text):
            hi = lo + MEASURE_CHARS
            if hi < len(text):
                cut = max(text.rfind(" ", lo, hi), text.rfind("\n", lo, hi))
                hi = cut if cut > lo else hi
            count += len(lim.tok.encode(text[lo:hi]))
            if count > MEASURE_SLACK * limit:
                raise InputError(f"the prompt of {len(text)} characters is longer than the model's maximum "
                                 f"length of {limit} tokens (its first {hi} characters are {count} tokens)")
            lo = hi
    ids = text_ids(lim.tok, text, chat)
    room(len(ids), lim.mc)
    return ids


def no_such_model(model: str, served: str) -> ApiError:
    """The 404 for a model id this server does not serve (a request's `model`, GET /v1/models/ID)."""
    return ApiError(404, f"the model {model!r} does not exist; this server serves {served!r}", "model_not_found",
                    "model")


def room(prompt_len: int, mc: ModelConfig) -> int:
    """Positions left for the answer after a prompt of `prompt_len` tokens (at least 1, else refused)."""
    left = mc.max_length - prompt_len
    if left < 1:
        raise InputError(f"the prompt of {prompt_len} tokens leaves no room for an answer within the "
                         f"model's maximum length {mc.max_length}")
    return left


def decode_config(opts: dict, merged: dict, max_tokens: int | None, prompt_len: int,
                  mc: ModelConfig) -> tuple[DecodeConfig, int]:
    """The request's DecodeConfig and its answer's cut: gen length = max_tokens rounded up to the
    block length (without max_tokens: the server's gen length, or what fits in the model's length)."""
    block = merged.get("block_length", OPTIONS["block_length"].default)
    OPTIONS["block_length"].validate(block)
    left = room(prompt_len, mc)
    asked = f"max_tokens {max_tokens}"          # what the error below names: what set the length
    if "gen_length" in opts:
        OPTIONS["gen_length"].validate(opts["gen_length"])
        if max_tokens is None:
            max_tokens, asked = opts["gen_length"], f"gen_length {opts['gen_length']}"
        elif max_tokens > opts["gen_length"]:
            raise InputError(f"max_tokens {max_tokens} exceeds the requested gen_length {opts['gen_length']}")
    else:
        if max_tokens is None:         # the server's gen length, or what fits in the model's length
            max_tokens = merged.get("gen_length", OPTIONS["gen_length"].default)
            asked = f"no max_tokens (the server's gen length {max_tokens}; no whole block fits in {left})"
            if -(-max_tokens // block) * block > left and left >= block:
                max_tokens = left // block * block
        merged["gen_length"] = -(-max_tokens // block) * block
    gen = merged.get("gen_length")
    if prompt_len + gen > mc.max_length:
        raise InputError(f"the prompt of {prompt_len} tokens with {asked} (decoded as {gen} tokens, a multiple of "
                         f"the block length {block}) exceeds the model's maximum length {mc.max_length}")
    return for_model(mc, DecodeConfig(**merged)).validate(), max_tokens
