"""The method table: one declarative entry per decoding method (docs/algorithms.md §2-§3).

An entry says which stage-1 policy the method runs, which draft graph stage 2 builds, how stage 3
keeps a draft, whether that is lossless, and which options the method itself takes (its policy's
options come with the policy class). `DecodeConfig`, the CLI, `bench.eval` and `engine.calibrate`
read this table; adding a policy with one parameter is its class (which declares the parameter's
`Option` if it is new) and one `register(Method(...))`, here or in the caller's own code.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Callable

from .acceptance import BestScore, DraftConfidence, Hierarchical, Selection
from .graph import DraftGraph
from .options import OPTIONS, POLICY_NAMES
from .options import register as register_option
from .policies import (Confidence, CrossBlock, EntropyBound, Greedy, LeftToRight, LocalLeap, Policy, Random, Threshold,
                       TopK)


def _never(cfg) -> bool:
    return False


def _one_block(cfg) -> int:
    return 1


def _plain(cfg, policy: Policy, graph: DraftGraph) -> str:
    return policy.describe()


@dataclass(frozen=True)
class Method:
    name: str
    help: str
    policy: type[Policy] | None              # the stage-1 policy; None: chosen by the `policy_name` option
    options: tuple[str, ...] = ()            # options of the method itself, beyond its policy's
    graph: Callable | None = None            # cfg -> stage-2 DraftGraph; None: root only (no drafts)
    selection: type[Selection] = Hierarchical
    exact: Callable = _never                 # cfg -> lossless with respect to its policy?
    window_blocks: Callable = _one_block     # cfg -> blocks whose positions one step may commit
    describe: Callable = _plain              # (cfg, policy, graph) -> the label in results and tables
    is_policy: bool = False                  # a plain policy, selectable as psd's spatial policy
    defaults: tuple[tuple[str, object], ...] = ()   # (option, value) a method option of None decodes with

    def resolved(self, cfg, option: str):
        """What `option` of `cfg` decodes with: its value, or this method's default for it."""
        value = getattr(cfg, option)
        return dict(self.defaults).get(option) if value is None else value

    def policy_class(self, cfg) -> type[Policy]:
        return self.policy if self.policy is not None else METHODS[cfg.policy_name].policy

    def takes(self, cfg) -> tuple[str, ...]:
        """Options this method takes under `cfg` (psd: its own plus the chosen policy's)."""
        pol = self.policy_class(cfg) if (self.policy is not None or cfg.policy_name in METHODS) else None
        own = tuple(pol.params) if pol is not None else ()
        return tuple(dict.fromkeys(self.options + own))


METHODS: dict[str, Method] = {}
_ABSENT = object()
# method name -> {option name: what the option table held there before that method's policy declared
# it (an Option it replaced, or _ABSENT)}: what `unregister` puts back
_DECLARED: dict[str, dict[str, object]] = {}


def _uses(method: Method, option: str) -> bool:
    pol = method.policy
    return option in method.options or pol is not None and (
        option in pol.params or any(o.name == option for o in getattr(pol, "declares", ())))


def _restore(before: dict[str, object]) -> None:
    """Put the option table back as `before` says (name -> the Option it held, or _ABSENT)."""
    for name, old in before.items():
        if old is _ABSENT:
            OPTIONS.pop(name, None)
        else:
            OPTIONS[name] = old


