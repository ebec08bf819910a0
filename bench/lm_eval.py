"""`python -m bench.lm_eval`: lm-evaluation-harness on psd-engine, as the model `psd`.

    python -m bench.lm_eval --model psd \\
        --model_args model=DIR,method=psd,policy=confidence,threshold=0.9,depth=3,gen_length=256,block_length=32,cache=dual \\
        --tasks gsm8k_local --batch_size 8 --output_path out/

Importing this module registers `PsdLM` with lm-eval under the name `psd`; running it sets the
offline switches of the HF libraries (unless already set) and hands the command line to lm-eval's
own CLI, with this package's offline tasks (bench/lm_eval_tasks/: gsm8k_local, mbpp_local, on the
shipped data) added to the task index, then prints TPF and model calls per task. A task whose
data set is on the hub and not cached is one error line that names it (offline, it cannot load).
Every option of `engine.DecodeConfig` is a model_arg (read from the engine's option table, so
new options arrive without a change here), beside the model-level ones in `MODEL_ARGS`. docs/lm_eval.md has the details: `until` and
`max_gen_toks`, prompts longer than the window, the log-likelihood estimator, where TPF appears.

lm-eval is an optional extra (`pip install -e .[lm_eval]`); only this module imports it, never
engine/, models/ or psd_kernels/.
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    if not __package__:   # run as a file (python bench/lm_eval.py): bench/ must not shadow the harness `lm_eval`
        sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # No hub: local files only (a hub lookup would hang until its timeout on a machine without a route).
    # Set before lm_eval/datasets are imported, which read them at import; export =0 to allow the hub.
    for _var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(_var, "1")

import dataclasses
import hashlib
import json
import logging
import math
import time
import typing
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

import engine
from engine import DecodeConfig, Decoder, DraftGraph, InputError
from engine.frontend import hub_id_hint, load_plugins, resolve_device
from engine.uniform import for_model
from models import CheckpointError, ModelConfig, Tokenizer, attention_mask, load_model, position_ids

try:
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model
except ImportError as _e:  # the module is useless without the harness
    _MISSING = (f"bench.lm_eval needs lm-evaluation-harness ({_e}); install it with pip install "
                f"'psd-engine[lm_eval]' (from a checkout: pip install -e '.[lm_eval]')")
    if __name__ == "__main__":          # the command line, --help too: one line, as every front end
        print(f"error: {_MISSING}", file=sys.stderr)
        sys.exit(2)
    raise ImportError(_MISSING) from _e

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "default"
TASKS_DIR = Path(__file__).resolve().parent / "lm_eval_tasks"     # gsm8k_local, mbpp_local (shipped data)
LOCAL_TASKS = {"gsm8k": "gsm8k_local", "mbpp": "mbpp_local"}        # standard name -> its offline twin here
TRUNCATE = ("error", "left")
# Model-level model_args: name -> (parser, default, help). Everything else is a decoding option.
MODEL_ARGS: dict[str, tuple[Callable, Any, str]] = {}
MAX_TOKEN_KEYS = ("max_gen_toks", "max_new_tokens", "max_tokens", "max_completion_tokens")   # lm-eval's aliases


# ---------------------------------------------------------------------- argument parsing
def _bool(key: str, v) -> bool:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
        return v.strip().lower() in ("true", "1", "yes")
    if isinstance(v, int) and v in (0, 1):
        return bool(v)
    raise InputError(f"model_arg {key}={v!r}: expected true or false")


def _int(key: str, v) -> int:
    if isinstance(v, bool):
        raise InputError(f"model_arg {key}={v!r}: expected an integer")
    if isinstance(v, int):
        return v
    if isinstance(v, float) and v.is_integer():
        return int(v)
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    raise InputError(f"model_arg {key}={v!r}: expected an integer")


def _float(key: str, v) -> float:
    if isinstance(v, bool):
        raise InputError(f"model_arg {key}={v!r}: expected a number")
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v.strip())
        except ValueError:
            pass
    raise InputError(f"model_arg {key}={v!r}: expected a number")


def _str(key: str, v) -> str:
    if isinstance(v, str):
        return v
    raise InputError(f"model_arg {key}={v!r}: expected a string")


def _graph(key: str, v) -> DraftGraph:
    if isinstance(v, DraftGraph):
        return v
    if isinstance(v, (str, os.PathLike)):
        return DraftGraph.load(v)          # InputError naming the file when it is missing or bad
    if isinstance(v, (list, tuple)):
        return DraftGraph(v)
    raise InputError(f"model_arg {key}={v!r}: expected a draft graph JSON file")


_PARSERS: dict[type, Callable] = {bool: _bool, int: _int, float: _float, str: _str, DraftGraph: _graph}

for _name, _spec in {
    "model": (_str, None, "checkpoint directory (default: the shipped models/default); alias pretrained"),
    "dtype": (_str, "float32", "weights dtype (float32, bfloat16, ...), as models.load_model takes it"),
    "device": (_str, None, "cpu, cuda, cuda:N or auto (default: lm-eval's --device, else auto)"),
    "batch_size": (_int, None, "prompts per engine call for generate_until, Monte-Carlo rows per forward "
                               "for loglikelihood (default: lm-eval's --batch_size, else 1)"),
    "chat": (_bool, False, "wrap every context in the checkpoint's chat template as one user turn"),
    "mc_num": (_int, 128, "loglikelihood: Monte-Carlo samples per request"),
    "truncate": (_str, "error", "a prompt that does not fit the window with the generation: "
                                "error, or left (drop its oldest tokens)"),
    "max_batch_size": (_int, None, "accepted for lm-eval's --max_batch_size and ignored"),
    "trust_remote_code": (_bool, False, "accepted for lm-eval's --trust_remote_code and ignored (no checkpoint code runs)"),
}.items():
    MODEL_ARGS[_name] = _spec


@dataclasses.dataclass(frozen=True)
class DecodeOption:
    name: str                         # the DecodeConfig keyword
    kind: type                        # int, float, str, bool or DraftGraph
    parse: Callable | None = None     # the engine's own string parser, for a kind this module does not know

    def coerce(self, key: str, value):
        if self.kind in _PARSERS:
            return _PARSERS[self.kind](key, value)
        return self.parse(value) if (self.parse is not None and isinstance(value, str)) else value


def decode_options() -> dict[str, DecodeOption]:
    """Every spelling of every decoding option -> the option, read from the engine.

    From the engine's option table (`engine.OPTIONS`: names and aliases, e.g. policy for
    policy_name) where it has one, else from the fields of the `DecodeConfig` dataclass and their
    type hints (with `policy` for policy_name, the CLI's spelling). `method` is always one.
    """
    table = getattr(engine, "OPTIONS", None)
    out = {"method": DecodeOption("method", str)}
    if table:
        for o in table.values():
            for spelling in (o.name, *getattr(o, "aliases", ())):
                out[spelling] = DecodeOption(o.name, o.kind, getattr(o, "parse", None))
        return out
    hints = typing.get_type_hints(DecodeConfig, localns={"DraftGraph": DraftGraph})
    for f in dataclasses.fields(DecodeConfig):
        kinds = [a for a in (typing.get_args(hints[f.name]) or (hints[f.name],)) if a is not type(None)]
        out[f.name] = DecodeOption(f.name, kinds[0])
    if "policy_name" in out:
        out.setdefault("policy", out["policy_name"])
    return out


def _device(name: str | None, strict: bool) -> str:
    """A torch device string (engine.frontend.resolve_device). A CUDA device without CUDA is an error
    when the user named it in model_args (strict), and CPU with a warning when it is lm-eval's
    --device, whose default is cuda:0 even where no --device was given."""
    if not strict and str(name).startswith("cuda") and not torch.cuda.is_available():
        log.warning("lm-eval's --device %s: CUDA is not available, running on cpu", name)
        return "cpu"
    return resolve_device("auto" if name is None else str(name))


def cut_at_stop(text: str, until) -> str:
    """`text` up to the earliest occurrence of any non-empty stop sequence (lm-eval's semantics)."""
    cut = len(text)
    for s in until:
        if s:
            i = text.find(s)
            if 0 <= i < cut:
                cut = i
    return text[:cut]


def _request_label(req) -> str:
    return f"request {getattr(req, 'doc_id', None)} of task {getattr(req, 'task_name', None) or '?'}"


# ---------------------------------------------------------------------- model_args
def _model_args(model_args: dict) -> tuple[dict, dict]:
    """(model_args with pretrained= read as model=, the engine's decoding options by every spelling);
    a name that is neither a model_arg nor a decoding option is an error."""
    args = dict(model_args)
    if "pretrained" in args:
        if "model" in args:
            raise InputError("give the checkpoint as model= or pretrained=, not both")
        args["model"] = args.pop("pretrained")
    options = decode_options()
    unknown = sorted(k for k in args if k not in MODEL_ARGS and k not in options)
    if unknown:
        valid = sorted(set(MODEL_ARGS) | set(options))
        raise InputError(f"unknown model_arg {unknown[0]!r} for the psd model; valid: {', '.join(valid)}")
    return args, options


def _settings(args: dict, harness: dict) -> dict:
    """Every MODEL_ARGS entry parsed (its default when not given), checked; batch_size falls back to
    lm-eval's --batch_size."""
    m = {k: (p(k, args[k]) if args.get(k) is not None else d) for k, (p, d, _) in MODEL_ARGS.items()}
    if m["truncate"] not in TRUNCATE:
        raise InputError(f"model_arg truncate={m['truncate']!r}: expected one of {', '.join(TRUNCATE)}")
    if m["mc_num"] < 1:
        raise InputError(f"model_arg mc_num must be >= 1, got {m['mc_num']}")
    if m["batch_size"] is None:
        hb = harness.get("batch_size", 1)
        if isinstance(hb, str) and hb.strip().startswith("auto"):
            raise InputError(f"--batch_size {hb} is not supported by the psd model; give an integer")
        m["batch_size"] = _int("batch_size", hb)
    if m["batch_size"] < 1:
        raise InputError(f"batch_size must be >= 1, got {m['batch_size']}")
    return m


def _decoding_options(args: dict, options: dict) -> dict[str, Any]:
    """The decoding options given, by canonical name, typed by the engine's own declarations."""
    given: dict[str, Any] = {}
    for key, value in args.items():
        if key in MODEL_ARGS or value is None:      # lm-eval reads `None`/`none` as None: not given
            continue
        opt = options[key]
        if opt.name in given:
            raise InputError(f"decoding option {opt.name} is given twice (as {key} and another spelling)")
        given[opt.name] = opt.coerce(key, value)
    return given


def _checkpoint_dir(model: str | None) -> Path:
    """The checkpoint directory of model= (default: the shipped model); a hub id or a missing
    directory is one error."""
    hint = hub_id_hint(model, flag="model=")
    if hint is not None:
        raise CheckpointError(hint)
    model_dir = Path(model) if model is not None else DEFAULT_MODEL_DIR
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist or is not a directory")
    return model_dir


# ---------------------------------------------------------------------- the model
@register_model("psd")
class PsdLM(LM):
    """lm-eval model over `engine.Decoder`: generate_until decodes with the configured method;
    loglikelihood(_rolling) is the masked-diffusion Monte-Carlo ELBO (LLaDA's estimator)."""

    last: "PsdLM | None" = None     # the latest instance, for the CLI's statistics table

    # ---------------------------------------------------------------- construction
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> "PsdLM":
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> "PsdLM":
        # lm-eval's --batch_size / --device arrive here even when not given (defaults 1 and cuda:0):
        # they are fallbacks, and a model_arg of the same name wins instead of colliding with it
        harness = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(harness=harness, **dict(arg_dict or {}))

    def __init__(self, harness: dict | None = None, **model_args):
        super().__init__()
        load_plugins([])        # $PSD_PLUGINS and installed entry points: a plugin's methods and options
        harness = dict(harness or {})
        args, options = _model_args(model_args)
        m = _settings(args, harness)
        given = _decoding_options(args, options)
        model_dir = _checkpoint_dir(m["model"])
        self.mc = ModelConfig.from_dir(model_dir)        # its config.json: the options are checked against it
        sizes = self.mc.generation_defaults
        if "block_length" not in given and "block_length" in sizes:
            given["block_length"] = sizes["block_length"]
        self.explicit_gen_length: int | None = given.get("gen_length")
        # generation length of a request without max_gen_toks: gen_length, else the checkpoint's, else the engine's
        self.default_gen_toks: int = given.get("gen_length", sizes.get("gen_length", DecodeConfig().gen_length))
        self.options = given
        block = given.get("block_length", DecodeConfig().block_length)
        # checked now, at construction: a bad option fails before any data is read
        self._aligned = self.decode_config(self.explicit_gen_length or block).aligned(self.mc)
        device = _device(m["device"], strict=True) if m["device"] is not None else _device(harness.get("device"), strict=False)

        self.model_dir, self.dtype_name, self.batch_size = model_dir, m["dtype"], m["batch_size"]
        self.chat, self.mc_num, self.truncate = m["chat"], m["mc_num"], m["truncate"]
        self.mc_num_given = args.get("mc_num") is not None
        self.tok = Tokenizer(model_dir)
        if self.chat and not self.tok.chat_template:
            raise CheckpointError(f"chat=true needs a chat_template in {model_dir}/tokenizer_config.json, "
                                  f"and this checkpoint has none")
        self.model = load_model(model_dir, dtype=m["dtype"], device=device)
        self.mc = self.model.config
        self._device = self.model.device
        self.stats: dict[tuple[str, str], dict] = {}
        self._warned: set[str] = set()
        self._rendered = False          # lm-eval renders the contexts (--apply_chat_template)
        PsdLM.last = self

    def decode_config(self, gen_length: int) -> DecodeConfig:
        """The validated DecodeConfig of a request group: the given options with this gen_length, as
        the checkpoint's model decodes them (`engine.uniform.for_model`)."""
        return for_model(self.mc, DecodeConfig(**{**self.options, "gen_length": gen_length}))

    @property
    def max_length(self) -> int:
        return self.mc.max_length

    @property
    def tokenizer_name(self) -> str:
        return str(self.model_dir)

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """lm-eval's `--apply_chat_template` (asked before any request is built): the checkpoint's
        template, which lm-eval then renders each request's turns through (`apply_chat_template`;
        with `--fewshot_as_multiturn` each shot is a turn of its own); the contexts that arrive are
        rendered, and are encoded as `chat=true` encodes its own (the template writes its special
        tokens)."""
        if not chat_template:
            return ""
        if self.chat:
            raise InputError("chat=true and --apply_chat_template would both apply the chat template: pass one")
        if isinstance(chat_template, str) and chat_template != "default":
            raise InputError(f"--apply_chat_template {chat_template}: the psd model renders the checkpoint's default "
                             f"chat template only; pass --apply_chat_template without a name")
        if not self.tok.chat_template:
            raise CheckpointError(f"--apply_chat_template needs a chat_template in {self.model_dir}/"
                                  f"tokenizer_config.json, and this checkpoint has none")
        self._rendered = True
        return self.tok.chat_template

    def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
        return self.tok.apply_chat_template(list(chat_history), add_generation_prompt=add_generation_prompt)

    @property
    def _templated(self) -> bool:
        """Do the contexts hold a rendered chat template (chat=true, or lm-eval's --apply_chat_template)?
        Then they are encoded without the tokenizer's special tokens: the template wrote its own."""
        return self.chat or self._rendered

    def _warn_once(self, key: str, msg: str, *a) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *a)

    # ---------------------------------------------------------------- statistics
    def _count(self, task: str | None, kind: str, **kv) -> None:
        s = self.stats.setdefault((task or "?", kind), defaultdict(float))
        for k, v in kv.items():
            s[k] += v

    def stats_summary(self) -> dict:
        """Per task and request type: requests, generated tokens, model calls, TPF, seconds."""
        out: dict[str, dict] = {}
        for (task, kind), s in sorted(self.stats.items()):
            d = {"requests": int(s["requests"]), "calls": int(s["calls"]), "seconds": round(s["seconds"], 3)}
            if kind == "generate_until":
                d.update(tokens=int(s["tokens"]), tpf=round(s["tokens"] / max(s["calls"], 1), 4))
            out.setdefault(task, {})[kind] = d
        return out

    def describe(self) -> str:
        """The decoding as results tables name it, e.g. `psd(confidence(tau=0.9),d=3,policy) cache=dual`."""
        dc = self.decode_config(self.explicit_gen_length or self.options.get("block_length", DecodeConfig().block_length))
        return f"{dc.describe()} cache={dc.cache}"

    def stats_table(self) -> str:
        rows = [f"psd decoding: {self.describe()} model={self.model_dir}",
                "| task | request type | requests | tokens | calls | TPF | seconds |",
                "|---|---|---:|---:|---:|---:|---:|"]
        for task, kinds in self.stats_summary().items():
            for kind, d in kinds.items():
                tok, tpf = (d["tokens"], f"{d['tpf']:.2f}") if "tokens" in d else ("-", "-")
                rows.append(f"| {task} | {kind} | {d['requests']} | {tok} | {d['calls']} | {tpf} | {d['seconds']:.1f} |")
        return "\n".join(rows)

    def get_model_info(self) -> dict:
        """Merged by lm-eval into results["config"] after the evaluation (so into --output_path's JSON)."""
        shown = {k: (str(v) if isinstance(v, DraftGraph) else v) for k, v in self.options.items()}
        return {"psd": {"decoding": self.describe(), "model_dir": str(self.model_dir), "dtype": self.dtype_name,
                        "device": str(self._device),
                        "batch_size": self.batch_size, "chat": self.chat, "mc_num": self.mc_num,
                        "truncate": self.truncate, "decode_options": shown, "stats": self.stats_summary()}}

    # ---------------------------------------------------------------- prompts
    def _context_ids(self, context: str) -> list[int]:
        return self.tok.encode(self.tok.apply_chat_template(context) if self.chat else context,
                               special=not self._templated)

    def _fit(self, ids: list[int], room: int, req, what: str) -> list[int]:
        """`ids` if they fit in `room` tokens, else the truncate policy: an error or the last `room`."""
        if len(ids) <= room:
            return ids
        if self.truncate == "left" and room >= 1:
            self._count(getattr(req, "task_name", None), "truncated", requests=1)
            self._warn_once("truncate", "left-truncating prompts that do not fit the model's window of %d "
                            "tokens (counted per task in the statistics)", self.max_length)
            return ids[len(ids) - room:]
        fix = ("pass truncate=left in --model_args to keep its last tokens, or shorten the prompt or the generation"
               if room >= 1 else "the generation alone fills the window: shorten it (gen_length)")
        raise InputError(f"{_request_label(req)}: {what} of {len(ids)} tokens leaves no room in the model's window "
                         f"of {self.max_length} tokens (room: {room}); {fix}")

    # ---------------------------------------------------------------- generate_until
    def _plan(self, gen_kwargs: dict) -> tuple[int, int, tuple[str, ...]]:
        """(canvas gen_length, tokens kept, stop sequences) of one request's gen_kwargs."""
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.pop("until", None)
        until = () if until is None else (until,) if isinstance(until, str) else tuple(until)
        if not all(isinstance(s, str) for s in until):
            raise InputError(f"gen_kwargs until={until!r}: expected strings")
        want = next((gen_kwargs.pop(k) for k in MAX_TOKEN_KEYS if gen_kwargs.get(k) is not None), None)
        for k in MAX_TOKEN_KEYS:
            gen_kwargs.pop(k, None)
        sampling = gen_kwargs.pop("do_sample", False) or float(gen_kwargs.pop("temperature", 0.0) or 0.0) > 0
        gen_kwargs.pop("temperature", None)
        if sampling:
            self._warn_once("sampling", "gen_kwargs ask for sampling; the psd model decodes as its model_args say "
                            "(temperature=%s there)", self.options.get("temperature", DecodeConfig().temperature))
        if gen_kwargs:
            self._warn_once("ignored:" + ",".join(sorted(gen_kwargs)),
                            "gen_kwargs %s are ignored by the psd model (decoding is set by its model_args)",
                            sorted(gen_kwargs))
        block = self.options.get("block_length", DecodeConfig().block_length)
        if want is not None:
            want = _int("max_gen_toks", want)
            if want < 1:
                raise InputError(f"max_gen_toks must be >= 1, got {want}")
        if self.explicit_gen_length is not None:
            G = self.explicit_gen_length
            if want is not None and want > G:
                self._warn_once("short", "max_gen_toks %d exceeds the gen_length %d given in model_args: "
                                "generations are at most %d tokens", want, G, G)
            keep = G if want is None else min(want, G)
        else:
            keep = self.default_gen_toks if want is None else want
            # blocks counted from the sequence's start (LLaDA2's --align auto) take any gen length: a canvas
            # rounded up would decode blocks past max_gen_toks (calls and window room for nothing)
            G = keep if self._aligned else math.ceil(keep / block) * block
        return G, keep, until

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from tqdm import tqdm

        out: list[str | None] = [None] * len(requests)
        groups: dict[tuple, list[int]] = defaultdict(list)
        for i, req in enumerate(requests):
            groups[self._plan(req.args[1])].append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="psd generate_until")
        for (G, keep, until), idxs in groups.items():
            decoder = Decoder(self.model, self.decode_config(G))
            prompts = {i: self._fit(self._context_ids(requests[i].args[0]), self.max_length - G, requests[i],
                                    f"a prompt (gen length {G})") for i in idxs}
            for i in idxs:
                if not prompts[i]:
                    raise InputError(f"{_request_label(requests[i])}: the prompt is empty")
            order = sorted(idxs, key=lambda i: -len(prompts[i]))          # similar lengths share a batch
            for start in range(0, len(order), self.batch_size):
                batch = order[start:start + self.batch_size]
                t0 = time.perf_counter()
                results = decoder.generate([prompts[i] for i in batch])
                share = (time.perf_counter() - t0) / len(batch)
                for i, r in zip(batch, results):
                    text = cut_at_stop(self.tok.decode(r.token_ids[:keep]), until)
                    out[i] = text
                    self._count(requests[i].task_name, "generate_until", requests=1, tokens=r.tokens,
                                calls=r.calls, seconds=share)
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return out

    # ---------------------------------------------------------------- log-likelihood
    def _seed(self, *parts: str) -> int:
        """A per-request seed from the decode seed and the request text: estimates do not depend
        on request order, batching or other requests."""
        h = hashlib.sha256(json.dumps([self.options.get("seed", DecodeConfig().seed), *parts]).encode("utf-8"))
        return int.from_bytes(h.digest()[:8], "little")

    @torch.no_grad()
    def _target_logp(self, x: torch.Tensor, P: int) -> torch.Tensor:
        """log p [R, T, V] (float32) at the target positions P.. of full canvases x [R, P+T]: one
        forward, the target as a single generation block after a P-token context."""
        R, N = x.shape
        valid = torch.ones(R, N, dtype=torch.bool, device=x.device)
        idx = torch.arange(N, device=x.device)
        mask = attention_mask(self.mc, valid, P, P, N - P, idx, idx)
        logits, _ = self.model(x, position_ids(self.mc, valid), mask, out_start=P - self.mc.logit_shift, out_len=N - P)
        return F.log_softmax(logits.float(), dim=-1)

    @torch.no_grad()
    def elbo(self, prefix: list[int], target: list[int], mc_num: int | None = None, seed: int = 0) -> tuple[float, int]:
        """Monte-Carlo masked-diffusion estimate of log p(target | prefix) (LLaDA's get_log_likelihood),
        and the forwards it took. Per sample: l masked target positions (l uniform in 1..T, T =
        len(target)), chosen uniformly; its value is (T / l) * sum of log p(x_i | masked canvas) over
        the masked positions; the estimate is the mean of mc_num samples. Rows of one forward
        share one uniform draw k and take l_j = ((k - 1 + floor(j T / b)) mod T) + 1 (every l_j is
        still uniform; the spread lowers the variance). Its expectation is the ELBO, a lower bound
        on log p(target | prefix)."""
        mc_num = self.mc_num if mc_num is None else mc_num
        T, P = len(target), len(prefix)
        if T == 0:
            return 0.0, 0
        gen = torch.Generator(device="cpu").manual_seed(seed)
        dev = self._device
        seq = torch.tensor(prefix + target, dtype=torch.long)
        tgt = seq[P:].to(dev)
        total, done, forwards = 0.0, 0, 0
        while done < mc_num:
            b = min(self.batch_size, mc_num - done)
            k = int(torch.randint(1, T + 1, (1,), generator=gen))
            counts = (k - 1 + torch.arange(b) * T // b) % T + 1                         # [b] masked per row
            ranks = torch.rand(b, T, generator=gen).argsort(-1).argsort(-1)               # a random order per row
            masked = ranks < counts[:, None]                                             # [b, T]
            x = seq.repeat(b, 1)
            x[:, P:] = torch.where(masked, self.mc.mask_token_id, x[:, P:])
            logp = self._target_logp(x.to(dev), P).gather(-1, tgt.expand(b, T)[..., None])[..., 0]
            per_row = (logp * masked.to(dev)).sum(-1) * T / counts.to(dev)
            total += float(per_row.double().sum())
            done += b
            forwards += 1
        return total / mc_num, forwards

    def _blocks(self, P: int, T: int) -> list[tuple[int, int]]:
        """The target's spans [a, b) estimated apart: the whole target, or on a block-causal model
        (LLaDA2) one span per attention block it touches (blocks counted from the prefix's first token),
        each given the clean context and earlier spans, as the model generates them block by block."""
        size = self.mc.attention_block if self.mc.attention == "block_causal" else None
        if size is None or T == 0:
            return [(0, T)]
        cuts = [0, *range(size - P % size, T, size), T]
        return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]

    def _refuse_uniform(self, kind: str) -> None:
        """A uniform-noise model (no mask token: DiffusionGemma) has no masked-diffusion estimate."""
        if self.mc.mask_token_id is None:
            raise InputError(f"{kind} is not supported for a {self.mc.family} model: it diffuses from uniform noise "
                             f"(no mask token), and the adapter's log-likelihood is the masked-diffusion estimate; "
                             f"run generate_until tasks with it")

    def _is_greedy(self, prefix: list[int], target: list[int]) -> tuple[bool, int]:
        """Whether one-token-per-step greedy decoding of len(target) tokens after prefix yields
        target (LLaDA's suffix_greedy_prediction: the most confident position each step, over the
        whole target; a block-causal model (LLaDA2) decodes it as it generates, attention block by
        block, each given the finished ones before it)."""
        if not target:
            return True, 0
        block = self.mc.attention_block if self.mc.attention == "block_causal" else len(target)
        dc = DecodeConfig(method="greedy", gen_length=len(target), block_length=block).validate()
        r = Decoder(self.model, dc).generate([prefix])[0]
        return r.token_ids == list(target), r.calls

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        n_spaces = len(context) - len(context.rstrip())      # lm-eval convention: spaces go with the continuation
        if n_spaces:
            continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
        if self.chat:
            context = self.tok.apply_chat_template(context)
        whole = self.tok.encode(context + continuation, special=not self._templated)
        ctx = self.tok.encode(context, special=not self._templated)
        return ctx, whole[len(ctx):]

    def _score(self, req, prefix: list[int], target: list[int], kind: str, greedy: bool):
        if not prefix:                                        # lm-eval convention: condition on EOS
            prefix = [self.mc.eos_token_id]
        if len(target) >= self.max_length:
            raise InputError(f"{_request_label(req)}: a {kind} target of {len(target)} tokens does not fit the "
                             f"model's window of {self.max_length} tokens beside a context (no rolling windows)")
        prefix = self._fit(prefix, self.max_length - len(target), req, f"a context (before a {len(target)}-token target)")
        t0 = time.perf_counter()
        ll, forwards = 0.0, 0
        for n, (a, b) in enumerate(self._blocks(len(prefix), len(target))):      # one span unless block-causal
            extra = () if n == 0 else (f"block {n}",)
            part, f = self.elbo(prefix + target[:a], target[a:b], seed=self._seed(kind, *map(str, req.args), *extra))
            ll, forwards = ll + part, forwards + f
        is_greedy, calls = self._is_greedy(prefix, target) if greedy else (None, 0)
        self._count(req.task_name, kind, requests=1, calls=forwards + calls, seconds=time.perf_counter() - t0)
        return ll, is_greedy

    def _warn_default_mc_num(self, kind: str, requests, first: tuple[list[int], list[int]]) -> None:
        """Before the first request, when mc_num was not given: what the default costs on this
        device, from one forward timed at the first request's shape (LLaDA's 128 samples per request
        take minutes per request on a CPU, and the harness shows nothing until a request ends)."""
        if self.mc_num_given or not requests:
            return
        prefix, target = first
        prefix = prefix or [self.mc.eos_token_id]
        rows = min(self.batch_size, self.mc_num)
        forwards = math.ceil(self.mc_num / rows) * len(self._blocks(len(prefix), len(target)))    # per span
        greedy = len(target) if kind == "loglikelihood" else 0          # the is_greedy check: one call per token
        cost = ""
        room = self.max_length - len(target)
        if target and room >= 1:
            x = torch.tensor(prefix[-room:] + target, dtype=torch.long).repeat(rows, 1).to(self._device)
            t0 = time.perf_counter()
            self._target_logp(x, min(len(prefix), room))
            if self._device.type == "cuda":
                torch.cuda.synchronize(self._device)
            one = time.perf_counter() - t0
            each = one * (forwards + greedy)
            cost = (f"; one such forward took {one * 1e3:.0f} ms here, so about {_duration(each)} per request, "
                    f"{_duration(each * len(requests))} for these {len(requests)}")
        log.warning("%s: mc_num is %d by default (LLaDA's setting): each request takes %d forwards of %d row%s%s%s; "
                    "pass mc_num=N in --model_args for a faster, noisier estimate (batch_size=B: more rows per "
                    "forward)", kind, self.mc_num, forwards, rows, "s" if rows > 1 else "",
                    f" plus up to {greedy} greedy calls" if greedy else "", cost)

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        from tqdm import tqdm

        self._refuse_uniform("loglikelihood")
        if requests:
            self._warn_default_mc_num("loglikelihood", requests, self._encode_pair(*requests[0].args[:2]))
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="psd loglikelihood"):
            context, continuation = req.args[:2]
            ll, is_greedy = self._score(req, *self._encode_pair(context, continuation), "loglikelihood", True)
            out.append((ll, is_greedy))
            self.cache_hook.add_partial("loglikelihood", (context, continuation), (ll, is_greedy))
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from tqdm import tqdm

        self._refuse_uniform("loglikelihood_rolling")
        if requests:
            self._warn_default_mc_num("loglikelihood_rolling", requests, ([], self.tok.encode(requests[0].args[0])))
        out = []
        for req in tqdm(requests, disable=disable_tqdm, desc="psd loglikelihood_rolling"):
            (text,) = req.args[:1]
            ll, _ = self._score(req, [], self.tok.encode(text), "loglikelihood_rolling", False)
            out.append(ll)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), ll)
        return out


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


