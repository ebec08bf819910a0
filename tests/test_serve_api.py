"""engine.serve's API breadth and operations (issue 23, items 2 and 3), through the real `openai`
client: n > 1, prompt lists, top_p/top_k, logprobs and top alternatives (streamed too), echo,
ignore_eos, min_tokens, unknown fields (ignored with a header; refused with --strict), fields that
would change the answer (refused, issue 33 item 3), a random seed per unseeded sampled request, the
`psd` object of every answer, --api-key, /metrics, /version and --help.

Two servers in subprocesses on free ports, the shipped model in fp32 on the CPU: `keyed` (--api-key,
loopback) and `strict` (--strict, bound to 0.0.0.0 without a key: the warning line). Answers are
compared with `engine.generate` on the same prompt and options.
"""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from support import MODEL_DIR, NAME, REPO, ServerProcess, start_servers  # noqa: E402
KEY = "sk-test-4d1f"
OPTS = dict(method="confidence", threshold=0.9)           # both servers' defaults
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'user' %}Question: {{ m['content'] }}\n"
            "{% else %}Answer: {{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}Answer: {% endif %}")
QUESTIONS = [json.loads(line)["prompt"] for line in
             (REPO / "bench" / "data" / "math_test.jsonl").read_text(encoding="utf-8").splitlines()[:3]]
PROMPTS = [f"Question: {q}\nAnswer: " for q in QUESTIONS]
HOT = 5.0                      # a temperature at which the small model's answers vary from seed to seed
SHORT = "Question: What is 2 + 3?\nAnswer: "       # answered in about 10 tokens, then EOS


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_api")
    (tmp / "chat.jinja").write_text(TEMPLATE, encoding="utf-8")
    flags = ("--method", "confidence", "--threshold", "0.9")
    yield from start_servers(ServerProcess(tmp, *flags, "--chat-template", str(tmp / "chat.jinja"), key=KEY),
                             ServerProcess(tmp, *flags, "--strict", host="0.0.0.0"))


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def strict(servers):
    return servers[1]


@pytest.fixture(scope="module")
def engine_ref():
    """`answer(prompt_text, max_tokens, **options)`: engine.generate's result and text, alone."""
    from engine import generate
    from models import Tokenizer, load_model

    model = load_model(MODEL_DIR, dtype="float32", device="cpu")
    tok = Tokenizer(MODEL_DIR)

    def answer(text, max_tokens=32, **options):
        opts = {**OPTS, **options}
        block = opts.setdefault("block_length", 32)
        res = generate(model, [tok.encode(text)], gen_length=-(-max_tokens // block) * block, **opts)[0]
        return res, tok.decode(res.token_ids[:max_tokens])

    answer.tok, answer.model = tok, model
    return answer


def _psd(r) -> dict:
    return r.model_extra["psd"]


# ---------------------------------------------------------------------------------------- n and prompt lists
def test_n_and_prompt_lists(server, engine_ref):
    client = server.client()
    texts = [engine_ref(p, 24)[1] for p in PROMPTS[:2]]
    r = client.completions.create(model=NAME, prompt=PROMPTS[:2], n=2, max_tokens=24)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]            # index = prompt index * n + sample index
    assert [c.text for c in r.choices] == [texts[0], texts[0], texts[1], texts[1]]   # temperature 0: identical
    tok = engine_ref.tok
    n_prompt = sum(len(tok.encode(p)) for p in PROMPTS[:2])
    assert r.usage.prompt_tokens == n_prompt                         # each prompt once, as OpenAI counts
    assert r.usage.completion_tokens == 2 * sum(len(engine_ref(p, 24)[0].token_ids[:24]) for p in PROMPTS[:2])
    assert len(_psd(r)["choices"]) == 4
    # a list of token-id lists is the same request
    r2 = client.completions.create(model=NAME, prompt=[tok.encode(p) for p in PROMPTS[:2]], max_tokens=24)
    assert [c.text for c in r2.choices] == texts
    # chat: n choices
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}], n=3,
                                       max_tokens=16)
    assert [x.index for x in c.choices] == [0, 1, 2] and len({x.message.content for x in c.choices}) == 1


def test_n_usage_sums_the_choices(server, engine_ref):
    res, text = engine_ref(SHORT, 16)
    r = server.client().completions.create(model=NAME, prompt=[SHORT, SHORT], n=2, max_tokens=16)
    assert [c.text for c in r.choices] == [text] * 4
    assert r.usage.completion_tokens == 4 * len(res.token_ids[:16])
    assert r.usage.prompt_tokens == 2 * len(engine_ref.tok.encode(SHORT))
    assert r.usage.calls == 4 * res.calls


