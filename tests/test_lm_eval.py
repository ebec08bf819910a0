"""The lm-evaluation-harness adapter (bench/lm_eval.py), offline on the shipped model.

Tasks are tests/data/lm_eval/*.yaml over a local JSONL (six problems of the math suite), rendered
into tmp_path with an absolute data path. Generations through lm-eval must equal the engine's
for the same prompts and options (cut at max_gen_toks tokens, then at the first stop sequence);
every decoding option must reach the DecodeConfig; the log-likelihood estimate is checked
against its exact expectation.
"""
from __future__ import annotations

import itertools
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# no hub (the json loader needs none; a hub lookup would hang on a machine without a route)
for _var in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")

pytest.importorskip("lm_eval")

import torch  # noqa: E402

from engine import DecodeConfig, Decoder, DraftGraph, InputError  # noqa: E402
from engine import generate as engine_generate  # noqa: E402
from models import Tokenizer  # noqa: E402

from bench import lm_eval as adapter  # noqa: E402
from bench.lm_eval import PsdLM, cut_at_stop, decode_options  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data" / "lm_eval"
MODEL = REPO / "models" / "default"
GRAPH = MODEL / "graph_greedy_d4_n8.json"
TASK = "psd_math_local"
CHOICE_TASK = "psd_math_choice_local"
UNTIL = ("Question:", " ####")   # as in psd_math.yaml
MAX_GEN_TOKS = 40
# non-default options: dropping any of them on the way changes the calls (checked below)
OPTS = dict(method="psd", threshold=0.7, depth=2, cache="dual", block_length=16)