def register(method: Method) -> Method:
    """Add a method to the table, with the new options its policy declares; every option it
    names must then exist in the option table (else ValueError, and the table is as it was)."""
    if not isinstance(method, Method):
        raise TypeError(f"register takes an engine.Method, got {type(method).__name__}")
    if method.policy is not None:
        _check_policy(method.policy)
    before: dict[str, object] = {}        # what the option table held where this registration writes
    try:
        for option in getattr(method.policy, "declares", ()):
            if OPTIONS.get(option.name, _ABSENT) is not option:
                _check_spellings(option)
                before.setdefault(option.name, OPTIONS.get(option.name, _ABSENT))
                register_option(option)
        pol_opts = tuple(method.policy.params) if method.policy is not None else ()
        missing = [o for o in method.options + pol_opts if o not in OPTIONS]
        if missing:
            raise ValueError(f"method {method.name!r} names unknown options {missing}")
    except BaseException:                  # a refused registration leaves the table as it was
        _restore(before)
        raise
    declared = _DECLARED.get(method.name, {}) if method.name in METHODS else {}
    _DECLARED[method.name] = {**before, **declared}       # a re-registration keeps the first state
    METHODS[method.name] = method
    if method.is_policy and method.name not in POLICY_NAMES:
        POLICY_NAMES.append(method.name)
    elif not method.is_policy and method.name in POLICY_NAMES:
        POLICY_NAMES.remove(method.name)
    return method


def _check_policy(policy) -> None:
    """A policy class the loop can build and call (else ValueError at registration, not a traceback
    when its option is first given): a frozen dataclass of Policy with its own select, whose
    `params` name its fields, each default declared once (a declared Option's default that differs
    from its field's made --help show one value and the decode use the other)."""
    name = getattr(policy, "name", policy)
    if not (isinstance(policy, type) and issubclass(policy, Policy)):
        raise ValueError(f"the policy {name!r} must be a subclass of engine.Policy")
    if policy.select is Policy.select:
        raise ValueError(f"the policy {name!r} does not define select(conf, masked, step)")
    fields = {f.name: f for f in dataclasses.fields(policy)}
    for option, attr in policy.params.items():
        if attr not in fields:
            hint = " (is the class a @dataclass(frozen=True)?)" if attr in vars(policy).get("__annotations__", {}) else ""
            raise ValueError(f"the policy {name!r} maps the option {option!r} to {attr!r}, which is not one of its "
                             f"fields ({', '.join(fields) or 'none'}){hint}")
    for option in getattr(policy, "declares", ()):
        field = fields.get(policy.params.get(option.name, ""))
        if option.default is not None and field is not None and field.default is not dataclasses.MISSING \
                and field.default != option.default:
            raise ValueError(f"the option {option.name!r} has the default {option.default!r} and the policy's field "
                             f"{field.name!r} {field.default!r}: give it on the field only")


def _check_spellings(option) -> None:
    """A new option's name is an identifier, and neither it nor its aliases is already another
    option's spelling (`tau` or `d` would resolve to threshold or depth in a method spec)."""
    if not option.name.isidentifier():
        raise ValueError(f"option name {option.name!r} is not an identifier (it becomes a flag and a field)")
    taken = {s: o.name for o in OPTIONS.values() if o.name != option.name for s in (o.name,) + o.aliases}
    clash = next((s for s in (option.name,) + option.aliases if s in taken), None)
    if clash is not None:
        raise ValueError(f"the option {option.name!r}: {clash!r} already spells the option {taken[clash]!r}")


def unregister(name: str) -> Method:
    """Remove a method from the table, and the options its policy declared: an option it added goes
    (unless a method still registered takes it), one it replaced is put back as it was."""
    if name not in METHODS:
        raise KeyError(f"no method {name!r} is registered")
    default = OPTIONS["policy_name"].default if "policy_name" in OPTIONS else None
    if name == default:              # psd would be left without a policy (a KeyError in every validate)
        raise ValueError(f"{name!r} is psd's default policy (the option policy_name): it cannot be unregistered")
    method = METHODS.pop(name)
    if name in POLICY_NAMES:
        POLICY_NAMES.remove(name)
    for option, old in _DECLARED.pop(name, {}).items():
        heir = next((m for m in METHODS.values() if _uses(m, option)), None) if old is _ABSENT else None
        if heir is not None:               # still taken: it goes with the last method that takes it
            _DECLARED.setdefault(heir.name, {}).setdefault(option, old)
        else:
            _restore({option: old})
    return method


def policy_methods() -> tuple[str, ...]:
    return tuple(POLICY_NAMES)