# ---------------------------------------------------------------------- offline tasks
def task_manager(include_path=None, **kwargs):
    """lm-eval's `TaskManager` with this package's offline tasks (TASKS_DIR) beside lm-eval's own
    and `include_path`'s: `simple_evaluate(model="psd", tasks=["gsm8k_local"], task_manager=task_manager())`."""
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=_with_local(include_path), **kwargs)


def _with_local(include_path) -> list[str]:
    paths = [] if include_path is None else list(include_path) if isinstance(include_path, (list, tuple)) \
        else [include_path]
    return [str(TASKS_DIR), *paths]


def _offline_error(task: str, e: Exception) -> InputError:
    twin = LOCAL_TASKS.get(task)
    instead = (f"use --tasks {twin} (the same task on the data shipped with psd-engine)" if twin else
               f"use a task on local files, e.g. --tasks {' or '.join(LOCAL_TASKS.values())}")
    offline = [v for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE") if os.environ.get(v, "").strip().lower()
               in ("1", "true", "yes", "on")]
    why = f"offline ({offline[0]}={os.environ[offline[0]]})" if offline else "the hub is not reachable"
    detail = " ".join(str(e).split())[:300].rstrip(".")
    return InputError(f"task {task} needs its data from the Hugging Face hub, which cannot be used here: {why}; "
                      f"{type(e).__name__}: {detail}; {instead}, or on a machine with network access export "
                      f"HF_DATASETS_OFFLINE=0 HF_HUB_OFFLINE=0 (docs/lm_eval.md, Offline tasks)")


