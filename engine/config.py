"""`DecodeConfig`: a method and the options it was given, checked once before any decoding.

Its attributes are the options of engine/options.py (an option nobody gave reads as its default,
`None` for a policy parameter = the policy's own default); what a method does with them is its
entry in engine/methods.py. Nothing here names a method.
"""
from __future__ import annotations

import operator

from .errors import InputError
from .graph import DraftGraph
from .methods import METHODS, Method, methods_taking, policy_methods
from .options import OPTIONS, RUNTIME, join
from .policies import Policy


class DecodeConfig:
    """A method and its options. Every option of the table is an attribute, set once here: the value
    given, else the option's default (`None` for a policy parameter: the policy's own default).

    Typed from the table, never restated: the fields are `DecodeConfig.__annotations__` (so
    `typing.get_type_hints(DecodeConfig)`), `method: str` then one per option of engine/options.py's
    `OPTIONS`, its `Option.annotation` (the kind, `kind | None` where the default is None). They are
    derived from the table at import and again at every change of it, so an option registered later
    (a plugin policy's `declares`) is a typed field at once, made, checked and listed by `as_dict`
    like any other. A value of the wrong type is refused when the config is made (the option's own
    one-line InputError); ranges, choices and what the method takes are `validate`'s. Defaults and
    help live only in engine/options.py.

    Frozen: an attribute (or `given`) cannot be set after construction (`replace(**options)` makes a
    changed copy), so `validate` checks a config once and its policy and draft graph are built once,
    the same objects for the checks, the decoder and `describe`. Equal configs (same method and
    values) hash alike."""

    __annotations__ = {}            # the fields: derived from OPTIONS by _derive_fields, below

    def __init__(self, method: str | None = None, **options):
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise InputError(f"unknown decoding option {unknown[0]!r}; options: {', '.join(sorted(OPTIONS))}")
        given = {k: OPTIONS[k].check_type(v) for k, v in options.items() if v is not None}   # None = not given
        object.__setattr__(self, "method", "greedy" if method is None else method)
        object.__setattr__(self, "method_given", method is not None)     # None: the default (a model may pick)
        object.__setattr__(self, "given", _Given(given))
        for name, option in OPTIONS.items():
            object.__setattr__(self, name, given.get(name, option.default))

    def __getattr__(self, name):      # only an option registered after this config was made: its default
        if name in OPTIONS:
            return OPTIONS[name].default
        raise AttributeError(f"DecodeConfig has no attribute {name!r}")

    def __setattr__(self, name, value):
        raise AttributeError(f"DecodeConfig is frozen: replace({name}=...) makes a changed copy")

    def __delattr__(self, name):
        raise AttributeError(f"DecodeConfig is frozen: {name} cannot be deleted")

    def _once(self, key: str, build):
        """`build()`, made on the first call only (the config never changes)."""
        if key not in self.__dict__:
            object.__setattr__(self, key, build())
        return self.__dict__[key]

    def replace(self, **options) -> "DecodeConfig":
        given = {**self.given, **options}
        return DecodeConfig(given.pop("method", self.method if self.method_given else None), **given)

    def as_dict(self) -> dict:
        """Every option's value (given or default), with the method."""
        return {"method": self.method, **{name: getattr(self, name) for name in OPTIONS}}

    def __eq__(self, other) -> bool:
        return isinstance(other, DecodeConfig) and self.as_dict() == other.as_dict()

    def __hash__(self) -> int:
        return hash(frozenset(self.as_dict().items()))

    def __repr__(self) -> str:
        return f"DecodeConfig(method={self.method!r}, {', '.join(f'{k}={v!r}' for k, v in self.given.items())})"

    # ------------------------------------------------------------------ checks
    def validate(self) -> "DecodeConfig":
        if self.__dict__.get("_valid"):          # frozen: checked once
            return self
        if not isinstance(self.method, str) or self.method not in METHODS:
            raise InputError(f"unknown method {self.method!r}; expected one of {', '.join(METHODS)}")
        for name, value in self.given.items():
            OPTIONS[name].validate(value)
        takes = self.spec.takes(self)
        for name in self.given:
            if not OPTIONS[name].general and name not in takes:
                taking = methods_taking(name)
                if self.method in taking:        # psd takes it through other policies than the chosen one
                    pols = [p for p in policy_methods() if name in METHODS[p].policy.params]
                    pols = ", ".join(pols[:-1]) + " or " + pols[-1] if len(pols) > 1 else pols[0]
                    raise InputError(f"{OPTIONS[name].what} applies to {self.method} with --policy {pols}, not "
                                     f"with {self.policy_name}")
                raise InputError(f"{OPTIONS[name].what} applies to {join(taking)}, not to {self.method}")
        if self.graph is not None and "depth" in self.given:
            raise InputError("give a draft graph or a depth, not both (the graph fixes the depth)")
        if self.cross_block and self.cache != "none":
            raise InputError(f"--cross-block needs --cache none (with a {self.cache} cache the next block's first "
                             f"call also rebuilds the cache)")
        if self.top_logprobs and self.cross_block:
            raise InputError("--top-logprobs is not supported with --cross-block (a block opened from a carried "
                             "output has no alternatives)")
        if self.editing_threshold is not None and len(self.draft_graph()) > 1:
            raise InputError("token editing (--editing-threshold) is not supported with drafts: a step that edits "
                             "changes tokens a draft was built on, so no draft past it is the plain policy's step "
                             "(docs/algorithms.md §8)")
        pol = self.spec.policy_class(self)
        if self.exact and len(self.draft_graph()) > 1 and pol.steps_its_state():
            raise InputError(f"{pol.name} updates its state every step, and drafts are verified with the state as "
                             f"it is, so exact acceptance would not be lossless over it: give --acceptance policy, "
                             f"or no drafts (docs/loop.md)")
        if self.cost_profile is not None and self.draft_budget != "auto":
            raise InputError("a cost profile applies to --draft-budget auto only")
        top = max((r for s in self.draft_graph().nodes for r in s), default=-1)
        if top >= self.block_length * self.window_blocks:
            raise InputError(f"the draft graph names rank {top}, but a step ranks at most "
                             f"{self.block_length * self.window_blocks} positions (the block length)")
        if self.gen_length % self.block_length and self.align == "generation":    # auto: `for_model` (the model's)
            raise InputError(self.unaligned())
        needs = self.spec.policy_class(self).score
        if needs is not None and self.given.get("score", needs) != needs:
            raise InputError(f"{self.policy_name if self.method == 'psd' else self.method} reads the {needs} score: "
                             f"give --score {needs} or leave --score out, not {self.score}")
        self.spec.policy_class(self).check(self)
        object.__setattr__(self, "_valid", True)
        return self

    # ------------------------------------------------------------------ what the method runs
    @property
    def spec(self) -> Method:
        return METHODS[self.method]

    @property
    def confidence_score(self) -> str:
        """The score every output's confidence is (`psd_kernels.top1`'s `score`): the one the policy's
        rule reads where it names one (eb: entropy), else `--score`."""
        return self.spec.policy_class(self).score or self.score

    @property
    def num_blocks(self) -> int:
        return self.gen_length // self.block_length

    def unaligned(self) -> str:
        """The refusal of a gen length off the block grid where blocks start at the generation."""
        return (f"gen length {self.gen_length} is not a multiple of the block length {self.block_length} "
                f"(--align sequence takes any)")

    def aligned(self, mc) -> bool:
        """Blocks counted from each sequence's first token (`--align sequence`; auto: on block-causal
        models, whose attention blocks are counted so)?"""
        return self.align == "sequence" or (self.align == "auto" and mc.attention == "block_causal")

    def policy(self) -> Policy:
        """The stage-1 policy, built once."""
        return self._once("_policy", lambda: self.spec.policy_class(self).from_config(self))

    def draft_graph(self) -> DraftGraph:
        """The stage-2 draft graph, built once (validate, the decoder and describe share it)."""
        return self._once("_graph", lambda: self.spec.graph(self) if self.spec.graph is not None
                          else DraftGraph.root_only())

    def selection(self, policy: Policy, graph: DraftGraph, mask_id: int):
        return self.spec.selection.build(self, policy, graph, mask_id)

    @property
    def exact(self) -> bool:
        return self.spec.exact(self)

    @property
    def window_blocks(self) -> int:
        """Blocks whose masked positions are eligible in one step (ETE's cross-block window)."""
        return self.spec.window_blocks(self)

    def describe(self) -> str:
        runtime = [OPTIONS[o].label.lstrip("-") for o in RUNTIME if getattr(self, o)]
        suffix = f"[{','.join(runtime)}]" if runtime else ""
        return self.spec.describe(self, self.policy(), self.draft_graph()) + suffix