def _docs() -> list[dict]:
    return [json.loads(line) for line in (DATA / "psd_math.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory) -> Path:
    """The task YAMLs with the data path made absolute (works from any cwd, any clone)."""
    d = tmp_path_factory.mktemp("lm_eval_tasks")
    for y in DATA.glob("*.yaml"):
        text = y.read_text(encoding="utf-8")
        assert "tests/data/lm_eval/psd_math.jsonl" in text
        (d / y.name).write_text(text.replace("tests/data/lm_eval/psd_math.jsonl", str(DATA / "psd_math.jsonl")),
                                encoding="utf-8")
    return d


def _evaluate(tasks_dir: Path, tasks: list[str], model_args, limit=None) -> dict:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    return simple_evaluate(model="psd", model_args=model_args, tasks=tasks, limit=limit, log_samples=True,
                           task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False),
                           bootstrap_iters=0)


# ---------------------------------------------------------------------- registration and options
def test_the_psd_model_is_registered():
    from lm_eval.api.model import LM
    from lm_eval.api.registry import get_model

    assert get_model("psd") is PsdLM and issubclass(PsdLM, LM)


def _given(cfg: DecodeConfig, expected: dict) -> None:
    for name, value in expected.items():
        got = getattr(cfg, name)
        if isinstance(value, DraftGraph):
            assert got.nodes == value.nodes, name
        else:
            assert got == value and type(got) is type(value), (name, got, value)


@pytest.mark.parametrize("arg_string, expected", [
    ("method=psd,policy=localleap,threshold=0.8,kappa=0.85,window=2,depth=2,acceptance=exact,cache=prefix,"
     "score=margin,temperature=0.5,seed=7,conf_dtype=float64,gen_length=64,block_length=16",
     dict(method="psd", policy_name="localleap", threshold=0.8, kappa=0.85, window=2, depth=2, acceptance="exact",
          cache="prefix", score="margin", temperature=0.5, seed=7, conf_dtype="float64", gen_length=64,
          block_length=16)),
    ("method=topk,steps=8,gen_length=64,block_length=16,cache=dual,threshold=None",
     dict(method="topk", steps=8, gen_length=64, block_length=16, cache="dual")),
    ("method=lopa,k=2,threshold=1", dict(method="lopa", k=2, threshold=1.0, block_length=32)),
    (f"method=psd,graph={GRAPH}", dict(method="psd", graph=DraftGraph.load(GRAPH))),
])
def test_every_option_reaches_the_decode_config(arg_string, expected):
    lm = PsdLM.create_from_arg_string(arg_string)
    gen_length = expected.get("gen_length", 64)
    cfg = lm.decode_config(gen_length)
    _given(cfg, expected)
    if "graph" not in expected:    # DraftGraph has no value equality
        assert cfg == DecodeConfig(**{**expected, "gen_length": gen_length}).validate()
    # the same through a dict (lm-eval's --model_args JSON form / simple_evaluate with a dict)
    typed = {("policy" if k == "policy_name" else k): v for k, v in expected.items()}
    _given(PsdLM.create_from_arg_obj(typed).decode_config(gen_length), expected)


def test_every_engine_option_is_a_model_arg_with_its_type():
    """Derived from the engine: each option's default, given as the string lm-eval would pass,
    comes back with its declared type."""
    opts = decode_options()
    defaults = DecodeConfig()
    assert {"method", "threshold", "cache", "depth", "policy", "policy_name", "k", "graph"} <= set(opts)
    for key, o in opts.items():
        value = getattr(defaults, o.name)
        if value is None or o.kind is DraftGraph:
            continue
        parsed = adapter._PARSERS[o.kind](key, str(value))
        assert parsed == value and type(parsed) is type(value), key


def test_lm_evals_batch_size_and_device_are_fallbacks():
    lm = PsdLM.create_from_arg_obj({"batch_size": 3}, {"batch_size": 1, "device": "cuda:0", "max_batch_size": None})
    assert lm.batch_size == 3 and lm.device.type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert PsdLM.create_from_arg_string("", {"batch_size": "2", "device": "cpu"}).batch_size == 2
    with pytest.raises(InputError, match="auto"):
        PsdLM.create_from_arg_string("", {"batch_size": "auto"})


@pytest.mark.parametrize("arg_string, message", [
    ("method=psd,bogus=1", r"unknown model_arg 'bogus'.*valid: .*batch_size.*mc_num.*threshold"),
    ("threshold=abc,method=confidence", r"threshold='abc': expected a number"),
    ("method=confidence,cache=sometimes", r"cache mode 'sometimes'"),
    ("method=warp", r"unknown method 'warp'"),
    ("gen_length=40,block_length=16", r"not a multiple of the block length"),
    ("truncate=middle", r"truncate='middle'"),
    ("method=psd,graph=/nonexistent/graph.json", r"graph.json"),
])
def test_bad_model_args_are_clear_errors(arg_string, message):
    with pytest.raises(InputError, match=message):
        PsdLM.create_from_arg_string(arg_string)


def _with_template(dst: Path, template: str) -> Path:
    """The shipped checkpoint (linked) with a chat template."""
    dst.mkdir()
    for f in MODEL.iterdir():
        if f.name != "tokenizer_config.json":
            (dst / f.name).symlink_to(f)
    cfg = json.loads((MODEL / "tokenizer_config.json").read_text(encoding="utf-8"))
    cfg["chat_template"] = template
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    return dst


def test_chat_wraps_each_context(tmp_path):
    with pytest.raises(Exception, match="chat_template"):
        PsdLM(chat=True)                          # the shipped checkpoint has no template
    ckpt = _with_template(tmp_path / "ckpt", "{% for m in messages %}User: {{ m['content'] }}\n{% endfor %}Assistant:")
    lm = PsdLM(model=str(ckpt), chat="true")
    assert lm.chat is True
    assert lm._context_ids("Question: 1 + 1?") == lm.tok.encode("User: Question: 1 + 1?\nAssistant:")


ROLES = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
         "{% if add_generation_prompt %}<assistant>{% endif %}")


