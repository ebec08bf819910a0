"""`python -m bench.speed --simulate CARD`: a PROJECTION (not a measurement) of tokens/s on a GPU.

    python -m bench.speed --simulate h100-sxm --shape llada-8b --num-prompts 8 --gen-length 64
    python -m bench.speed --simulate h100-sxm a100-80g --shape llada-8b --cache none dual --batch-sizes 1 8
    python -m bench.speed --simulate h100-sxm --cost-profile gpu-report/cost_llada_8b/cost_profile.json ...

Until a GPU runs the benchmark, this says what the measured call structure would be worth on a
card. Two inputs:

1. The calls a decode makes, measured here: every method decodes the prompts on THIS machine
   with the acceptance model (the shipped models/default, or --model DIR), and a forward
   pre-hook records every model call: its rows n, query positions T, cached positions P, cache
   rows C and logit positions O per row. Tokens, calls, TPF and acceptance are real decodes;
   they are the acceptance model's, not the target's (a 5.6M-parameter model accepts other
   drafts than LLaDA-8B would).
2. The cost of each such call on the card: a roofline at the target shape (--shape, or the
   acceptance model's own config), or a measured cost curve (--cost-profile, from
   `bench.speed --cost-curve` on that card: ms of a call of n canvases, whatever T and P).

Roofline cost of one call (element size s bytes, the card's HBM bandwidth BW and dense
bf16 FLOP/s F from the vendor datasheet, `CARDS`):

    tokens  = n·T
    bytes   = s·( W_read + V·d                    weights, each read once per call (the LM head too)
                + tokens·d                        the embedding rows gathered
                + C·P·layers·2·Hkv·D              the cache, each cache row read once (shared by its drafts)
                + tokens·layers·(17d + 6q + 6kv + 6I)   activations: every op reads its input and writes its output once
                + 2·n·O·V )                       logits written, then read by top-1
    flops   = 2·W_active·tokens + 2·d·V·n·O + 4·layers·H·D·n·T·(P + T)
    ms      = max(max(bytes / BW, flops / F) / efficiency, layers · host) + overhead

with W_body the parameters of the transformer blocks and the final norm, q = H·D, kv = Hkv·D,
I the MLP width. A dense model reads and multiplies all of W_body (W_read = W_active = W_body). A
mixture of experts (LLaDA2: E routed experts of W_e parameters in each of its M MoE layers, k a
token) reads the experts its tokens chose, W_read = W_body − M·W_e·(E − U) with U = E·(1 − (1 −
k/E)^tokens) the distinct experts of uniform routing, multiplies k of them per token,
W_active = W_body − M·W_e·(E − k), and moves k experts' (plus the shared ones') activations as I.

A uniform-noise model (DiffusionGemma) makes two kinds of call, both recorded: the encoder over
new columns (causal, over the KV before them) and the decoder over a canvas (over the encoder's
KV, after a denoising step's first call with the previous step's logits as input: + n·T·V
elements read and 2·d·V·n·T FLOPs). Its layers differ (sliding-window layers read at most their
window of the cache; full-attention layers have their own head dim and kv heads): the cache,
activation and attention terms sum over the kinds of layer. Its W_active (`active_params`) is the
dense MLP, k = 8 of E = 128 experts, the router and the attention of each of its 30 layers:
3.10B, + 0.74B of embedding = 3.84B of 25.25B at the 26B-A4B shape.

The three constants were measured on an NVIDIA H200 (2026-11-26,
`python -m bench.profile_call --shape llada-8b|dream-7b --rows 1 16`, docs/gpu.md):

    efficiency  --kernel-efficiency, default 0.43: the call's kernels took 2.2-2.5x the roofline
                (8.0 ms against 3.27 at one row of LLaDA-8B, 17.3 against 7.9 at 16 rows)
    host        --host-ms-per-layer, default 0.87: the eager forward is launch-bound, about 45
                kernels per layer issued from Python (27.9 ms for LLaDA-8B's 32 layers, 24.7 ms
                for Dream-7B's 28, one row); the GPU works while the host issues, so the call
                takes the larger of the two. 0 stands for a call replayed from a CUDA graph
    overhead    --call-overhead-ms, default 1.0: what a replayed call costs beyond its kernels
                (graph replay 9.0 ms against 8.0 of kernels at one row, 18.5 against 17.3 at 16)

The projection before any GPU ran assumed efficiency 1, no host term and 0.5 ms: it put one
LLaDA-8B call at 3.8 ms where the card took 27.9 ms eager and 9.0 ms replayed.

Projected tokens/s of a method = tokens / Σ_calls ms(call). By construction, a plain policy at
batch 1 with no cache runs every call as one row over its prompt's whole canvas, so for one
prompt its projection is tokens / (calls · ms(one row of that canvas)) (tests/test_simulate.py). `--draft-budget auto` decodes with the engine's own budget
(engine/budget.py) given the card's projected cost model (the roofline of a verification call
of n canvases, or the --cost-profile curve): it chooses the nodes it would choose on that card,
from this machine's acceptance.

Output: a table titled "PROJECTION (not a measurement)", printed and written to --out (default
runs/simulate-<time>/): projection.md, projection.csv, projection.json.
"""
from __future__ import annotations