_OWN = ("method", "given", "method_given")     # instance attributes that are no option


def _derive_fields() -> None:
    """`DecodeConfig.__annotations__` from the option table, in place: run at import and by the table
    after every change (`OptionTable.watchers`). An option whose name DecodeConfig uses otherwise
    (an attribute, a method, a private `_` name) is refused: it would shadow it or be shadowed."""
    clash = [n for n in OPTIONS if n in _OWN or n.startswith("_") or hasattr(DecodeConfig, n)]
    if clash:
        raise ValueError(f"option {clash[0]!r} is a name DecodeConfig uses otherwise; name the option differently")
    fields = DecodeConfig.__dict__["__annotations__"]
    fields.clear()
    fields.update({"method": str, **{name: option.annotation for name, option in OPTIONS.items()}})


_derive_fields()
OPTIONS.watchers.append(_derive_fields)


class _Given(dict):
    """`DecodeConfig.given`: the options given, read-only (the config is frozen)."""

    def _frozen(self, *args, **kw):
        raise TypeError("DecodeConfig is frozen: replace(...) makes a changed copy")

    __setitem__ = __delitem__ = pop = popitem = clear = update = setdefault = __ior__ = _frozen

    def __reduce__(self):
        return _Given, (dict(self),)


def text_ids(tokenizer, text: str, chat: bool = False) -> list[int]:
    """The token ids of a prompt's text (`chat`: a rendered chat template, encoded without the
    tokenizer's special tokens: the template writes its own); a text the tokenizer makes no token
    of (characters its vocabulary lacks, with no unknown token to stand for them) is one error line,
    not an empty prompt."""
    ids = tokenizer.encode(text, special=False) if chat else tokenizer.encode(text)
    if not ids:
        raise InputError(f"the prompt ({len(text)} characters) encodes to no token with this model's tokenizer")
    return ids