def test_lm_evals_apply_chat_template_renders_each_shot_as_a_turn(tmp_path, tasks_dir):
    """lm-eval's --apply_chat_template --fewshot_as_multiturn: lm-eval renders each request's turns
    (two shots: two user/assistant pairs, then the question with the assistant's turn opened) through
    the checkpoint's template, and the adapter decodes that context encoded as chat=true encodes (no
    special tokens of the tokenizer's own). Refused in one line: together with chat=true, a template
    name, a checkpoint without a template."""
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    ckpt = _with_template(tmp_path / "ckpt", ROLES)
    lm = PsdLM(model=str(ckpt), method="confidence", threshold=0.9, block_length=8)
    out = simple_evaluate(model=lm, tasks=[TASK], limit=1, num_fewshot=2, apply_chat_template=True,
                          fewshot_as_multiturn=True, log_samples=True, bootstrap_iters=0,
                          task_manager=TaskManager(include_path=str(tasks_dir), include_defaults=False))
    (sample,) = out["samples"][TASK]
    context, gen_kwargs = sample["arguments"][0]
    assert context.count("<user>") == 3 and context.count("<assistant>") == 3 and context.endswith("<assistant>")
    G = gen_kwargs["max_gen_toks"]
    r = engine_generate(lm.model, [lm.tok.encode(context, special=False)], method="confidence", threshold=0.9,
                        block_length=8, gen_length=math.ceil(G / 8) * 8)[0]
    assert sample["resps"][0][0] == cut_at_stop(lm.tok.decode(r.token_ids[:G]), gen_kwargs["until"])
    assert lm.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                                  add_generation_prompt=False) == "<user>q\n<assistant>a\n"
    with pytest.raises(InputError, match="chat=true and --apply_chat_template would both apply"):
        PsdLM(model=str(ckpt), chat="true").chat_template(True)
    with pytest.raises(InputError, match="renders the checkpoint's default chat template only"):
        lm.chat_template("tool_use")
    with pytest.raises(Exception, match="--apply_chat_template needs a chat_template"):
        PsdLM().chat_template(True)


def test_cut_at_stop():
    assert cut_at_stop("a = 1. b #### 2 Question: x", UNTIL) == "a = 1. b"
    assert cut_at_stop("Question: x #### 2", UNTIL) == ""
    assert cut_at_stop("no stop here", UNTIL) == "no stop here"
    assert cut_at_stop("x", ("", "y")) == "x"


# ---------------------------------------------------------------------- generate_until
def _engine_texts(prompts: list[str], **options):
    """What the adapter must produce: engine.generate on the prompts (one batch, in order; the
    adapter batches by length, batch_size at a time: a sequence's tokens do not depend on its
    batch), gen_length = max_gen_toks rounded up to the block, the text of the first max_gen_toks
    tokens cut at the first stop sequence."""
    tok = Tokenizer(MODEL)
    lm = PsdLM(**options)          # the shipped model, loaded as the adapter does
    G = math.ceil(MAX_GEN_TOKS / options["block_length"]) * options["block_length"]
    results = engine_generate(lm.model, [tok.encode(p) for p in prompts], **options, gen_length=G)
    raw = [tok.decode(r.token_ids[:MAX_GEN_TOKS]) for r in results]
    return results, raw, [cut_at_stop(t, UNTIL) for t in raw]


@pytest.mark.slow
def test_generations_equal_the_engines(tasks_dir):
    out = _evaluate(tasks_dir, [TASK], {**OPTS, "batch_size": 2})
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    docs = _docs()
    assert len(samples) == len(docs)
    prompts = [s["arguments"][0][0] for s in samples]          # (context, gen_kwargs) per request
    assert prompts == [f"Question: {d['prompt']}\nAnswer: " for d in docs]
    assert samples[0]["arguments"][0][1] == {"until": list(UNTIL), "max_gen_toks": MAX_GEN_TOKS}
    got = [s["resps"][0][0] for s in samples]

    results, raw, expected = _engine_texts(prompts, **OPTS)
    assert got == expected
    # both cuts happen: a stop sequence inside the kept tokens, and max_gen_toks inside the canvas
    assert any(" ####" in t and g == t[:t.index(" ####")] for t, g in zip(raw, got))
    assert any(len(r.token_ids) > MAX_GEN_TOKS for r in results)
    assert any(" ####" not in t for t in raw)
    # TPF and calls per task, in results["config"]["psd"] (the --output_path JSON)
    stats = out["config"]["psd"]["stats"][TASK]["generate_until"]
    assert stats["requests"] == len(docs)
    assert stats["calls"] == sum(r.calls for r in results)
    assert stats["tokens"] == sum(r.tokens for r in results)
    assert stats["tpf"] == pytest.approx(stats["tokens"] / stats["calls"], abs=1e-4)
    # the options matter: engine defaults (same sizes) take other calls, so a dropped option shows
    plain = _engine_texts(prompts, method="psd", cache="dual", block_length=16)[0]
    assert [r.calls for r in plain] != [r.calls for r in results]