import datetime
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import DecodeConfig, Decoder, InputError, aggregate
from engine.config import check_prompts
from engine.cost import CostModel, read_profile
from engine.frontend import DEFAULT_MODEL_DIR, progress
from models import DTYPES, CheckpointError, ModelConfig, Tokenizer, load_model

from ._common import write_rows
from .eval import method_config, parse_method, spec_label
from .workload import checkpoint_prompts, fit_length, settle_run, shape_config

TITLE = "PROJECTION (not a measurement)"
OVERHEAD_MS = 1.0           # measured: CUDA-graph replay beyond the kernels (see the module docstring)
EFFICIENCY = 0.43           # measured: roofline / the call's kernel time on an H200
HOST_MS_PER_LAYER = 0.87    # measured: the eager forward's host issue time per layer on the H200's host
# the methods projected by default: the policy alone, PSD at a fixed depth, PSD with the draft budget chosen for the card
DEFAULT_METHODS = ["confidence", "psd:policy=confidence,d=3", "psd:policy=confidence,d=3,draft_budget=auto"]


@dataclass(frozen=True)
class Card:
    label: str
    hbm_gbps: float          # GB/s (1e9 bytes per second)
    bf16_tflops: float       # dense (no sparsity), 1e12 FLOP/s
    source: str


# Vendor datasheets; bf16 figures are dense (the datasheets' "with sparsity" figures halved).
CARDS: dict[str, Card] = {
    "h100-sxm": Card("NVIDIA H100 SXM5 80GB", 3350, 989, "NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3, "
                     "1,979 TFLOPS bf16 with sparsity"),
    "h100-pcie": Card("NVIDIA H100 PCIe 80GB", 2000, 756, "NVIDIA H100 datasheet: 2 TB/s HBM2e, 1,513 TFLOPS bf16 "
                      "with sparsity"),
    "h100-nvl": Card("NVIDIA H100 NVL 94GB", 3900, 835, "NVIDIA H100 datasheet: 3.9 TB/s HBM3, 1,671 TFLOPS bf16 "
                     "with sparsity"),
    "h200": Card("NVIDIA H200 SXM 141GB", 4800, 989, "NVIDIA H200 datasheet: 4.8 TB/s HBM3e, 1,979 TFLOPS bf16 "
                 "with sparsity"),
    "a100-80g": Card("NVIDIA A100 SXM4 80GB", 2039, 312, "NVIDIA A100 datasheet: 2,039 GB/s HBM2e, 312 TFLOPS bf16 "
                     "dense (624 with sparsity)"),
    "a100-40g": Card("NVIDIA A100 SXM4 40GB", 1555, 312, "NVIDIA A100 datasheet: 1,555 GB/s HBM2, 312 TFLOPS bf16 "
                     "dense"),
}


