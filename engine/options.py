"""Every decoding option, declared once (docs/algorithms.md §2-§3, §6).

An `Option` carries what every front end needs: its type (the parser of a command-line or
method-spec string), default, range check, choices, help text and extra spellings. `DecodeConfig`
(engine/config.py), the flags of `python -m engine.generate` (engine/cli.py), the method specs of
`bench.eval` and `engine.calibrate` are all derived from `OPTIONS`; which method takes which option
is said by the method table (engine/methods.py). A policy parameter's default lives on its policy
class (engine/policies.py), so an option without one here defaults to `None` = "the policy's".
"""
from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, Callable

from psd_kernels.reference import SCORES

from .cache import CACHE_MODES
from .errors import InputError
from .graph import MAX_NODES, DraftGraph

CONF_DTYPES = ("float32", "float64")
ACCEPTANCE = ("policy", "exact")
ALIGNMENTS = ("auto", "generation", "sequence")


def join(names) -> str:
    """`a`, `a and b`, `a, b and c`."""
    names = list(names)
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


# Gumbel-max sampling divides the logits by the temperature. Above MAX_TEMPERATURE the logits of any
# model vanish against the noise (the sample is uniform over the vocabulary, as it is at every larger
# value); below MIN_TEMPERATURE (but > 0) logits / T overflows float32 to inf and 0 / T to NaN.
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-6, 1e4
MAX_TOP_LOGPROBS = 20          # alternatives per committed token (vLLM's default cap, OpenAI's chat limit)
# The largest integer option value (a count, a length, a window): beyond it a value is no real setting
# and would overflow the int32/int64 tensors it becomes (the seed, a 64-bit generator state, has its own)
MAX_INT_OPTION = 2 ** 31 - 1


def _at_least(lo: int):
    return lambda label, v: None if v >= lo else f"{label} must be >= {lo}, got {_short(v)}"


def _between(lo: int, hi: int, why: str):
    """At least `lo` and at most `hi`, `why` saying where the upper bound comes from."""
    return lambda label, v: _at_least(lo)(label, v) or (
        None if v <= hi else f"{label} must be <= {hi} ({why}), got {_short(v)}")


def _short(v) -> str:
    """A value for a message: a huge integer is not printed in full."""
    text = str(v)
    return text if len(text) <= 24 else f"{text[:10]}...({len(text)} digits)"


def _unit(label, v):
    return None if 0.0 < v <= 1.0 else f"{label} {_short(v)} is outside (0, 1]"


def _temperature(label, v):
    try:
        finite = math.isfinite(v)
    except OverflowError:          # an integer beyond any float is no finite temperature
        finite = False
    if not finite or v < 0:
        return f"{label} must be finite and >= 0, got {_short(v)}"
    if v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE:
        return None
    return f"{label} must be 0 (argmax) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}], got {_short(v)}"