def test_n_streamed(server, engine_ref):
    texts = [engine_ref(p, 24)[1] for p in PROMPTS[:2]]
    stream = server.client().completions.create(model=NAME, prompt=PROMPTS[:2], n=2, max_tokens=24, stream=True,
                                                stream_options={"include_usage": True})
    got, finish, last = {}, {}, None
    for ch in stream:
        for c in ch.choices:
            got[c.index] = got.get(c.index, "") + (c.text or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
        last = ch
    assert got == {0: texts[0], 1: texts[0], 2: texts[1], 3: texts[1]}
    assert all(finish[i] in ("stop", "length") for i in range(4))
    assert last.usage.completion_tokens > 0 and len(last.model_extra["psd"]["choices"]) == 4


def test_sampled_n_gets_a_seed_per_choice(server):
    r = server.client().completions.create(model=NAME, prompt=PROMPTS[0], n=3, max_tokens=24, temperature=HOT,
                                           seed=41)
    assert [c["seed"] for c in _psd(r)["choices"]] == [41, 42, 43]
    assert len({c.text for c in r.choices}) > 1                   # three samples, not one answer three times


def test_bad_n_and_prompt_lists(server):
    client = server.client()
    for kwargs, words in [({"n": 0}, "n must be >= 1"), ({"n": 1000}, "n must be <= 128"),
                          ({"prompt": ["a", 3]}, "prompt must be"), ({"prompt": ["ok", ""]}, "prompt 1"),
                          ({"prompt": [PROMPTS[0]] * 200, "n": 2}, "--max-choices")]:
        with pytest.raises(openai.BadRequestError, match=re.escape(words)):
            client.completions.create(**{"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, **kwargs})


# ---------------------------------------------------------------------------------------- sampling
def test_unseeded_sampling_is_random_per_request(server, engine_ref):
    client = server.client()
    rs = [client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=HOT)
          for _ in range(3)]
    seeds = [_psd(r)["seed"] for r in rs]
    assert all(isinstance(s, int) for s in seeds) and len(set(seeds)) == 3
    assert len({r.choices[0].text for r in rs}) > 1
    # the reported seed reproduces the answer (a request alone; noise is drawn per batch)
    again = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=HOT, seed=seeds[0])
    assert again.choices[0].text == rs[0].choices[0].text
    assert again.choices[0].text == engine_ref(PROMPTS[0], 24, temperature=HOT, seed=seeds[0])[1]
    # temperature 0: no seed (nothing is drawn)
    assert _psd(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8))["seed"] is None


@pytest.mark.parametrize("method", ["confidence", "psd"])
def test_top_k_1_and_tiny_top_p_are_greedy_in_the_engine(engine_ref, method):
    from engine import generate

    ids = [engine_ref.tok.encode(PROMPTS[0])]
    opts = dict(method=method, gen_length=16, block_length=8, **({"threshold": 0.9} if method == "confidence" else {}))
    greedy = [r.token_ids for r in generate(engine_ref.model, ids, **opts)]
    sampled = [r.token_ids for r in generate(engine_ref.model, ids, temperature=HOT, seed=5, **opts)]
    assert sampled != greedy                                        # the check can fail: sampling changes tokens
    for cut in ({"top_k": 1}, {"top_p": 1e-9}, {"top_k": 1, "top_p": 0.5}):
        assert [r.token_ids for r in generate(engine_ref.model, ids, temperature=HOT, seed=5, **opts, **cut)] == greedy
    wide = [r.token_ids for r in generate(engine_ref.model, ids, temperature=HOT, seed=5, top_k=10 ** 6, top_p=1.0,
                                          **opts)]
    assert wide == sampled                                          # top_k beyond the vocabulary: no cut


def test_top_k_top_p_through_the_client(server, engine_ref):
    client = server.client()
    greedy = engine_ref(PROMPTS[0], 24)[1]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=HOT, seed=3,
                                  extra_body={"top_k": 1})
    assert r.choices[0].text == greedy
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, temperature=HOT, seed=3, top_p=1e-9)
    assert r.choices[0].text == greedy
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       max_tokens=16, temperature=HOT, top_p=0.9, extra_body={"top_k": 20})
    assert c.choices[0].message.content is not None
    for extra, words in [({"top_p": 1.5}, "outside (0, 1]"), ({"top_p": 0}, "outside (0, 1]"),
                         ({"top_k": -1}, "top-k must be >= 0"), ({"top_k": 2.5}, "top-k must be int")]:
        with pytest.raises(openai.BadRequestError, match=re.escape(words)):
            client.completions.create(model=NAME, prompt="x", max_tokens=8, extra_body=extra)


