"""The server's state: the checkpoint's cheap parts (config, tokenizer, defaults) at once, the model
loaded in the worker thread, and a request checked into a `Spec` (prompt ids, DecodeConfig, cuts)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import sys
import time
from pathlib import Path

from models import CheckpointError, ModelConfig, Tokenizer

from ..frontend import DEFAULT_MODEL_DIR, decoding_options, resolve_device
from ..config import DecodeConfig, check_prompts
from ..errors import InputError
from ..options import MAX_TOP_LOGPROBS, OPTIONS
from ..results import SequenceResult
from .protocol import (CHAT_FIELDS, COMPLETION_FIELDS, MAX_N, ApiError, Spec, bad, int_field,
                       merge_options, one_line, request_options, short, size_problem, stop_field)
from .worker import Scheduler

# A long prompt is first measured piece by piece, this many characters at a time: the tokenizer
# takes about 200 bytes a character, so a prompt of a few MiB would take gigabytes to encode whole.
MEASURE_CHARS = 1 << 16
# A prompt whose pieces count more than this many times the model's length is refused unencoded
# (the seams between pieces change a count by a token or two, never by a factor).
MEASURE_SLACK = 2
# per-token log-probs need the probability of each committed token (SequenceResult.commit_prob)
LOGPROBS = "commit_prob" in {f.name for f in dataclasses.fields(SequenceResult)}


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
        self.args = args
        opts = decoding_options(args)
        problem = size_problem(opts, self.mc.max_length)
        if problem:
            raise InputError(f"{OPTIONS[problem[0]].flag}: {problem[1]}")
        for name, value in self.mc.generation_defaults.items():   # the checkpoint's suggestion
            opts.setdefault(name, value)
        self.defaults = {"method": args.method, **opts}
        self._check_flags(DecodeConfig(**self.defaults).validate())   # bad server flags fail before it starts
        self.status, self.error = "loading", None
        self.max_choices = min(getattr(args, "max_choices", MAX_N), args.max_queue)
        self.scheduler = Scheduler(args.max_queue, args.max_batch, args.batch_wait_ms / 1000,
                                   continuous=getattr(args, "batching", "continuous") == "continuous")
        self.created = int(time.time())
        self.exit_code = 0

    def _check_flags(self, dc: DecodeConfig) -> None:
        """What `engine.generate` refuses before it reads weights is refused before the server
        listens: the device, --cuda-graphs off CUDA, a bad --cost-profile. The decoder's other checks
        run when the default decoder is built on the loaded model, before /health answers 200."""
        import torch

        from models.parallel import current

        from ..cost import read_profile
        from ..graphs import graphed

        if current() is None:                 # (under tensor parallel each rank has its device)
            device = torch.device(resolve_device(self.args.device))
            if dc.cuda_graphs and device.type != "cuda":
                graphed(None, dc, device)       # raises its one-line refusal
        if dc.cost_profile is not None:
            read_profile(dc.cost_profile)

    def _set_chat_template(self, value: str) -> None:
        """--chat-template: a file, or the template text itself (compiled now: a broken one fails here)."""
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
        self.tok.set_chat_template(text, source)

    def load_and_serve(self, http) -> None:
        """The worker thread: load the model, warm it up, then decode batches until shutdown."""
        try:
            if self.args.load_delay:
                time.sleep(self.args.load_delay)
            import torch

            from models import load_model
            from models.parallel import current

            from ..config import DecodeConfig
            from ..distributed import decoder_class
            from ..loop import Decoder

            if self.args.threads:
                torch.set_num_threads(self.args.threads)
            t0 = time.perf_counter()
            tp = current()                     # tensor parallel (torchrun): this rank's shard
            model = load_model(self.model_dir, dtype=self.args.dtype,
                               device=tp.device if tp else resolve_device(self.args.device), tp=tp)
            Decoder(model, DecodeConfig(**self.defaults))   # the server's default decoder: every check of
            # engine.generate (--compile's compiler, --cuda-graphs' options, ...) before /health says ok
            decoder_class()(model, DecodeConfig(gen_length=1, block_length=1)).generate(
                [self.tok.encode("a") or [self.mc.eos_token_id]])
            self.model = model
            print(f"model {self.name} loaded on {model.device} in {time.perf_counter() - t0:.1f} s; ready",
                  file=sys.stderr, flush=True)
        except BaseException as e:     # noqa: BLE001 -- reported, then the server stops with status 2
            self.status, self.error = "failed", one_line(e)
            print(f"error: {self.error}", file=sys.stderr, flush=True)
            self.exit_code = 2
            http.should_exit = True
            return
        self.status = "ok"
        try:
            self.scheduler.run(model)         # one batch's failure is its requests' error; this is the worker's
        except BaseException as e:            # noqa: BLE001 -- no request may wait on a dead worker
            self.status, self.error = "failed", f"the decoding worker stopped: {one_line(e)}"
            print(f"error: {self.error}", file=sys.stderr, flush=True)
            self.scheduler.close()
            self.exit_code = 1
            http.should_exit = True

    # ------------------------------------------------------------------ parsing a request
    def parse(self, body: dict, chat: bool) -> list[Spec]:
        """The Specs of a request: one per (prompt, sample), in the order of the answer's choices
        (index = prompt index * n + sample index)."""
        fields = CHAT_FIELDS if chat else COMPLETION_FIELDS
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise bad("model is required (a string; GET /v1/models lists it)", "model")
        if model != self.name:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                           "model_not_found", "model")
        stream = body.get("stream")
        if stream is not None and not isinstance(stream, bool):
            raise bad("stream must be a boolean", "stream")
        so = body.get("stream_options")
        if so is not None and (not isinstance(so, dict) or set(so) - {"include_usage"}
                               or not isinstance(so.get("include_usage", False), bool)):
            raise bad('stream_options must be {"include_usage": true|false}', "stream_options")
        limit = self.mc.max_length
        room = (limit - 1, f" (the model's maximum length {limit} less one prompt token)")
        max_tokens = int_field(body, "max_tokens", 1, *room)
        if chat:
            mct = int_field(body, "max_completion_tokens", 1, *room)
            if mct is not None and max_tokens is not None and mct != max_tokens:
                raise bad("max_tokens and max_completion_tokens differ", "max_completion_tokens")
            max_tokens = mct if mct is not None else max_tokens
        n = int_field(body, "n", 1, MAX_N) or 1
        if chat and n > self.max_choices:
            raise bad(self._too_many(1, n), "n")
        logprobs = self._logprobs_field(body, chat)
        echo = None if chat else body.get("echo")
        if echo is not None and not isinstance(echo, bool):
            raise bad("echo must be a boolean", "echo")
        stop = stop_field(body)
        ignored = None if getattr(self.args, "strict", False) else []
        try:             # every option is checked (by the option table, and against the model's length)
            opts = request_options(body, fields, limit, ignored)   # before the prompt is encoded or anything is sized
            merged = merge_options(self.defaults, opts)
            problem = size_problem(opts, limit)
            if problem:
                raise bad(problem[1], problem[0])
            prompts = [(self._chat_ids(self._chat_prompt(body.get("messages"))), None)] if chat else \
                self._prompt_list(body.get("prompt"), n)
            specs = []
            seed = merged.get("seed")
            sampled = merged.get("temperature", 0) > 0
            if sampled and seed is None:       # unseeded sampling: a fresh seed per request (reported)
                seed = secrets.randbits(63)
            for i, (ids, text) in enumerate(prompts):
                config, cut = self._config(opts, dict(merged), max_tokens, len(ids))
                check_prompts(self.mc, config, [ids])
                if config.min_tokens > cut:
                    raise bad(f"min_tokens {config.min_tokens} exceeds max_tokens {cut}", "min_tokens")
                if logprobs is not None and config.score != "prob":
                    raise bad(f"logprobs need the confidence score prob (this request decodes with score "
                              f"{config.score}: its per-token figures are not probabilities)", "logprobs")
                # alternatives are recorded only for a request that reports them (a reporting option)
                config = config.replace(top_logprobs=logprobs or None)
                shown = "" if not echo else text if text is not None else self.tok.decode(ids)
                for j in range(n):
                    # temperature 0: every sample is the same answer; else sample j is seeded seed + j
                    cfg = config.replace(seed=(seed + j) % 2 ** 64) if sampled else config
                    specs.append(Spec(ids, cfg, cut, stop, bool(stream), bool((so or {}).get("include_usage")),
                                      chat, index=i * n + j, sample=j, echo=shown, logprobs=logprobs is not None,
                                      ignored=tuple(ignored or ())))
        except InputError as e:
            raise bad(str(e).replace("prompt 0 ", "the prompt ", 1)) from None
        return specs

    def _logprobs_field(self, body: dict, chat: bool) -> int | None:
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

    def _prompt_list(self, prompt, n: int) -> list[tuple[list[int], str]]:
        """(token ids, text) of every prompt of a completion request: a string, a list of token ids, or a
        list of either (at most --max-queue choices in all, counted before anything is encoded)."""
        many = isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt)
        prompts = prompt if many else [prompt]
        if len(prompts) * n > self.max_choices:
            raise InputError(self._too_many(len(prompts), n))
        out = []
        for i, p in enumerate(prompts):
            try:
                ids = self._prompt_ids(p)
                out.append((ids, p if isinstance(p, str) else None))    # (ids decoded for echo once checked)
            except InputError as e:
                raise InputError(f"prompt {i}: {e}" if many and len(prompts) > 1 else str(e)) from None
        return out

    def _too_many(self, prompts: int, n: int) -> str:
        flag = "--max-choices" if self.max_choices < self.scheduler.max_queue else "--max-queue"
        return (f"{prompts} prompt{'s' * (prompts != 1)} times n {n} is {prompts * n} choices, more than one request "
                f"may ask for ({self.max_choices}, {flag})")

    def _prompt_ids(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise InputError("the prompt is empty")
            return self._encode(prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not prompt:
                raise InputError("the prompt is empty")
            self._room(len(prompt))
            return prompt
        if prompt is None:
            raise InputError("prompt is required")
        raise InputError("prompt must be a string or a list of token ids, or a list of those (several prompts)")

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
        return self._encode(text)

    def _encode(self, text: str) -> list[int]:
        """The prompt's token ids; a prompt that cannot fit in the model's length is refused before
        it is encoded whole (a long one is measured piece by piece, each piece cut at a space)."""
        limit = self.mc.max_length
        if len(text) > MEASURE_CHARS:
            count, lo = 0, 0
            while lo < len(text):
                hi = lo + MEASURE_CHARS
                if hi < len(text):
                    cut = max(text.rfind(" ", lo, hi), text.rfind("\n", lo, hi))
                    hi = cut if cut > lo else hi
                count += len(self.tok.encode(text[lo:hi]))
                if count > MEASURE_SLACK * limit:
                    raise InputError(f"the prompt of {len(text)} characters is longer than the model's maximum "
                                     f"length of {limit} tokens (its first {hi} characters are {count} tokens)")
                lo = hi
        ids = self.tok.encode(text)
        self._room(len(ids))
        return ids

    def _room(self, prompt_len: int) -> int:
        room = self.mc.max_length - prompt_len
        if room < 1:
            raise InputError(f"the prompt of {prompt_len} tokens leaves no room for an answer within the "
                             f"model's maximum length {self.mc.max_length}")
        return room

    def _config(self, opts: dict, merged: dict, max_tokens: int | None, prompt_len: int) -> tuple[DecodeConfig, int]:
        """The request's DecodeConfig: gen length = max_tokens rounded up to the block length."""
        block = merged.get("block_length", OPTIONS["block_length"].default)
        OPTIONS["block_length"].validate(block)
        room = self._room(prompt_len)
        if "gen_length" in opts:
            OPTIONS["gen_length"].validate(opts["gen_length"])
            if max_tokens is None:
                max_tokens = opts["gen_length"]
            elif max_tokens > opts["gen_length"]:
                raise InputError(f"max_tokens {max_tokens} exceeds the requested gen_length {opts['gen_length']}")
        else:
            if max_tokens is None:         # the server's gen length, or what fits in the model's length
                max_tokens = merged.get("gen_length", OPTIONS["gen_length"].default)
                if -(-max_tokens // block) * block > room and room >= block:
                    max_tokens = room // block * block
            merged["gen_length"] = -(-max_tokens // block) * block
        gen = merged.get("gen_length")
        if prompt_len + gen > self.mc.max_length:
            raise InputError(f"the prompt of {prompt_len} tokens plus max_tokens {max_tokens} (decoded as {gen} "
                             f"tokens, a multiple of the block length {block}) exceeds the model's maximum "
                             f"length {self.mc.max_length}")
        return DecodeConfig(**merged).validate(), max_tokens


def render_chat(tok: Tokenizer, messages: list[dict]) -> str:
    """Messages through the checkpoint's chat template, ending with the generation prompt."""
    if not tok.chat_template:
        raise InputError("this checkpoint has no chat template; use /v1/completions, or start the server with "
                         "--chat-template FILE (docs/serve.md)")
    try:
        return tok.apply_chat_template(messages)
    except CheckpointError as e:
        raise InputError(str(e)) from None