# a family's name alone is its flagship: the SXM H100 (HGX/DGX, the one papers report) and the 80 GB A100
ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "a100": "a100-80g", "a100-80gb": "a100-80g",
           "a100-40gb": "a100-40g", "h200-sxm": "h200"}


def card_key(name: str) -> str:
    """The CARDS key of a card as people write it: any case, spaces or underscores for dashes, with
    or without NVIDIA's prefix, or an alias (H100 -> h100-sxm)."""
    key = "-".join(name.lower().replace("_", " ").split()).removeprefix("nvidia-")
    key = ALIASES.get(key, key)
    if key not in CARDS:
        raise InputError(f"unknown card {name!r} for --simulate; expected one of {', '.join(CARDS)} "
                         f"(or {', '.join(ALIASES)}; any case)")
    return key


def card(name: str) -> Card:
    return CARDS[card_key(name)]


@dataclass(frozen=True)
class Call:
    """One model call: n rows of T query positions over P cached positions of C cache rows,
    logits for O positions per row."""

    rows: int
    tokens: int
    cached: int = 0
    cache_rows: int = 0
    out: int = 0
    self_cond: bool = False     # a uniform-noise decoder call: the previous step's logits [n, T, V] as an input


# ---------------------------------------------------------------------- the roofline
def roofline_ms(bytes_moved: float, flops: float, c: Card, overhead_ms: float = OVERHEAD_MS,
                efficiency: float = 1.0, host_ms: float = 0.0) -> float:
    """max(max(bytes / bandwidth, flops / peak) / efficiency, host_ms) + overhead, in milliseconds
    (the defaults of `efficiency` and `host_ms` give the plain roofline)."""
    kernels = max(bytes_moved / (c.hbm_gbps * 1e9), flops / (c.bf16_tflops * 1e12)) * 1e3 / efficiency
    return max(kernels, host_ms) + overhead_ms


def body_params(mc) -> int:
    """Parameters of the transformer blocks and the final norm (every routed expert counted)."""
    return mc.parameter_count() - mc.vocab_size * mc.hidden_size * (1 if mc.tie_embeddings else 2)


def expert_params(mc) -> int:
    """One routed expert's weights (gate, up, down), 0 for a dense model."""
    return 3 * mc.hidden_size * mc.moe_intermediate_size if mc.num_experts else 0


def active_params(mc) -> int:
    """Parameters one token multiplies in the transformer blocks (`body_params`): on a mixture of
    experts its k routed experts of E in every MoE layer, with the shared experts and (softmax
    router, DiffusionGemma) the dense MLP beside them, the router and the attention; the LM head
    (V·d) is counted apart, per logit position."""
    return body_params(mc) - (mc.num_experts - mc.num_experts_per_tok) * mc.moe_layers() * expert_params(mc)


def _attention_kinds(mc) -> list[tuple[int, object]]:
    """(layers, `LayerAttention`) per kind of layer: one kind for most families; DiffusionGemma's
    sliding-window and full-attention layers differ in window, head dim and kv heads."""
    if not mc.layer_types:
        return [(mc.num_layers, mc.layer(0))]
    return [(mc.layer_types.count(t), mc.layer(mc.layer_types.index(t))) for t in dict.fromkeys(mc.layer_types)]


def _seen(a, cached: int) -> int:
    """Cached positions a query of a layer of attention shape `a` reads (its window bounds them)."""
    return cached if a.window is None else min(cached, a.window)


def experts_used(mc, tokens: int) -> float:
    """Routed experts one MoE layer reads for `tokens` tokens: E·(1 − (1 − k/E)^tokens), the
    expected number of distinct experts under uniform routing (docs/kernel_moe.md)."""
    if not mc.num_experts:
        return 0.0
    E, k = mc.num_experts, mc.num_experts_per_tok
    return E * (1 - (1 - k / E) ** tokens)