@dataclass(frozen=True)
class Option:
    name: str                                # DecodeConfig attribute and keyword of engine.generate
    kind: type                               # int, float, str or DraftGraph
    help: str
    default: Any = None                      # None: unset (a policy parameter: the policy's default)
    label: str = ""                          # how messages name it (default: the name)
    choices: tuple | Callable[[], tuple] = ()  # allowed values (a callable for tables that can grow)
    check: Callable[[str, Any], str | None] | None = None   # what is wrong with a value, or None
    aliases: tuple[str, ...] = ()            # other spellings in method specs (tau, d, w, policy)
    general: bool = False                    # taken by every method (sizes, cache, sampling)
    cli: str = ""                            # the command-line flag, where not --name-dashed
    metavar: str | None = None               # the flag's value in --help
    most: int | None = MAX_INT_OPTION        # an int option's largest value (None: its check bounds it)

    @property
    def what(self) -> str:
        return self.label or self.name

    @property
    def flag(self) -> str:
        return self.cli or "--" + self.name.replace("_", "-")

    def allowed(self) -> tuple:
        return self.choices() if callable(self.choices) else self.choices

    def parse(self, text: str):
        """A value from a command-line or method-spec string."""
        if self.kind is DraftGraph:
            return DraftGraph.load(text)
        if self.kind is bool:
            word = text.strip().lower()
            if word not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise InputError(f"bad value {text!r} for {self.what}: expected true or false")
            return word in ("1", "true", "yes", "on")
        try:
            return self.kind(text.strip())
        except ValueError:
            raise InputError(f"bad value {text!r} for {self.what}: expected {self.kind.__name__}") from None

    @property
    def annotation(self):
        """The type of `DecodeConfig`'s field: the kind, or `kind | None` where the default is None
        (unset: the policy's own default)."""
        return self.kind if self.default is not None else self.kind | None

    def check_type(self, value):
        """`value` if it is of the option's kind (an int for a float too, never a bool for a number; a
        numpy or 0-d tensor number as the Python one); else InputError. `DecodeConfig` checks this
        when it is made, `validate` the rest."""
        if self.kind is DraftGraph:
            if not isinstance(value, DraftGraph):
                raise InputError(f"{self.what} must be a DraftGraph, got {type(value).__name__}")
            return value
        if self.kind in (int, float) and not isinstance(value, (bool, int, float)):
            value = _python_number(value, self.kind)
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)) if self.kind is float else \
            (isinstance(value, int) and not isinstance(value, bool)) if self.kind is int else isinstance(value, self.kind)
        if not ok:
            raise InputError(f"{self.what} must be {self.kind.__name__}, got {value!r}")
        return value

    def validate(self, value):
        """`value` if it is of the right type, in range and among the choices; else InputError."""
        self.check_type(value)
        if self.kind is DraftGraph:
            return value
        allowed = self.allowed()
        if allowed and value not in allowed:
            raise InputError(f"unknown {self.what} {value!r}; expected one of {', '.join(allowed)}")
        try:
            problem = self.check(self.what, value) if self.check else None
        except (ValueError, TypeError) as e:       # a check that raises says the same as one that returns
            problem = f"{self.what}: {e}"
        if problem is not None and not isinstance(problem, str):     # True was 'error: True'; False, valid
            raise InputError(f"the check of the option {self.name!r} returned {problem!r}: a check returns the "
                            f"error message (a str) or None, never a bool")
        if problem:
            raise InputError(problem)
        if self.kind is int and self.most is not None and value > self.most:
            raise InputError(f"{self.what} must be <= {self.most}, got {_short(value)}")
        return value


POLICY_NAMES: list[str] = []    # the plain policies of the method table, in order (engine.methods.register adds)


def _policy_names() -> tuple:
    return tuple(POLICY_NAMES)


def _cache_modes() -> tuple:
    return tuple(CACHE_MODES)


class OptionTable(dict):
    """The option table, a dict by name that tells what is derived from it of every change:
    `DecodeConfig`'s fields (engine/config.py) are re-derived after each, so an option registered
    later (a plugin policy's parameter) is a typed field at once and a removed one is gone. A watcher
    may refuse a new option by raising (a name `DecodeConfig` already uses); the table then undoes it."""

    def __init__(self):
        super().__init__()
        self.watchers: list[Callable[[], None]] = []     # called after every change, with the table as it is

    def _notify(self):
        for watch in self.watchers:
            watch()

    def __setitem__(self, name: str, option: Option):
        before = self.get(name, _ABSENT)
        super().__setitem__(name, option)
        try:
            self._notify()
        except BaseException:
            if before is _ABSENT:
                super().__delitem__(name)
            else:
                super().__setitem__(name, before)
            self._notify()
            raise

    def update(self, *args, **kw):
        for name, option in dict(*args, **kw).items():
            self[name] = option

    def setdefault(self, name: str, option: Option = None):
        if name not in self:
            self[name] = option
        return self[name]

    def __ior__(self, other):
        self.update(other)
        return self