def test_prompt_longer_than_the_window(tasks_dir):
    tok = Tokenizer(MODEL)
    doc = _docs()[0]
    long_prompt = "Question: " + " ".join([doc["prompt"]] * 12) + "\nAnswer: "
    n = len(tok.encode(long_prompt))
    G = math.ceil(MAX_GEN_TOKS / 16) * 16
    assert n + G > 256

    from lm_eval.api.instance import Instance

    req = Instance("generate_until", doc, (long_prompt, {"until": list(UNTIL), "max_gen_toks": MAX_GEN_TOKS}), 0,
                   (TASK, 7, 1))
    with pytest.raises(InputError, match=rf"request 7 of task {TASK}: .*{n} tokens.*truncate=left"):
        PsdLM(**OPTS).generate_until([req], disable_tqdm=True)
    lm = PsdLM(**OPTS, truncate="left")
    got = lm.generate_until([req], disable_tqdm=True)
    kept = tok.encode(long_prompt)[n - (256 - G):]
    cfg = DecodeConfig(**OPTS, gen_length=G).validate()
    r = Decoder(lm.model, cfg).generate([kept])[0]
    assert got == [cut_at_stop(tok.decode(r.token_ids[:MAX_GEN_TOKS]), UNTIL)]
    assert lm.stats_summary()[TASK]["truncated"]["requests"] == 1
    full = Instance("generate_until", doc, (long_prompt, {"until": list(UNTIL), "max_gen_toks": 256}), 0, (TASK, 8, 1))
    with pytest.raises(InputError, match="the generation alone fills the window: shorten it") as e:
        lm.generate_until([full], disable_tqdm=True)          # truncate=left cannot help: not offered again
    assert "truncate=left" not in str(e.value)


def test_explicit_gen_length_is_the_canvas():
    """gen_length in model_args fixes the canvas; max_gen_toks still bounds the kept tokens."""
    from lm_eval.api.instance import Instance

    prompt = f"Question: {_docs()[2]['prompt']}\nAnswer: "
    req = Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 20}), 0, (TASK, 0, 1))
    lm = PsdLM(**OPTS, gen_length=64)
    assert lm._plan({"until": [], "max_gen_toks": 20}) == (64, 20, ())
    assert lm._plan({"until": "Q"}) == (64, 64, ("Q",))
    tok = Tokenizer(MODEL)
    r = Decoder(lm.model, DecodeConfig(**OPTS, gen_length=64).validate()).generate([tok.encode(prompt)])[0]
    assert lm.generate_until([req], disable_tqdm=True) == [tok.decode(r.token_ids[:20])]
    # without it: max_gen_toks rounded up to the block; no max_gen_toks: the checkpoint's gen_length (64)
    lm = PsdLM(**OPTS)
    assert lm._plan({"max_gen_toks": 17}) == (32, 17, ())
    assert lm._plan({"until": ["a", "b"]}) == (64, 64, ("a", "b"))


# ---------------------------------------------------------------------- log-likelihood
CTX = f"Question: {_docs()[0]['prompt']}\nAnswer: {_docs()[0]['answer'].split(' ####')[0]} ####"


def test_single_token_target_is_exact():
    """With one target token every sample masks it with weight 1: the estimate is log p exactly."""
    lm = PsdLM(mc_num=3, batch_size=2)
    prefix = lm.tok.encode(CTX)
    target = lm.tok.encode(" ")
    assert len(target) == 1
    x = torch.tensor([prefix + [lm.mc.mask_token_id]])
    exact = float(lm._target_logp(x, len(prefix))[0, 0, target[0]])
    ll, forwards = lm.elbo(prefix, target, seed=5)
    assert ll == pytest.approx(exact, abs=1e-5) and forwards == 2