def _mlp_width(mc) -> float:
    """MLP activations a token moves per layer, averaged over the layers: the dense width, or on a
    MoE layer its k experts and the shared experts (plus the dense MLP beside them under a softmax router)."""
    n_moe = mc.moe_layers()
    routed = mc.num_experts_per_tok * mc.moe_intermediate_size + mc.shared_intermediate_size
    if mc.moe_router == "softmax":
        routed += mc.intermediate_size
    return ((mc.num_layers - n_moe) * mc.intermediate_size + n_moe * routed) / mc.num_layers


def call_bytes(mc, call: Call, elem: int) -> float:
    d, L, V = mc.hidden_size, mc.num_layers, mc.vocab_size
    kinds = _attention_kinds(mc)
    q = sum(n * mc.num_heads * a.head_dim for n, a in kinds) / L        # widths averaged over the layers
    kv = sum(n * a.kv_heads * a.head_dim for n, a in kinds) / L
    tokens = call.rows * call.tokens
    routed = mc.moe_layers() * expert_params(mc)           # one expert in every MoE layer
    weights = body_params(mc) - mc.num_experts * routed + experts_used(mc, tokens) * routed
    cache = call.cache_rows * sum(n * _seen(a, call.cached) * 2 * a.kv_heads * a.head_dim for n, a in kinds)
    self_cond = tokens * V if call.self_cond else 0         # the previous step's logits, read once
    return elem * (weights + V * d + tokens * d + cache + self_cond
                   + tokens * L * (17 * d + 6 * q + 6 * kv + 6 * _mlp_width(mc)) + 2 * call.rows * call.out * V)


def call_flops(mc, call: Call) -> float:
    tokens = call.rows * call.tokens
    attn = sum(4 * n * mc.num_heads * a.head_dim * call.rows * call.tokens * (_seen(a, call.cached) + call.tokens)
               for n, a in _attention_kinds(mc))
    self_cond = 2 * mc.hidden_size * mc.vocab_size * tokens if call.self_cond else 0    # soft embeddings of it
    return 2 * active_params(mc) * tokens + 2 * mc.hidden_size * mc.vocab_size * call.rows * call.out + attn \
        + self_cond


def call_ms(mc, call: Call, c: Card, elem: int = 2, overhead_ms: float = OVERHEAD_MS, efficiency: float = 1.0,
            host_ms_per_layer: float = 0.0) -> float:
    return roofline_ms(call_bytes(mc, call, elem), call_flops(mc, call), c, overhead_ms, efficiency,
                       host_ms_per_layer * mc.num_layers)


def bandwidth_bound(mc, call: Call, c: Card, elem: int = 2) -> bool:
    return call_bytes(mc, call, elem) / (c.hbm_gbps * 1e9) >= call_flops(mc, call) / (c.bf16_tflops * 1e12)