def _removing(method: str):
    """A dict method that removes entries, then re-derives what the table's watchers derive."""
    def remove(self, *args):
        out = getattr(dict, method)(self, *args)
        self._notify()
        return out
    remove.__name__ = method
    return remove


for _m in ("__delitem__", "pop", "popitem", "clear"):
    setattr(OptionTable, _m, _removing(_m))
_ABSENT = object()

OPTIONS: OptionTable = OptionTable()


def register(option: Option) -> Option:
    """Add an option to the table (a new policy parameter is one call; its default lives on the policy).
    It is at once a typed field of `DecodeConfig`; a name that `DecodeConfig` uses otherwise (`given`,
    `validate`, ...) is refused with ValueError."""
    OPTIONS[option.name] = option
    return option


for _o in (
    # ---- general: every method
    Option("gen_length", int, "tokens to generate, a multiple of the block length", 128, "gen length",
           check=_at_least(1), general=True),
    Option("block_length", int, "block size L", 32, "block length", check=_at_least(1), general=True),
    Option("cache", str, "KV cache mode", "none", "cache mode", choices=_cache_modes, general=True),
    Option("score", str, "confidence score", "prob", "confidence score", choices=SCORES, general=True),
    Option("temperature", float, f"Gumbel-max sampling temperature (0: argmax; else in [{MIN_TEMPERATURE:g}, "
           f"{MAX_TEMPERATURE:g}])", 0.0, check=_temperature,
           general=True),
    Option("seed", int, "seed of the sampling noise", 0, check=lambda l, v: None if 0 <= v < 2 ** 64 else
           f"{l} must be in [0, 2**64), got {_short(v)}", general=True, most=None),
    Option("sampler", str, "at temperature > 0: batch (one generator for the batch, LLaDA's draw: a sample depends "
           "on its batch-mates) or row (one generator per sequence, seeded seed + its index in the batch, a server "
           "request's seed its own: a sample is the same whatever shares its batch; a sequence alone draws what batch "
           "draws)", "batch", "sampler", choices=("batch", "row"), general=True),
    Option("top_k", int, "sample only among the k most likely tokens (0: off; at temperature 0 the argmax is "
           "always among them: no effect)", 0, "top-k", check=_at_least(0), general=True),
    Option("top_p", float, "nucleus sampling: sample only among the most likely tokens whose probabilities at the "
           "temperature sum to p (1: off; at temperature 0: no effect)", 1.0, "top-p", check=_unit, general=True),
    Option("ignore_eos", bool, "never predict a stop token (their logits are -inf), so every sequence runs to its "
           "gen length", label="--ignore-eos", general=True),
    Option("min_tokens", int, "no stop token in a sequence's first N generated positions (their logits are -inf "
           "there), so no answer ends before N tokens (0: off; N >= gen length: --ignore-eos)", 0, "--min-tokens",
           check=_at_least(0), general=True, metavar="N", most=None),     # a bar: any size past the canvas is whole
    Option("top_logprobs", int, "also record, per committed token, the k most likely tokens and their probabilities "
           "in the output that committed it (SequenceResult.commit_top; 0: off)", 0, "--top-logprobs",
           check=_between(0, MAX_TOP_LOGPROBS, "the most alternatives recorded per token"), general=True,
           metavar="K"),
    Option("align", str, "where blocks start: generation (at each sequence's first generated position), sequence "
           "(every block_length positions from its first prompt token: the block holding the prompt's end is decoded "
           "first, its prompt part kept, and the last block runs past gen length to its end, the output cut at gen "
           "length; LLaDA2's layout) or auto (sequence on block-causal models, else generation)", "auto",
           "block alignment", choices=ALIGNMENTS, general=True),
    Option("conf_dtype", str, "dtype of the confidence computation (float64 for parity with references)",
           "float32", "confidence dtype", choices=CONF_DTYPES, general=True),
    Option("static_rows", bool, "pad every verification call of a block to the block's rows times the graph's "
           "nodes, so a block's calls share one shape (what CUDA graphs and a static torch.compile need); "
           "the tokens do not change at temperature 0", label="--static-rows", general=True),
    Option("compile", bool, "torch.compile the model's transformer blocks for this decoder (dynamic shapes; "
           "attention runs eagerly between the compiled parts; the first calls compile; the eager model is left "
           "as it is; bf16 rounding may differ from eager)",
           label="--compile", general=True),
    Option("cuda_graphs", bool, "replay every verification call from a CUDA graph captured per (rows, block) "
           "bucket (engine/graphs.py; needs a CUDA device and --static-rows; run once, on an H200: docs/gpu.md)",
           label="--cuda-graphs", general=True),
    # ---- method and policy options (engine/methods.py says which method takes which)
    Option("steps", int, "total steps over the generation (default: gen length)", check=_at_least(1)),
    Option("threshold", float, "confidence threshold τ", check=_unit, aliases=("tau",)),
    Option("kappa", float, "anchor threshold κ", check=_unit),
    Option("window", int, "anchor window W", check=_at_least(0), aliases=("w",)),
    Option("policy_name", str, "the spatial policy under the speculation", "confidence", "policy",
           choices=_policy_names, aliases=("policy",), cli="--policy"),
    Option("depth", int, "depth of the default chain draft graph", 3, "draft depth",
           check=_between(0, MAX_NODES - 1, f"a chain of depth d has d + 1 nodes, a draft graph at most {MAX_NODES}"),
           aliases=("d",)),
    Option("graph", DraftGraph, "draft graph JSON file (a list of rank lists)", label="a draft graph"),
    Option("draft_budget", str, "all: verify every graph node; auto: per block, the nodes whose expected tokens "
           "pay for their cost (a measured or --cost-profile cost of one call, online acceptance rates)", "all",
           "draft budget", choices=("all", "auto")),
    Option("cost_profile", str, "cost of one call from bench.speed --cost-curve (JSON) instead of measuring it",
           label="cost profile", metavar="PATH"),
    Option("cross_block", bool, "drafts that complete a block continue into the next one, verified by the "
           "same call; a kept draft that completes a block saves the next block's first call (cache none, "
           "bidirectional models)",
           label="--cross-block"),
    Option("acceptance", str, "the policy's own criterion, or exact (lossless)", "policy", "acceptance mode",
           choices=ACCEPTANCE),
    Option("draft_order", str, "policy: drafts rank future steps in the policy's own order (Policy.draft_key: "
           "left to right for left, its seeded draw for random, confidence otherwise); confidence: by "
           "confidence whatever the policy (the order before policies chose theirs)", "policy", "draft order",
           choices=("policy", "confidence")),
    Option("k", int, "lopa: branches; ete: blocks per window; fdm: future steps", 3,
           check=_between(1, MAX_NODES - 1, f"lopa and fdm build a draft graph of k or k + 1 nodes, at most "
                                            f"{MAX_NODES}; ete's windows are bounded alike")),
):
    register(_o)


RUNTIME = ("static_rows", "compile", "cuda_graphs")     # how calls run, not what is decoded: shown apart in labels


def resolve(key: str) -> Option:
    """The option a spelling names (name or alias)."""
    for o in OPTIONS.values():
        if key == o.name or key in o.aliases:
            return o
    raise InputError(f"unknown option {key!r}; options: {', '.join(spellings())}")


def spellings() -> list[str]:
    return sorted(s for o in OPTIONS.values() for s in (o.name,) + o.aliases)


def _python_number(value, kind):
    """A numpy integer (or float, for a float option) or a 0-d tensor as the Python number; anything
    else unchanged (the caller refuses it)."""
    try:
        return operator.index(value)              # integers only: never a float, never numpy's bool
    except TypeError:
        pass
    if kind is float and isinstance(value, numbers.Real) and type(value).__name__ != "bool_":
        return float(value)
    return value