# ---------------------------------------------------------------------------------------- logprobs, echo
def test_logprobs(server, engine_ref):
    client = server.client()
    res, text = engine_ref(PROMPTS[0], 24)
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, logprobs=0)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert "".join(lp.tokens) == text == r.choices[0].text and len(lp.token_logprobs) == n
    assert lp.token_logprobs == pytest.approx([math.log(p) for p in res.commit_prob[:n]], abs=1e-5)
    assert all(x <= 0 for x in lp.token_logprobs) and lp.top_logprobs is None
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    assert client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8).choices[0].logprobs is None
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       max_tokens=16, logprobs=True)
    content = c.choices[0].logprobs.content
    assert "".join(t.token for t in content) == c.choices[0].message.content
    assert all(t.logprob <= 0 and t.top_logprobs == [] and bytes(t.bytes).decode() == t.token for t in content)
    chat = lambda **kw: client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}],  # noqa: E731
                                                       max_tokens=8, **kw)
    for call, words in [(lambda: client.completions.create(model=NAME, prompt="x", max_tokens=8, logprobs=21),
                         "logprobs must be <= 20"),
                        (lambda: chat(logprobs=True, top_logprobs=21), "top_logprobs must be <= 20"),
                        (lambda: chat(top_logprobs=2), "top_logprobs needs logprobs: true"),
                        (lambda: chat(logprobs=True, top_logprobs=-1), "top_logprobs must be an integer >= 0"),
                        (lambda: client.completions.create(model=NAME, prompt="x", max_tokens=8, logprobs=2,
                                                           extra_body={"method": "psd", "cross_block": True}),
                         "--top-logprobs is not supported with --cross-block"),
                        (lambda: client.completions.create(model=NAME, prompt="x", max_tokens=8, logprobs=0,
                                                           extra_body={"score": "margin"}), "score prob")]:
        with pytest.raises(openai.BadRequestError, match=re.escape(words)):
            call()


def test_top_logprobs(server, engine_ref):
    """logprobs: k (completions) / top_logprobs: k (chat): the k most likely tokens of the output
    that committed each token, the engine's commit_top; the first is the token itself (temperature
    0), streamed chunks carry the same."""
    client = server.client()
    res, _ = engine_ref(PROMPTS[0], 24, top_logprobs=3)
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    tok = engine_ref.tok
    assert len(lp.top_logprobs) == n and all(len(d) <= 3 for d in lp.top_logprobs)
    for t, lpt, top, want in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, res.commit_top[:n]):
        assert top[t] == lpt                                         # the chosen token is the most likely
        first = {}                                                   # by text, the more likely of two alike
        for i, p in want:
            first.setdefault(tok.decode([i]), math.log(p))
        assert top == pytest.approx(first, abs=1e-5)
    got = []
    for ch in client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=24, logprobs=3, stream=True):
        for c in ch.choices:
            got += c.logprobs.top_logprobs if c.logprobs is not None else []
    assert got == lp.top_logprobs
    c = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": QUESTIONS[0]}],
                                       max_tokens=16, logprobs=True, top_logprobs=2)
    for e in c.choices[0].logprobs.content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].token == e.token
        assert e.top_logprobs[0].logprob == e.logprob >= e.top_logprobs[1].logprob


def _streamed_logprobs(stream):
    """(text, logprob fields) of a streamed completion, the chunks' lists concatenated."""
    text, got = "", {"tokens": [], "token_logprobs": [], "text_offset": []}
    for ch in stream:
        for c in ch.choices:
            text += c.text
            if c.logprobs is not None:
                assert c.logprobs.tokens and c.logprobs.top_logprobs is None     # no empty logprobs objects
                for k in got:
                    got[k] += getattr(c.logprobs, k)
    return text, got