@pytest.mark.slow
def test_estimate_converges_to_its_expectation_and_is_seeded():
    """The expectation of the estimator, enumerated over every mask of a 3-token target, is what
    the Monte-Carlo mean approaches as mc_num grows; equal seeds give equal estimates."""
    lm = PsdLM(batch_size=256)
    prefix, target = lm._encode_pair(CTX, " 20")
    T, P = len(target), len(prefix)
    assert T == 3
    seq = torch.tensor(prefix + target)
    exact = 0.0
    for n in range(1, T + 1):
        subsets = list(itertools.combinations(range(T), n))
        for s in subsets:
            x = seq.clone()[None]
            x[0, [P + i for i in s]] = lm.mc.mask_token_id
            logp = lm._target_logp(x, P)[0]
            exact += (1 / T) * (1 / len(subsets)) * (T / n) * sum(float(logp[i, target[i]]) for i in s)
    few = [lm.elbo(prefix, target, mc_num=8, seed=s)[0] for s in range(4)]
    many = lm.elbo(prefix, target, mc_num=1024, seed=0)[0]
    assert abs(many - exact) < 0.3
    assert sum(abs(f - exact) for f in few) / len(few) > abs(many - exact)
    assert lm.elbo(prefix, target, mc_num=8, seed=1)[0] == few[1]
    assert len(set(few)) > 1


def test_loglikelihood_through_lm_eval(tasks_dir):
    out = _evaluate(tasks_dir, [CHOICE_TASK], {"mc_num": 4, "batch_size": 4, "seed": 3}, limit=2)
    assert "acc,none" in out["results"][CHOICE_TASK]
    samples = out["samples"][CHOICE_TASK]
    from lm_eval.api.instance import Instance

    lm = PsdLM(mc_num=4, batch_size=4, seed=3)
    for s in samples:
        args = [tuple(a) for a in s["arguments"]]                  # (context, continuation) per choice
        reqs = [Instance("loglikelihood", s["doc"], a, i, (CHOICE_TASK, s["doc_id"], 1)) for i, a in enumerate(args)]
        again = lm.loglikelihood(reqs, disable_tqdm=True)      # per-request seeds: order and batch do not matter
        assert [tuple(r[0]) for r in s["resps"]] == [(pytest.approx(ll), g) for ll, g in again]
    stats = out["config"]["psd"]["stats"][CHOICE_TASK]["loglikelihood"]
    assert stats["requests"] == 4 and stats["calls"] > 4


def test_default_mc_num_warns_what_it_costs_before_the_first_request(caplog, monkeypatch):
    """LLaDA's 128 samples are minutes per request on a CPU: left at the default, one line says so
    (forwards per request, one forward timed here, the estimate) before anything is scored; a
    given mc_num runs without it."""
    from lm_eval.api.instance import Instance

    reqs = [Instance("loglikelihood", {}, (CTX, c), i, ("t", 0, 1)) for i, c in enumerate((" 20", " 21"))]
    rolling = [Instance("loglikelihood_rolling", {}, ("12 + 3 = 15.",), 0, ("t", 0, 1))]
    for mc_num, kind, batch in ((None, "loglikelihood", reqs), (None, "loglikelihood_rolling", rolling),
                                (128, "loglikelihood", reqs)):
        lm = PsdLM(batch_size=4) if mc_num is None else PsdLM(batch_size=4, mc_num=mc_num)
        seen = []
        monkeypatch.setattr(lm, "_score", lambda *a, **k: (seen.append(list(caplog.messages)), (-1.0, False))[1])
        caplog.clear()
        with caplog.at_level("WARNING", logger="bench.lm_eval"):
            getattr(lm, kind)(batch, True)
        warned = [m for m in seen[0] if "mc_num" in m]           # as the first request was scored
        if mc_num is not None:
            assert not warned
            continue
        (line,) = warned
        assert line.startswith(f"{kind}: mc_num is 128 by default")
        assert "each request takes 32 forwards of 4 rows" in line
        assert re.search(r"one such forward took \d+ ms here, so about \d+ (s|min) per request, \d+ (s|min) for "
                         rf"these {len(batch)}; pass mc_num=N in --model_args", line), line