def prompt_ids(tokenizer, prompt: str | list[dict], chat: bool = False) -> list[int]:
    """A user's prompt as token ids (`text_ids`): its text as written, or (`chat`) through the
    checkpoint's chat template, a text as one user turn, a list as its {"role", "content"} messages."""
    return text_ids(tokenizer, tokenizer.apply_chat_template(prompt) if chat else prompt, chat)


def exact_int(value) -> int:
    """`value` as an int: ints and integer numpy/torch scalars (operator.index), never floats, and
    never bools (operator.index takes True as 1); anything else is a TypeError."""
    if isinstance(value, bool):
        raise TypeError("a bool is not an index")
    return operator.index(value)


def check_seeds(seeds, n: int) -> list | None:
    """Per-sequence sampling seeds (`Decoder.start`, `LiveBatch.add`): None, or `n` of them, each None
    (the config's seed + its row) or an integer in the seed option's range; else InputError."""
    if seeds is None:
        return None
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, (list, tuple)):
        raise InputError(f"seeds must be a list (one per prompt), got {type(seeds).__name__}")
    if len(seeds) != n:
        raise InputError(f"{len(seeds)} seeds for {n} prompts")
    out = []
    for s in seeds:
        try:
            out.append(None if s is None else OPTIONS["seed"].validate(exact_int(s)))
        except TypeError:
            raise InputError(f"a seed must be an integer, got {s!r}") from None
    return out


def check_prompts(mc, dc: DecodeConfig, prompts, gen_length: int | list[int] | None = None) -> list[list[int]]:
    """Validate a batch of prompts (token-id lists) against a model config, each to be followed by
    `gen_length` generated positions (default the config's; a list: one per prompt); returns int lists."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, (list, tuple)) or not prompts:
        raise InputError("prompts must be a non-empty list of token-id lists")
    out = []
    for n, (p, gen_length) in enumerate(zip(prompts, _gen_lengths(mc, dc, gen_length, len(prompts)))):
        if isinstance(p, (str, bytes)) or not hasattr(p, "__iter__"):
            raise InputError(f"prompt {n} is not a list of token ids")
        try:
            p = list(p)                               # (an iterator is read once)
            if any(isinstance(t, bool) for t in p):
                raise InputError(f"prompt {n} holds a bool where a token id belongs")
            ids = [exact_int(t) for t in p]
        except TypeError:
            raise InputError(f"prompt {n} holds a token id that is not an integer") from None
        if not ids:
            raise InputError(f"prompt {n} is empty")
        if any(not 0 <= t < mc.vocab_size for t in ids):
            raise InputError(f"prompt {n} holds a token id outside the vocabulary of size {mc.vocab_size}")
        if mc.mask_token_id in ids:
            raise InputError(f"prompt {n} contains the mask token (id {mc.mask_token_id})")
        pad = -(len(ids) + gen_length) % dc.block_length if dc.aligned(mc) else 0
        if len(ids) + gen_length + pad > mc.max_length:
            aligned = (f" and {pad} positions that align the sequence to whole blocks of {dc.block_length} "
                       f"(blocks counted from its first token)") if pad else ""
            raise InputError(f"prompt {n} of {len(ids)} tokens plus gen length {gen_length}{aligned} exceeds "
                             f"the model's maximum length {mc.max_length}")
        dc.spec.policy_class(dc).validate_request(dc, ids, gen_length)      # the policy's own word on it
        out.append(ids)
    return out


def _gen_lengths(mc, dc: DecodeConfig, given, n: int) -> list[int]:
    """The checked gen length of each of `n` prompts: `given` None (the config's), one int, or one per prompt."""
    if given is None:
        return [dc.gen_length] * n
    if isinstance(given, (list, tuple)):
        if len(given) != n:
            raise InputError(f"{len(given)} gen lengths for {n} prompts")
        return [check_gen_length(mc, dc, g) for g in given]
    return [check_gen_length(mc, dc, given)] * n


def check_gen_length(mc, dc: DecodeConfig, g) -> int:
    """`g` if it is a gen length `dc` decodes on model `mc`: a positive integer, a multiple of the
    block length where blocks start at the generation (`dc.aligned`); else InputError."""
    try:
        g = exact_int(g)                 # an int, or a numpy / 0-d tensor integer
    except TypeError:
        raise InputError(f"gen length {g!r} must be a positive integer") from None
    if g < 1:
        raise InputError(f"gen length {g!r} must be a positive integer")
    if g % dc.block_length and not dc.aligned(mc):
        raise InputError(dc.replace(gen_length=g).unaligned())
    return g