def test_streamed_logprobs_are_the_answers_logprobs(server):
    """Streamed, every chunk carries the logprobs of the tokens whose text it completes; they
    concatenate to the non-streamed logprobs (also with echo, a stop sequence that cuts the answer
    mid-token-run, and min_tokens), and chat's content entries to its content."""
    client = server.client()
    for kw in ({}, {"echo": True}, {"stop": [" ="]}, {"extra_body": {"min_tokens": 20}}):
        whole = client.completions.create(model=NAME, prompt=SHORT, max_tokens=32, logprobs=0, **kw)
        text, got = _streamed_logprobs(client.completions.create(model=NAME, prompt=SHORT, max_tokens=32, logprobs=0,
                                                                 stream=True, **kw))
        lp = whole.choices[0].logprobs
        assert text == whole.choices[0].text, kw
        assert got == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}, kw
        assert len(got["tokens"]) == whole.usage.completion_tokens
    chunks = list(client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=32, logprobs=0, stream=True))
    assert sum(1 for ch in chunks for c in ch.choices if c.logprobs is not None) > 1        # spread over the answer
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    whole = client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, logprobs=True)
    content, entries = "", []
    for ch in client.chat.completions.create(model=NAME, messages=messages, max_tokens=16, logprobs=True, stream=True):
        for c in ch.choices:
            content += c.delta.content or ""
            entries += c.logprobs.content if c.logprobs is not None else []
    assert content == whole.choices[0].message.content == "".join(e.token for e in entries)
    assert [(e.token, e.logprob) for e in entries] == [(e.token, e.logprob) for e in whole.choices[0].logprobs.content]


def test_echo(server, engine_ref):
    client = server.client()
    text = engine_ref(PROMPTS[0], 16)[1]
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, echo=True)
    assert r.choices[0].text == PROMPTS[0] + text
    ids = engine_ref.tok.encode(PROMPTS[0])
    r = client.completions.create(model=NAME, prompt=ids, max_tokens=16, echo=True)
    assert r.choices[0].text == engine_ref.tok.decode(ids) + text
    stream = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, echo=True, stream=True)
    assert "".join(c.text for ch in stream for c in ch.choices) == PROMPTS[0] + text
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=16, echo=True, logprobs=0)
    assert r.choices[0].logprobs.text_offset[0] == len(PROMPTS[0])


# ---------------------------------------------------------------------------------------- ignore_eos, min_tokens
def test_ignore_eos_and_min_tokens(server, engine_ref):
    client = server.client()
    res, text = engine_ref(SHORT, 32)
    assert res.stopped and len(res.token_ids) < 32                 # the plain answer ends early
    plain = client.completions.create(model=NAME, prompt=SHORT, max_tokens=32)
    assert plain.choices[0].finish_reason == "stop" and plain.choices[0].text == text
    full_res, full_text = engine_ref(SHORT, 32, ignore_eos=True)
    assert not full_res.stopped and len(full_res.token_ids) == 32
    for extra in ({"ignore_eos": True}, {"min_tokens": 32}):
        r = client.completions.create(model=NAME, prompt=SHORT, max_tokens=32, extra_body=extra)
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 32
        assert r.choices[0].text == full_text
    r = client.completions.create(model=NAME, prompt=SHORT, max_tokens=32, extra_body={"min_tokens": 0})
    assert r.choices[0].text == text
    # min_tokens between: no stop token in the first min_tokens positions, the engine's own answer
    m = len(res.token_ids) + 6
    long_res, long_text = engine_ref(SHORT, 32, min_tokens=m)
    assert long_res.stopped and len(long_res.token_ids) > m and long_text != text
    assert not set(long_res.token_ids[:m]) & set(engine_ref.model.config.stop_token_ids)
    r = client.completions.create(model=NAME, prompt=SHORT, max_tokens=32, extra_body={"min_tokens": m})
    assert r.choices[0].text == long_text and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == len(long_res.token_ids) > m
    # streamed, and in the nested decoding object: the same answer
    stream = client.completions.create(model=NAME, prompt=SHORT, max_tokens=32, stream=True,
                                       extra_body={"decoding": {"min_tokens": m}})
    assert "".join(c.text for ch in stream for c in ch.choices) == long_text
    for extra, words in [({"min_tokens": 40}, "min_tokens 40 exceeds max_tokens 32"),
                         ({"min_tokens": -1}, "--min-tokens must be >= 0"),
                         ({"min_tokens": 2.5}, "--min-tokens must be int"),
                         ({"min_tokens": 4, "decoding": {"min_tokens": 5}}, "given twice"),
                         ({"ignore_eos": "yes"}, "--ignore-eos must be bool")]:
        with pytest.raises(openai.BadRequestError, match=re.escape(words)):
            client.completions.create(model=NAME, prompt=SHORT, max_tokens=32, extra_body=extra)