def test_is_greedy_and_rolling():
    from lm_eval.api.instance import Instance

    lm = PsdLM(mc_num=2, batch_size=2)
    prefix = lm.tok.encode(CTX)
    r = Decoder(lm.model, DecodeConfig(gen_length=4, block_length=4).validate()).generate([prefix])[0]
    assert len(r.token_ids) == 4
    assert lm._is_greedy(prefix, r.token_ids) == (True, 4)
    other = list(r.token_ids[:3]) + [next(t for t in range(2, 50) if t != r.token_ids[3])]
    assert lm._is_greedy(prefix, other)[0] is False
    (ll, g), = lm.loglikelihood([Instance("loglikelihood", {}, (CTX, " 99"), 0, ("t", 0, 1))], True)
    assert isinstance(ll, float) and ll < 0 and isinstance(g, bool)
    (ll,) = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("12 + 3 = 15.",), 0, ("t", 0, 1))], True)
    assert isinstance(ll, float) and ll < 0
    with pytest.raises(InputError, match="request 4 of task t: a loglikelihood_rolling target of .* tokens"):
        lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("1 + 2 = 3. " * 60,), 0, ("t", 4, 1))], True)


# ---------------------------------------------------------------------- the newer families
@pytest.fixture(scope="module")
def family_ckpt(tmp_path_factory):
    from models.random_checkpoint import make_checkpoint

    root = tmp_path_factory.mktemp("families")
    return lambda family: make_checkpoint(root / family, family, seed=3)[0] if not (root / family).is_dir() \
        else root / family


def test_llada2_canvas_is_max_gen_toks(family_ckpt):
    """Blocks counted from the sequence's start (LLaDA2, --align auto) take any gen length: the canvas
    is max_gen_toks itself, not rounded up to the block, which would decode (and count) blocks past
    it and refuse prompts that fit the window beside max_gen_toks."""
    from lm_eval.api.instance import Instance

    ck = family_ckpt("llada2")
    lm = PsdLM(model=str(ck), block_length=32)
    assert lm._plan({"max_gen_toks": 10}) == (10, 10, ())
    prompt = " ".join(["t5"] * 20)
    ids = lm.tok.encode(prompt)
    req = Instance("generate_until", {}, (prompt, {"until": [], "max_gen_toks": 10}), 0, ("t", 0, 1))
    (text,) = lm.generate_until([req], disable_tqdm=True)
    r = Decoder(lm.model, DecodeConfig(gen_length=10, block_length=32).validate()).generate([ids])[0]
    assert text == lm.tok.decode(r.token_ids[:10])
    assert lm.stats_summary()["t"]["generate_until"]["calls"] == r.calls
    wide = Decoder(lm.model, DecodeConfig(gen_length=32, block_length=32).validate()).generate([ids])[0]
    assert wide.token_ids[:10] == r.token_ids[:10] and wide.calls > r.calls    # what rounding up cost


def test_llada2_loglikelihood_is_per_attention_block(family_ckpt):
    """A block-causal model generates block by block, each block given the clean earlier ones: the
    estimate is one masked-diffusion ELBO per attention block of the target. A 2-token target
    across a block boundary is then two single-token terms, each exact."""
    lm = PsdLM(model=str(family_ckpt("llada2")), mc_num=4, batch_size=2)
    size = lm.mc.attention_block
    prefix = [5 + i % 20 for i in range(2 * size - 1)]          # the target's 2 tokens straddle a boundary
    target = [7, 9]
    m = lm.mc.mask_token_id
    first = float(lm._target_logp(torch.tensor([prefix + [m]]), len(prefix))[0, 0, 7])
    second = float(lm._target_logp(torch.tensor([prefix + [7, m]]), len(prefix) + 1)[0, 0, 9])

    class Req:
        args, task_name, doc_id = ("c", "t"), "t", 0

    ll, _ = lm._score(Req(), prefix, target, "loglikelihood", False)
    assert ll == pytest.approx(first + second, abs=1e-5)