def _is_hub_miss(e: Exception) -> bool:
    """Whether `e`, raised while lm-eval builds a task (its data set, or a metric its utils.py
    fetches with `evaluate.load`), says that something on the hub could not be fetched."""
    names = {c.__name__ for c in type(e).__mro__}
    if names & {"ConnectionError", "OfflineModeIsEnabled", "LocalEntryNotFoundError", "DatasetNotFoundError",
                "HfHubHTTPError", "Timeout"}:
        return True
    text = str(e).lower()
    return isinstance(e, OSError) and ("hugging face hub" in text or "on the hub" in text)


class _OfflineTasks:
    """While lm-eval's CLI runs: every TaskManager also indexes TASKS_DIR (the CLI's --include_path
    is one string, so it cannot carry two paths), and a task that needs the hub where it cannot be
    reached (its data set, or a metric fetched from there) is an InputError naming the task
    instead of a traceback from `datasets` or `evaluate`."""

    def __enter__(self):
        from lm_eval.tasks import TaskManager

        init, load_spec = TaskManager.__init__, TaskManager._load_spec
        self._saved = {"__init__": init, "_load_spec": load_spec}

        def manager_init(tm, verbosity=None, include_path=None, *a, **kw):
            init(tm, verbosity, _with_local(include_path), *a, **kw)

        def manager_load_spec(tm, spec, *a, **kw):
            try:
                return load_spec(tm, spec, *a, **kw)
            except Exception as e:
                if _is_hub_miss(e):
                    name = (spec.get("task") or spec.get("group")) if isinstance(spec, dict) else spec
                    raise _offline_error(str(name or spec), e) from None
                raise

        TaskManager.__init__, TaskManager._load_spec = manager_init, manager_load_spec
        return self

    def __exit__(self, *exc):
        from lm_eval.tasks import TaskManager

        for name, value in self._saved.items():
            setattr(TaskManager, name, value)
        return False


# ---------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    """lm-eval's own CLI (`lm_eval.__main__.cli_evaluate`) with the `psd` model registered and the
    offline tasks indexed, then the TPF / calls table of the run. Bad model_args, a hub data set
    that cannot be loaded, or code tasks without a sandbox print one `error:` line, exit status 2."""
    from lm_eval.__main__ import cli_evaluate

    from bench.sandbox import SandboxUnavailable

    sys.argv = ["lm-eval", *(sys.argv[1:] if argv is None else argv)]   # cli_evaluate parses sys.argv
    try:
        with _OfflineTasks():
            cli_evaluate()
    except (InputError, CheckpointError, SandboxUnavailable) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except ValueError as e:           # lm-eval's own word on a task name it cannot find (a typo)
        if not str(e).startswith("Tasks not found"):
            raise
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if PsdLM.last is not None and PsdLM.last.stats:
        print(PsdLM.last.stats_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