# ---------------------------------------------------------------------------------------- psd, unknown fields
def test_psd_object_says_what_max_tokens_decoded(server):
    r = server.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=20,
                                           extra_body={"block_length": 8})
    p = _psd(r)
    assert p["max_tokens"] == 20 and p["gen_length"] == 24 and p["block_length"] == 8   # rounded up to a block
    assert p["method"] == "confidence" and p["calls"] == r.usage.calls and p["tpf"] > 0
    assert r.usage.completion_tokens <= 20


def test_unknown_fields_are_ignored_with_a_header(server, strict):
    raw = server.client().completions.with_raw_response.create(
        model=NAME, prompt=PROMPTS[0], max_tokens=8, extra_body={"frobnicate": [1], "x_trace": "t"})
    assert raw.headers["x-psd-ignored-fields"] == "frobnicate,x_trace"
    assert raw.headers["x-psd-ignored-count"] == "2"
    r = raw.parse()
    assert _psd(r)["ignored_fields"] == ["frobnicate", "x_trace"]
    plain = server.client().completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=8)
    assert r.choices[0].text == plain.choices[0].text              # ignored: the answer is the default one
    assert "ignored unknown fields frobnicate, x_trace" in server.log.read_text()
    ok = server.client().completions.with_raw_response.create(model=NAME, prompt=PROMPTS[0], max_tokens=8,
                                                              extra_body={"repetition_penalty": 1, "user": "u"})
    assert "x-psd-ignored-fields" not in ok.headers                # neutral or no effect: nothing ignored
    # --strict: today's 400
    with pytest.raises(openai.BadRequestError, match="unknown field 'frobnicate'"):
        strict.client().completions.create(model=NAME, prompt="x", max_tokens=8, extra_body={"frobnicate": 0.5})


def test_fields_that_would_change_the_answer_are_refused(server):
    """No silent semantics (issue 33 item 3): a misspelt option, a field that changes decoding in
    OpenAI or vLLM, and the other endpoint's prompt field are 400s naming the field, through the
    client (tests/test_serve_protocol.py goes field by field)."""
    client = server.client()
    cases = [  # (endpoint, extra body, param, words of the message)
        ("completions", {"treshold": 0.5}, "treshold", "did you mean 'threshold'?"),
        ("completions", {"decoding": {"treshold": 0.5}}, "decoding", "did you mean 'threshold'?"),
        ("completions", {"guided_json": {"type": "object"}}, "guided_json", "guided_json is not supported"),
        ("completions", {"repetition_penalty": 1.3}, "repetition_penalty", "only 1 (no effect)"),
        ("completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages", "completions take a prompt"),
        ("chat", {"prompt": "hi"}, "prompt", "chat takes messages"),
        ("chat", {"response_format": {"type": "json_object"}}, "response_format", "response_format is not supported"),
    ]
    for endpoint, extra, param, words in cases:
        with pytest.raises(openai.BadRequestError) as e:
            if endpoint == "chat":
                client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}],
                                               max_tokens=4, extra_body=extra)
            else:
                client.completions.create(model=NAME, prompt="x", max_tokens=4, extra_body=extra)
        err = e.value.body
        assert err["param"] == param and words in err["message"], (extra, err)