def test_llada2_is_greedy_decodes_block_by_block(family_ckpt):
    """is_greedy on a block-causal model: a target that LLaDA2's own greedy decoding (attention block by
    block) produces is greedy, wherever it starts in a block; decoded as one block over the whole target
    (LLaDA's suffix_greedy_prediction), later blocks were unmasked before earlier ones and it was not."""
    lm = PsdLM(model=str(family_ckpt("llada2")), mc_num=2, batch_size=2)
    size = lm.mc.attention_block
    for P in range(3, 3 + size):
        prefix = [5 + i % 20 for i in range(P)]
        dc = DecodeConfig(method="greedy", gen_length=size + 3, block_length=size).validate()
        r = Decoder(lm.model, dc).generate([prefix])[0]
        assert lm._is_greedy(prefix, list(r.token_ids)) == (True, r.calls), P


def test_uniform_noise_model_refuses_loglikelihood(family_ckpt):
    """DiffusionGemma has no mask token: no masked-diffusion estimate, one clear error, not a TypeError."""
    from lm_eval.api.instance import Instance

    lm = PsdLM(model=str(family_ckpt("diffusion_gemma")), mc_num=2)
    for kind, args in (("loglikelihood", ("t5 t9", " t3")), ("loglikelihood_rolling", ("t5 t9 t3",))):
        with pytest.raises(InputError, match=f"^{kind} is not supported for a diffusion_gemma model: it diffuses "
                                             f"from uniform noise"):
            getattr(lm, kind)([Instance(kind, {}, args, 0, ("t", 0, 1))], True)


# ---------------------------------------------------------------------- the CLI
def _cli(args, tmp_path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "bench.lm_eval", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_runs_lm_evals_own_entry(tasks_dir, tmp_path):
    res = _cli(["--model", "psd", "--model_args", "method=psd,threshold=0.7,depth=2,cache=dual,block_length=16",
                "--tasks", TASK, "--include_path", str(tasks_dir), "--limit", "2", "--device", "cpu",
                "--output_path", str(tmp_path / "out")], tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "exact_match" in res.stdout                                  # lm-eval's own table
    assert f"| {TASK} | generate_until | 2 |" in res.stdout             # then TPF / calls per task
    (results,) = (tmp_path / "out").rglob("results_*.json")
    stats = json.loads(results.read_text(encoding="utf-8"))["config"]["psd"]["stats"][TASK]["generate_until"]
    assert stats["requests"] == 2 and stats["tpf"] > 1



@pytest.mark.slow
def test_lm_evals_own_command_cannot_load_psd_as_the_docs_say(tasks_dir, tmp_path):
    """`lm_eval --model psd` cannot work: lm-eval's command imports nothing of ours and reads no
    plugin or entry point to find a model. docs/lm_eval.md quotes its error and says what to run."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "psd", "--tasks", TASK, "--include_path",
                          str(tasks_dir), "--limit", "1"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=600)
    said = "Attempted to load model 'psd', but no model for this name found!"
    assert res.returncode != 0 and said in res.stderr, res.stderr[-3000:]
    import lm_eval

    harness = Path(lm_eval.__file__).parent
    for f in [harness / "__main__.py", harness / "evaluator.py", harness / "models" / "__init__.py",
              *(harness / "api").glob("*.py"), *(harness / "_cli").glob("*.py")]:
        assert "entry_points(" not in f.read_text(encoding="utf-8"), f"{f} may find plugins now: update the docs"
    doc = " ".join((REPO / "docs" / "lm_eval.md").read_text(encoding="utf-8").split())
    assert f"`ValueError: {said}`" in doc
    assert "`lm_eval --model psd --tasks T ...` becomes `python -m bench.lm_eval --model psd --tasks T ...`" in doc


@pytest.mark.slow
def test_cli_bad_model_args_exit_2(tasks_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", sys.argv[:])        # main() hands its argv to lm-eval through sys.argv
    rc = adapter.main(["--model", "psd", "--model_args", "method=psd,bogus=3", "--tasks", TASK,
                       "--include_path", str(tasks_dir)])
    err = capsys.readouterr().err
    assert rc == 2 and "error: unknown model_arg 'bogus' for the psd model; valid: " in err
    assert "Traceback" not in err
    rc = adapter.main(["--model", "psd", "--tasks", TASK + "_misspelt", "--include_path", str(tasks_dir)])
    err = capsys.readouterr().err          # lm-eval's ValueError was a traceback with exit status 1
    assert rc == 2 and f"error: Tasks not found: {TASK}_misspelt" in err and "Traceback" not in err