def verification_call(cache: str, mc_acc, prompt_width: int, gen_length: int, block_length: int, rows: int,
                      cache_rows: int) -> Call:
    """The typical verification call of a decode (mid-generation block): what the budget plans with."""
    N = prompt_width + gen_length
    lo = prompt_width + (gen_length // block_length // 2) * block_length
    shift = mc_acc.logit_shift
    if cache == "none":
        return Call(rows, N, 0, 0, block_length)
    bidir = mc_acc.attention == "bidirectional"
    if cache == "prefix":
        return Call(rows, (N if bidir else lo + block_length) - lo + shift, lo - shift, cache_rows, block_length)
    return Call(rows, block_length + shift, (lo - shift) + ((N - lo - block_length) if bidir else 0), cache_rows,
                block_length)


# ---------------------------------------------------------------------- recording calls
class CallTrace:
    """Every forward call of a model as a `Call` (a pre-hook: shapes only, no host sync)."""

    def __init__(self, model):
        self.calls: list[Call] = []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        ids = args[0] if args else kwargs["ids"]
        cache = kwargs.get("cache", args[3] if len(args) > 3 else None)      # engine/uniform.py passes it in place
        R, T = ids.shape
        start = kwargs.get("out_start", 0)
        out = kwargs.get("out_len")
        self.calls.append(Call(R, T, 0 if cache is None else cache.length,
                               0 if cache is None else cache.key_mask.shape[0], T - start if out is None else out,
                               kwargs.get("self_cond") is not None))

    def remove(self) -> None:
        self.handle.remove()


# ---------------------------------------------------------------------- the projection
def project(calls: list[Call], cost) -> float:
    """Milliseconds of a decode: the sum of its calls' costs."""
    return sum(cost(c) for c in calls)


def _budget_cost(cost, cache, mc_acc, prompt_width, gen_length, block_length, batch, nodes) -> CostModel:
    counts = sorted({n for n in range(1, batch * nodes + 1)})
    return CostModel(counts, [cost(verification_call(cache, mc_acc, prompt_width, gen_length, block_length, n, batch))
                              for n in counts], "projected")


def decodes(specs, cards: list[str], prompts: int, batch: int, mc=None, **run) -> int:
    """Batches `simulate` decodes (`run`: gen_length, block_length, cache; `mc`: the model's config,
    if known): every spec once, one with `draft_budget=auto` once per card (it chooses for the card)."""
    auto = [method_config(name, opts, mc, **run).draft_budget == "auto" for name, opts in specs]
    once = {(name, json.dumps(opts, sort_keys=True, default=str)) for (name, opts), a in zip(specs, auto) if not a}
    return (len(once) + sum(auto) * len(cards)) * math.ceil(prompts / batch)


def simulate(model, specs, prompts, cards: list[str], target, cache: str, batch: int, gen_length: int,
             block_length: int, elem: int, overhead_ms: float, profile=None, bar=None, efficiency: float = 1.0,
             host_ms_per_layer: float = 0.0) -> list[dict]:
    """Decode `prompts` with every method spec (name, opts) on this machine, recording every call,
    and project each method's tokens/s on every card. `target`: the ModelConfig the roofline
    costs; `profile`: a cost-profile path used instead of the roofline; `bar`: a progress bar
    told of every decoded batch (`decodes` counts them)."""
    mc_acc = model.config
    width = max(len(p) for p in prompts)
    batches = [prompts[i:i + batch] for i in range(0, len(prompts), batch)]
    label = "encoder" if cache is None else cache          # a uniform-noise model: its encoder's cache
    setting = {"cache": label, "batch": batch, "prompts": len(prompts), "gen_length": gen_length,
               "block_length": block_length}
    rows, decoded = [], {}
    for name in cards:
        c = card(name)
        if profile is not None:
            curves = read_profile(profile)
            cm = CostModel.from_profile(profile, label, block_length, width, curves)

            def cost(call, cm=cm):
                return cm.ms(call.rows)
        else:
            def cost(call, c=c):
                return call_ms(target, call, c, elem, overhead_ms, efficiency, host_ms_per_layer)
        base_tps = None
        for mname, opts in specs:
            cfg = method_config(mname, opts, mc_acc, gen_length=gen_length, block_length=block_length, cache=cache)
            auto = cfg.draft_budget == "auto"
            key = (mname, json.dumps(opts, sort_keys=True, default=str))
            if auto or key not in decoded:          # auto chooses per card: decoded again on every card
                budget_cm = (_budget_cost(cost, cache, mc_acc, width, gen_length, block_length, batch,
                                          len(cfg.draft_graph())) if auto else None)
                got = _decode_recorded(model, cfg, budget_cm, batches, bar)
                if not auto:
                    decoded[key] = got
            else:
                got = decoded[key]
            row = _projected_row(name, c, cfg, opts, got, cost, target, elem, profile, setting)
            if cfg.spec.graph is None and base_tps is None:
                base_tps = row["projected_tokens_per_s"]
            rows.append(row)
        for r in rows:
            if r["card"] == name:
                r["vs_policy"] = r["projected_tokens_per_s"] / base_tps if base_tps else None
    return rows


def _decode_recorded(model, cfg, budget_cm, batches, bar) -> tuple[dict, list[Call], list | None]:
    """(aggregate of the results, every model call, the draft budgets chosen or None) of decoding
    every batch with `cfg`; `bar` is told of every batch."""
    trace = CallTrace(model)
    try:
        dec = Decoder(model, cfg, cost_model=budget_cm)
        results = []
        for b in batches:
            results += dec.generate(b)
            if bar is not None:
                bar.update(1)
    finally:
        trace.remove()
    return aggregate(results), trace.calls, dec.budget.chosen if dec.budget is not None else None


def _projected_row(name: str, c, cfg, opts, got, cost, target, elem: int, profile, setting: dict) -> dict:
    """One method's row on one card: what was measured here and the projected time of its calls."""
    agg, calls, chosen = got
    ms = project(calls, cost)
    tps = agg["tokens"] / (ms / 1e3)
    return {
        "card": name, "card_label": c.label, "hbm_gbps": c.hbm_gbps, "bf16_tflops": c.bf16_tflops,
        "cost": "profile" if profile is not None else "roofline", "method": spec_label(cfg, opts),
        **setting, "tokens": agg["tokens"], "calls": len(calls),
        "rows_per_call": sum(x.rows for x in calls) / max(len(calls), 1), "tpf": agg["tpf"],
        "projected_ms_per_call": ms / max(len(calls), 1), "projected_ms": ms,
        "projected_tokens_per_s": tps,
        "bandwidth_bound_share": (None if profile is not None else
                                  sum(bandwidth_bound(target, x, c, elem) for x in calls) / max(len(calls), 1)),
        "budget_nodes_median": statistics.median(chosen) if chosen else None,
        "draft_nodes": json.dumps(agg["draft_nodes"]), "accepted_depth": json.dumps(agg["accepted_depth"]),
    }


def markdown(rows: list[dict], header: str) -> str:
    L = [f"## {TITLE}", "", header, "",
         "| card | cache | batch | method | tokens | calls | rows/call | TPF | proj. ms/call | proj. tokens/s | "
         "vs policy | BW-bound calls | budget nodes |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        bw = "-" if r["bandwidth_bound_share"] is None else f"{100 * r['bandwidth_bound_share']:.0f}%"
        nodes = "-" if r["budget_nodes_median"] is None else f"{r['budget_nodes_median']:g}"
        vs = "-" if r.get("vs_policy") is None else f"{r['vs_policy']:.2f}x"
        L.append(f"| {r['card']} | {r['cache']} | {r['batch']} | {r['method']} | {r['tokens']} | {r['calls']} | "
                 f"{r['rows_per_call']:.2f} | {r['tpf']:.2f} | {r['projected_ms_per_call']:.2f} | "
                 f"{r['projected_tokens_per_s']:.0f} | {vs} | {bw} | {nodes} |")
    L += ["", f"*{TITLE}: tokens, calls, rows and TPF were measured by decoding on this machine with the "
              f"acceptance model; ms and tokens/s are computed, not timed on the card.*"]
    return "\n".join(L)


def run(args, command: str, stamp_versions: dict, device: torch.device, dev_name: str) -> int:
    """The --simulate mode of bench.speed (args: its parsed command line)."""
    cards = list(dict.fromkeys(card_key(name) for name in args.simulate))
    overhead, eff, host = _roofline_settings(args)
    model_dir = Path(args.model or DEFAULT_MODEL_DIR)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist or is not a directory")
    mc_acc = ModelConfig.from_dir(model_dir)
    settle_run(args, mc_acc)                 # a uniform-noise model: its canvas length, its encoder's cache
    target, target_name = (shape_config(args.shape), args.shape) if args.shape else (mc_acc, str(model_dir))
    check_target(mc_acc, model_dir, target, target_name)
    specs = [parse_method(s) for s in (args.methods or (["eb"] if mc_acc.mask_token_id is None else DEFAULT_METHODS))]
    if args.cost_profile:
        read_profile(args.cost_profile)                  # checked before anything is decoded
    prompts, source = _checked_prompts(args, Tokenizer(model_dir), mc_acc, specs)
    out = Path(args.out) if args.out else Path("runs") / f"simulate-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    out.mkdir(parents=True, exist_ok=True)
    model = load_model(model_dir, dtype=args.dtype, device=str(device))
    elem = torch.empty((), dtype=DTYPES[args.dtype]).element_size()
    t0 = time.perf_counter()
    rows = []
    runs = [(gl, cache, b) for gl in args.gen_length for cache in args.cache for b in args.batch_sizes]
    total = sum(decodes(specs, cards, len(prompts), b, mc_acc, gen_length=gl, block_length=args.block_length,
                        cache=cache) for gl, cache, b in runs)
    with progress(total, "simulate: decoded batches", args.quiet) as bar:
        for gl, cache, b in runs:
            rows += simulate(model, specs, prompts, cards, target, cache, b, gl, args.block_length, elem,
                             overhead, args.cost_profile, bar, eff, host)
    seconds = time.perf_counter() - t0
    cost_text = (f"measured cost curve {args.cost_profile} (ms of a call of n canvases)" if args.cost_profile else
                 f"roofline at the {target_name} shape ({target.parameter_count() / 1e9:.2f}B parameters, "
                 f"{args.dtype}, {elem} bytes per element) at {eff:g} efficiency, the larger of that and "
                 f"{host:g} ms of host issue per layer, + {overhead:g} ms per call")
    card_text = "; ".join(f"{k}: {CARDS[k].label}, {CARDS[k].hbm_gbps:g} GB/s, {CARDS[k].bf16_tflops:g} TFLOP/s "
                          f"dense bf16 ({CARDS[k].source})" for k in cards)
    header = (f"**{TITLE}.** Cost of each call: {cost_text}. Cards: {card_text}.\n\n"
              f"Calls and acceptance: measured by decoding {len(prompts)} {source} prompts with {model_dir} "
              f"({mc_acc.parameter_count() / 1e6:.1f}M parameters, {args.dtype}) on {dev_name}, gen length "
              f"{', '.join(map(str, args.gen_length))}, block {args.block_length} ({seconds:.0f} s). Its acceptance "
              f"is that model's, not the target's.\n\ncommand: `{command}`")
    summary = {"bench": "speed", "mode": "simulate", "projection": TITLE, "out_dir": str(out), "cards":
               {k: asdict(CARDS[k]) for k in cards}, "cost": cost_text, "acceptance_model": str(model_dir),
               "acceptance_device": dev_name, **stamp_versions, "command": command,
               "markdown": str(out / "projection.md"), "csv": str(out / "projection.csv"),
               "json": str(out / "projection.json")}
    return _write_projection(out, rows, header, summary, stamp_versions)


def check_target(mc_acc, model_dir, target, target_name: str) -> None:
    """The acceptance model decodes the calls the target's roofline costs, so both diffuse alike: a
    uniform-noise target (DiffusionGemma) needs a uniform-noise acceptance model of its canvas
    length (its calls are canvases of that length), a masked target a masked one; else one error line."""
    uniform, want = mc_acc.mask_token_id is None, target.mask_token_id is None
    if uniform != want:
        kind = "a uniform-noise (diffusion_gemma)" if want else "a masked"
        raise InputError(f"--shape {target_name} is {kind} model; its calls are projected from decoding {kind} "
                         f"acceptance model, and {model_dir} is a {mc_acc.family} model (give --model DIR)")
    C, C_target = mc_acc.generation_defaults.get("block_length"), target.generation_defaults.get("block_length")
    if uniform and C != C_target:
        raise InputError(f"--shape {target_name} decodes canvases of {C_target}; the acceptance model {model_dir} "
                         f"decodes canvases of {C} (its calls are costed as they are): give a {target.family} "
                         f"checkpoint of canvas_length {C_target}")


def _roofline_settings(args) -> tuple[float, float, float]:
    """(call overhead ms, kernel efficiency, host ms per layer) of the roofline, each checked; the
    three apply to the roofline only, not to a measured --cost-profile."""
    if args.cost_curve:
        raise InputError("--simulate projects from a roofline or --cost-profile; it does not combine with --cost-curve")
    if args.overhead_ms is not None and (not math.isfinite(args.overhead_ms) or args.overhead_ms < 0):
        raise InputError(f"--call-overhead-ms must be finite and >= 0, got {args.overhead_ms}")
    overhead = OVERHEAD_MS if args.overhead_ms is None else args.overhead_ms
    if args.overhead_ms is not None and args.cost_profile:
        raise InputError("--call-overhead-ms applies to the roofline, not to a measured --cost-profile")
    eff = EFFICIENCY if args.kernel_efficiency is None else args.kernel_efficiency
    if not (math.isfinite(eff) and 0 < eff <= 1):
        raise InputError(f"--kernel-efficiency must be in (0, 1], got {eff}")
    host = HOST_MS_PER_LAYER if args.host_ms_per_layer is None else args.host_ms_per_layer
    if not (math.isfinite(host) and host >= 0):
        raise InputError(f"--host-ms-per-layer must be finite and >= 0, got {host}")
    if args.cost_profile and (args.kernel_efficiency is not None or args.host_ms_per_layer is not None):
        raise InputError("--kernel-efficiency and --host-ms-per-layer apply to the roofline, not to a measured "
                         "--cost-profile")
    return overhead, eff, host


def _checked_prompts(args, tok, mc_acc, specs) -> tuple[list, str]:
    """(the checkpoint's first --num-prompts prompts fitted to --prompt-length, where they come
    from); the prompts and every method spec checked at every gen length and cache mode."""
    n = (args.num_prompts or [8])[0]
    prompts, source = checkpoint_prompts(args, tok, n)
    prompts = fit_length(prompts, (args.prompt_length or [None])[0])
    uniform = mc_acc.mask_token_id is None
    for gl in args.gen_length:
        if not uniform:
            check_prompts(mc_acc, DecodeConfig(gen_length=gl, block_length=args.block_length), prompts)
        for cache in args.cache:
            for name, opts in specs:
                cfg = method_config(name, opts, mc_acc, gen_length=gl, block_length=args.block_length, cache=cache)
        if uniform:                             # its gen length: whole canvases
            check_prompts(mc_acc, cfg, prompts)
    return prompts, source


def _write_projection(out: Path, rows: list[dict], header: str, summary: dict, stamp_versions: dict) -> int:
    """projection.md, .csv and .json under `out`; the table and one JSON line printed."""
    md = markdown(rows, header)
    (out / "projection.md").write_text(md + "\n", encoding="utf-8")
    stamp = {"projection": TITLE, "acceptance_device": summary["acceptance_device"], **stamp_versions,
             "command": summary["command"], "date": datetime.datetime.now().isoformat(timespec="seconds")}
    write_rows(out / "projection.csv", rows, stamp)
    (out / "projection.json").write_text(json.dumps({**summary, "rows": rows}, indent=1) + "\n", encoding="utf-8")
    print(md)
    print(json.dumps({**summary, "rows": [{k: r[k] for k in ("card", "method", "cache", "batch", "tokens", "calls",
                                                              "tpf", "projected_tokens_per_s", "vs_policy")}
                                          for r in rows]}))
    return 0