# ---------------------------------------------------------------------------------------- auth and ops
def test_api_key(server, strict):
    body = {"model": NAME, "prompt": "x", "max_tokens": 4}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and "Bearer" in err["message"] and "\n" not in err["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200      # open: load balancers
    for path in ("/v1/models", "/metrics", "/version"):
        assert httpx.get(server.url + path, timeout=10).status_code == 401
        assert server.get(path).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    assert server.client().completions.create(model=NAME, prompt="x", max_tokens=4).choices
    # no key: every path is open, and binding a non-loopback address said so at start
    assert strict.get("/v1/models").status_code == 200
    assert "warning: listening on 0.0.0.0" in strict.log.read_text()
    assert "warning: listening" not in server.log.read_text()


def _metrics(server) -> dict:
    r = server.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    families = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    assert set(re.findall(r"^# HELP (\S+) ", text, re.M)) == set(families)
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return families, values


def test_metrics(server):
    families, before = _metrics(server)
    assert families == {
        "psd_requests_total": "counter", "psd_choices_total": "counter", "psd_prompt_tokens_total": "counter",
        "psd_completion_tokens_total": "counter", "psd_generated_tokens_total": "counter",
        "psd_model_calls_total": "counter", "psd_sequence_calls_total": "counter",
        "psd_tokens_per_forward": "gauge", "psd_queue_length": "gauge", "psd_running_batch_size": "gauge",
        "psd_batch_size": "histogram", "psd_request_latency_seconds": "histogram",
        "psd_time_to_first_token_seconds": "histogram"}
    r = server.client().completions.create(model=NAME, prompt=PROMPTS[0], n=2, max_tokens=16)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model=NAME, prompt="x", max_tokens=0)
    _, after = _metrics(server)
    ok, bad = ('psd_requests_total{endpoint="/v1/completions",status="200"}',
               'psd_requests_total{endpoint="/v1/completions",status="400"}')
    assert after[ok] == before.get(ok, 0) + 1 and after[bad] == before.get(bad, 0) + 1
    assert after["psd_choices_total"] == before["psd_choices_total"] + 2
    assert after["psd_completion_tokens_total"] == before["psd_completion_tokens_total"] + r.usage.completion_tokens
    assert after["psd_generated_tokens_total"] - before["psd_generated_tokens_total"] == r.usage.decoded_tokens
    assert after["psd_model_calls_total"] > before["psd_model_calls_total"]
    assert after["psd_request_latency_seconds_count"] == before["psd_request_latency_seconds_count"] + 2
    assert after["psd_time_to_first_token_seconds_count"] == before["psd_time_to_first_token_seconds_count"] + 1
    assert after['psd_request_latency_seconds_bucket{le="+Inf"}'] == after["psd_request_latency_seconds_count"]
    assert after["psd_tokens_per_forward"] > 0 and after["psd_queue_length"] == 0
    assert after['psd_requests_total{endpoint="other",status="401"}'] >= 1        # test_api_key's refusals


def test_metrics_count_every_refusal_and_requests_once(server):
    """A 401 was counted without its latency, and 404, 405 and a request that is not HTTP were counted
    nowhere; /health's `requests` counted choices (it equalled `rows`)."""
    import socket

    import httpx

    _, before = _metrics(server)
    stats0 = server.health()["stats"]
    assert httpx.post(server.url + "/v1/completions", json={"model": NAME, "prompt": "x"}).status_code == 401
    assert server.get("/no/such/path").status_code == 404
    assert server.get("/v1/completions").status_code == 405
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")
    server.client().completions.create(model=NAME, prompt=[PROMPTS[0], PROMPTS[1]], n=2, max_tokens=8)
    _, after = _metrics(server)
    counted = {k: after[k] - before.get(k, 0) for k in after
               if k.startswith("psd_requests_total") and after[k] != before.get(k, 0)}
    assert counted == {'psd_requests_total{endpoint="/v1/completions",status="401"}': 1,
                       'psd_requests_total{endpoint="other",status="404"}': 1,
                       'psd_requests_total{endpoint="/v1/completions",status="405"}': 1,
                       'psd_requests_total{endpoint="other",status="400"}': 1,
                       'psd_requests_total{endpoint="/v1/completions",status="200"}': 1}, counted
    assert after["psd_request_latency_seconds_count"] - before["psd_request_latency_seconds_count"] == 5
    stats = server.health()["stats"]
    assert (stats["requests"] - stats0["requests"], stats["rows"] - stats0["rows"]) == (1, 4)


def test_version(server):
    v = server.get("/version").json()
    assert v["version"] and v["torch"] and "triton" in v
    assert v["model"] == NAME and v["family"] == "llada" and Path(v["model_dir"]).resolve() == MODEL_DIR.resolve()


def test_help_shows_defaults():
    out = subprocess.run([sys.executable, "-m", "engine.serve", "--help"], cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}, timeout=120).stdout
    for flag, default in [("--host", "127.0.0.1"), ("--port", "8000"), ("--max-batch", "32"), ("--max-queue", "256"),
                          ("--batch-wait-ms", "10.0"), ("--dtype", "float32"), ("--device", "auto"),
                          ("--gen-length", "the checkpoint's generation_config.json gen_length, else 128"),
                          ("--top-k", "0"), ("--top-p", "1.0")]:
        block = " ".join(next(b for b in re.split(r"\n  (?=-)", out) if b.split()[0] == flag).split())
        assert f"(default: {default})" in block, block
    assert "--api-key" in out and "PSD_API_KEY" in out and "--strict" in out