def methods_taking(option: str) -> list[str]:
    """Methods that can take `option` (psd through any of its policies)."""
    out = []
    for name, m in METHODS.items():
        pols = [m.policy] if m.policy is not None else [METHODS[p].policy for p in policy_methods()]
        if option in m.options or any(option in p.params for p in pols):
            out.append(name)
    return out


# ---------------------------------------------------------------- stage-2 graphs and labels
def _option_graph(cfg) -> DraftGraph:
    return cfg.graph if cfg.graph is not None else DraftGraph.chain(cfg.depth)


def _speculative(cfg, policy, graph) -> str:
    shape = f"d={cfg.depth}" if cfg.graph is None else f"graph={len(graph)} nodes,d={graph.depth}"
    budget = (",auto" if cfg.draft_budget == "auto" else "") + (",cross-block" if cfg.cross_block else "") + \
        (",confidence-order" if cfg.draft_order == "confidence" else "")
    return f"{cfg.method}({policy.describe()},{shape},{'exact' if cfg.exact else 'policy'}{budget})"


# eb on a uniform-noise model (DiffusionGemma): its denoising settings (engine/uniform.py; refused on masked models)
UNIFORM_NOISE = ("max_denoising_steps", "t_min", "t_max", "stability_threshold", "confidence_threshold")
SPECULATION = ("draft_budget", "cost_profile", "cross_block")   # budget.py: which drafts pay; ahead.py: across blocks


def _windowed(cfg, policy, graph) -> str:
    return f"{cfg.method}(k={cfg.k},{policy.describe()})"


def _fdm(cfg, policy, graph) -> str:
    """fdm's τ is its acceptance's, not its policy's (greedy): named when not the default, so labels
    that tables already use stay and two τ are two rows."""
    tau = cfg.spec.resolved(cfg, "threshold")
    tau = "" if tau == Confidence.tau else f",tau={tau:g}"
    return f"{cfg.method}(k={cfg.k},{policy.describe()}{tau})"


for _m in (
    Method("greedy", "one token per step, the most confident", Greedy, is_policy=True),
    Method("topk", "LLaDA's schedule: k_t tokens at step t", TopK, is_policy=True),
    Method("confidence", "Fast-dLLM: every position with c >= τ (at least one)", Confidence, is_policy=True),
    Method("localleap", "anchors c >= κ and positions with c >= τ within W of one", LocalLeap, is_policy=True),
    Method("left", "semi-autoregressive: the left-most masked position and the confident run after it",
           LeftToRight, is_policy=True),
    Method("random", "LLaDA's random remasking: topk's schedule, positions drawn at random (seeded)", Random,
           is_policy=True),
    Method("threshold", "LLaDA2.x: c > τ per step, at least its k_t; optional token editing", Threshold,
           is_policy=True),
    Method("eb", "EB-Sampler: the lowest-entropy positions while their entropy sum minus its largest is <= γ",
           EntropyBound, UNIFORM_NOISE, is_policy=True),
    Method("spiffy", "lossless drafts of greedy over a draft graph", Greedy, ("depth", "graph") + SPECULATION,
           graph=_option_graph, exact=lambda cfg: True, describe=_speculative),
    Method("psd", "parallel speculative decoding over any policy", None,
           ("policy_name", "depth", "graph", "acceptance", "draft_order") + SPECULATION, graph=_option_graph,
           exact=lambda cfg: cfg.acceptance == "exact", describe=_speculative),
    Method("lopa", "k branches, the best mean confidence kept", Confidence, ("k",),
           graph=lambda cfg: DraftGraph([[]] + [[j] for j in range(cfg.k - 1)]), selection=BestScore,
           describe=_windowed),
    Method("ete", "confidence over a window of k blocks", CrossBlock, ("k",),
           window_blocks=lambda cfg: cfg.k, describe=_windowed),
    Method("fdm", "k future greedy steps kept while above τ", Greedy, ("k", "threshold"),
           graph=lambda cfg: DraftGraph.chain(cfg.k), selection=DraftConfidence, describe=_fdm,
           defaults=(("threshold", Confidence.tau),)),
):
    register(_m)
