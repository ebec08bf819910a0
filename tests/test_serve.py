"""engine.serve through the real `openai` client (and httpx for what the client cannot send): two
servers in subprocesses on free loopback ports, the shipped model in fp32 on the CPU.

Every answer is compared with `engine.generate` on the same prompt and options, decoded with the
checkpoint's tokenizer; streamed pieces must concatenate to the non-streamed text (a dropped piece
or a streamed token that later changed breaks the equality). The `limited` server (--max-batch 1
--max-queue 1, a slow load, no chat template) is where 503, 429, disconnects and the missing
template are checked.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
httpx = pytest.importorskip("httpx")

from support import MODEL_DIR, NAME, REPO, ServerProcess, free_port, start_servers  # noqa: E402,F401
SERVER_OPTS = dict(method="confidence", threshold=0.9)           # the main server's defaults
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n"
            "{% elif m['role'] == 'user' %}Question: {{ m['content'] }}\n"
            "{% else %}Answer: {{ m['content'] }}\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}Answer: {% endif %}")
QUESTIONS = [json.loads(line)["prompt"] for line in
             (REPO / "bench" / "data" / "math_test.jsonl").read_text(encoding="utf-8").splitlines()[:8]]
PROMPTS = [f"Question: {q}\nAnswer: " for q in QUESTIONS]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    (tmp / "chat.jinja").write_text(TEMPLATE, encoding="utf-8")
    yield from start_servers(ServerProcess(tmp, "--method", "confidence", "--threshold", "0.9",
                                           "--chat-template", str(tmp / "chat.jinja")),
                             ServerProcess(tmp, "--max-batch", "1", "--max-queue", "1", "--load-delay", "3"))


@pytest.fixture(scope="module")
def server(servers):
    return servers[0]


@pytest.fixture(scope="module")
def limited(servers):
    return servers[1]


@pytest.fixture(scope="module")
def engine_ref():
    """`answer(prompt_text, **options)`: engine.generate's tokens and text for one prompt, alone."""
    from engine import generate
    from models import Tokenizer, load_model

    model = load_model(MODEL_DIR, dtype="float32", device="cpu")
    tok = Tokenizer(MODEL_DIR)
    cache = {}

    def answer(text, max_tokens=32, **options):
        opts = {**SERVER_OPTS, **options}
        if opts["method"] == "greedy":      # the server drops its defaults that a method does not take
            opts.pop("threshold")
        block = opts.setdefault("block_length", 32)
        gen = -(-max_tokens // block) * block
        key = (text, gen, tuple(sorted(opts.items())))
        if key not in cache:
            cache[key] = generate(model, [tok.encode(text)], gen_length=gen, **opts)[0]
        res = cache[key]
        ids = res.token_ids[:max_tokens]
        return res, ids, tok.decode(ids)

    answer.tok = tok
    return answer


def _stream_text(stream, chat=False):
    pieces, finish, usage = [], None, None
    for ch in stream:
        if ch.usage is not None:
            usage = ch.usage
        for c in ch.choices:
            piece = c.delta.content if chat else c.text
            if piece:
                pieces.append(piece)
            finish = c.finish_reason or finish
    return pieces, finish, usage


# ---------------------------------------------------------------------------------------- answers
def test_models_and_health(server, limited):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [NAME]
    h = server.health()
    assert h["status"] == "ok" and h["model"] == NAME
    # the limited server answered 503 while its model was loading, in OpenAI's error shape
    (what, status, body), (what2, status2, body2) = limited.early
    assert status == 503 and body["status"] == "loading"
    assert status2 == 503 and body2["error"]["code"] == "loading" and "loading" in body2["error"]["message"]


def test_completion_equals_engine(server, engine_ref):
    client = server.client()
    res, ids, text = engine_ref(PROMPTS[0])
    r = client.completions.create(model=NAME, prompt=PROMPTS[0], max_tokens=32)
    assert r.choices[0].text == text
    assert r.choices[0].finish_reason == ("stop" if res.stopped and len(res.token_ids) <= 32 else "length")
    u = r.usage
    assert u.prompt_tokens == len(engine_ref.tok.encode(PROMPTS[0]))
    assert u.completion_tokens == len(ids) and u.total_tokens == u.prompt_tokens + u.completion_tokens
    assert u.calls == res.calls and u.tpf == pytest.approx(res.tpf, abs=1e-3)
    # a prompt given as token ids is the same request
    r2 = client.completions.create(model=NAME, prompt=engine_ref.tok.encode(PROMPTS[0]), max_tokens=32)
    assert r2.choices[0].text == text


@pytest.mark.parametrize("options,max_tokens", [({}, 32), ({"method": "psd", "depth": 3}, 32),
                                                ({"threshold": 0.5, "block_length": 8, "cache": "dual"}, 30)])
def test_streaming_concatenates_to_the_answer(server, engine_ref, options, max_tokens):
    client = server.client()
    _, _, text = engine_ref(PROMPTS[1], max_tokens, **options)
    full = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=max_tokens, extra_body=options)
    assert full.choices[0].text == text
    stream = client.completions.create(model=NAME, prompt=PROMPTS[1], max_tokens=max_tokens, extra_body=options,
                                       stream=True, stream_options={"include_usage": True})
    pieces, finish, usage = _stream_text(stream)
    assert "".join(pieces) == text
    assert finish == full.choices[0].finish_reason
    assert usage.completion_tokens == full.usage.completion_tokens and usage.calls == full.usage.calls
    if options.get("block_length") == 8:      # four blocks: the text arrives piece by piece
        assert len(pieces) > 2


def test_options_at_top_level_or_nested(server, engine_ref):
    client = server.client()
    opts = {"method": "psd", "policy": "confidence", "threshold": 0.7, "depth": 2}
    _, _, text = engine_ref(PROMPTS[2], policy_name="confidence", method="psd", threshold=0.7, depth=2)
    top = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=32, extra_body=opts)
    nested = client.completions.create(model=NAME, prompt=PROMPTS[2], max_tokens=32, extra_body={"decoding": opts})
    assert top.choices[0].text == nested.choices[0].text == text
    assert top.usage.calls == nested.usage.calls


def test_max_tokens_and_stop(server, engine_ref):
    client = server.client()
    res, ids, text = engine_ref(PROMPTS[3], 7)          # gen length 32, output cut to 7 tokens
    r = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=7)
    assert r.choices[0].text == text and r.usage.completion_tokens == len(ids) <= 7
    assert r.usage.decoded_tokens == len(res.token_ids)
    _, _, full = engine_ref(PROMPTS[3], 32)
    stop = "="
    assert stop in full
    want = full[:full.index(stop)]
    r = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=32, stop=[stop, "zzz"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    pieces, finish, _ = _stream_text(client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=32,
                                                               stop=[stop, "zzz"], stream=True))
    assert "".join(pieces) == want and finish == "stop"


def test_chat(server, engine_ref):
    import jinja2.sandbox

    client = server.client()
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    conversations = [[{"role": "user", "content": QUESTIONS[4]}],
                     [{"role": "system", "content": "Solve it."}, {"role": "user", "content": QUESTIONS[5]},
                      {"role": "assistant", "content": "Let me see."}, {"role": "user", "content": QUESTIONS[6]}]]
    for messages in conversations:
        rendered = env.from_string(TEMPLATE).render(messages=messages, add_generation_prompt=True)
        _, _, text = engine_ref(rendered, threshold=0.5)
        r = client.chat.completions.create(model=NAME, messages=messages, max_tokens=32, extra_body={"threshold": 0.5})
        assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == text
        assert r.usage.prompt_tokens == len(engine_ref.tok.encode(rendered))
        pieces, finish, _ = _stream_text(client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=32, extra_body={"threshold": 0.5}, stream=True), chat=True)
        assert "".join(pieces) == text and finish == r.choices[0].finish_reason


# ---------------------------------------------------------------------------------------- bad requests
LONG = "Question: " + "one two three four five six seven eight nine ten " * 40
BAD = [  # (body changes, status, words the message must hold)
    ({"method": "nope"}, 400, "unknown method"),
    ({"threshold": 1.5}, 400, "outside (0, 1]"),
    ({"threshold": "high"}, 400, "must be float"),
    ({"method": "greedy", "depth": 3}, 400, "applies to"),
    ({"cache": "paged"}, 400, "unknown cache mode"),
    ({"graph": "/etc/passwd"}, 400, "list of rank lists"),
    ({"decoding": {"treshold": 0.5}}, 400, "unknown decoding option"),
    ({"decoding": 3}, 400, "object of decoding options"),
    ({"threshold": 0.5, "decoding": {"tau": 0.6}}, 400, "given twice"),
    ({"prompt": ""}, 400, "empty"),
    ({"prompt": "   "}, 400, "empty"),
    ({"prompt": []}, 400, "empty"),
    ({"prompt": "Question: <|mask|> 2\nAnswer: "}, 400, "mask token"),
    ({"prompt": [5, 1, 6]}, 400, "mask token"),
    ({"prompt": [5, 50000]}, 400, "outside the vocabulary"),
    ({"prompt": ["a", 3]}, 400, "prompt must be a string"),
    ({"prompt": 12}, 400, "string or a list of token ids"),
    ({"prompt": None}, 400, "prompt is required"),
    ({"prompt": LONG}, 400, "maximum length"),
    ({"max_tokens": 0}, 400, "max_tokens must be >= 1"),
    ({"max_tokens": "10"}, 400, "max_tokens must be an integer"),
    ({"max_tokens": 250}, 400, "maximum length 256"),
    ({"n": 0}, 400, "n must be >= 1"),
    ({"top_p": 1.5}, 400, "top-p"),
    ({"logprobs": 21}, 400, "logprobs must be <= 20"),
    ({"echo": "yes"}, 400, "echo must be a boolean"),
    ({"temperature": -1}, 400, "temperature must be finite and >= 0"),
    ({"seed": -3}, 400, "seed"),
    ({"stream": "yes"}, 400, "stream must be a boolean"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ({"stop": 5}, 400, "stop must be"),
    ({"compile": True}, 400, "--compile is set when the server starts, not per request"),
    ({"decoding": {"cost_profile": "/etc/passwd"}}, 400, "cost profile is set when the server starts"),
    ({"model": None}, 400, "model is required"),
    # refused by the decoder, not the request parser: its 400 had code null
    ({"logprobs": 2, "method": "psd", "cross_block": True}, 400, "--top-logprobs is not supported with --cross-block"),
    ({"model": "gpt-4"}, 404, "does not exist"),
]
CHAT_BAD = [
    ({"messages": []}, 400, "non-empty list"),
    ({"messages": [{"role": "tool", "content": "x"}]}, 400, "role 'tool'"),
    ({"messages": [{"role": "user", "content": 3}]}, 400, "string content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "text content"),
    ({"messages": [{"role": "user", "content": "  "}]}, 400, "empty"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, 400, "tools"),
]


def _check_error(r, status, words):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and (status != 400 or err["code"]), err    # a 400 has a code
    assert "\n" not in err["message"] and words in err["message"], err


@pytest.mark.parametrize("change,status,words", BAD,
                         ids=[f"{i}:{json.dumps(c)[:40]}" for i, (c, _, _) in enumerate(BAD)])
def test_bad_completion_request(server, change, status, words):
    body = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 8, **change}
    body = {k: v for k, v in body.items() if v is not None or k == "prompt"}
    _check_error(httpx.post(server.url + "/v1/completions", json=body, timeout=30), status, words)


@pytest.mark.parametrize("change,status,words", CHAT_BAD, ids=[str(i) for i in range(len(CHAT_BAD))])
def test_bad_chat_request(server, change, status, words):
    body = {"model": NAME, "max_tokens": 8, **change}
    _check_error(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30), status, words)


def test_bad_requests_through_the_client_and_raw(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="unknown method"):
        client.completions.create(model=NAME, prompt="x", extra_body={"method": "nope"})
    with pytest.raises(openai.BadRequestError, match="n must be >= 1"):
        client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "x"}], n=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x")
    for raw, words in [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object")]:
        _check_error(httpx.post(server.url + "/v1/completions", content=raw, timeout=30,
                                headers={"Content-Type": "application/json"}), 400, words)
    _check_error(httpx.get(server.url + "/v1/nothing", timeout=30), 404, "Not Found")
    _check_error(httpx.get(server.url + "/v1/completions", timeout=30), 405, "Method Not Allowed")
    assert server.health()["status"] == "ok" and server.proc.poll() is None     # never died


# ---------------------------------------------------------------------------------------- load
def test_concurrent_load_is_batched_and_batch_invariant(server, engine_ref):
    """32 requests from 8 client threads, two option sets: all answered, each equal to its
    single-request answer (fp32 batch invariance), and requests were decoded in shared batches."""
    jobs = [(PROMPTS[i % 8], {} if i % 8 < 4 else {"threshold": 0.7, "cache": "dual"}) for i in range(32)]
    want = {(p, json.dumps(o)): engine_ref(p, 32, **o)[2] for p, o in jobs}
    before = server.health()["stats"]
    client = server.client()

    def ask(job):
        prompt, opts = job
        if len(prompt) % 2:        # half of them streamed
            r = client.completions.create(model=NAME, prompt=prompt, max_tokens=32, extra_body=opts)
            return r.choices[0].text, r.usage.batch_size
        pieces, _, usage = _stream_text(client.completions.create(
            model=NAME, prompt=prompt, max_tokens=32, extra_body=opts, stream=True,
            stream_options={"include_usage": True}))
        return "".join(pieces), usage.batch_size

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(ask, jobs, timeout=600))
    assert [g[0] for g in got] == [want[(p, json.dumps(o))] for p, o in jobs]
    after = server.health()
    assert after["status"] == "ok" and after["stats"]["requests"] - before["requests"] == 32
    assert after["stats"]["batches"] - before["batches"] < 32 and max(g[1] for g in got) > 1   # batched
    assert after["stats"]["errors"] == 0


# ---------------------------------------------------------------------------------------- limits
def _wait_health(server, test, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        h = server.health()
        if test(h):
            return h
        time.sleep(0.05)
    raise AssertionError(f"server state not reached: {h}")


def test_queue_full_and_a_disconnected_stream(limited):
    """--max-batch 1 --max-queue 1. A long streamed request decodes, a second one waits: a third
    is refused with 429. The first client reads one piece and hangs up: its batch (it alone)
    stops decoding, the waiting request is answered, the server goes on. Alone, the long request
    would take 96 calls (greedy over sampled noise, seed 0: it stops at token 95 in fp32, CPU)."""
    before = limited.health()["stats"]
    long = {"model": NAME, "prompt": "Question: Hugo has 12 toys. He gives half of them to Dan.\nAnswer: ",
            "max_tokens": 128, "method": "greedy", "temperature": 50.0, "seed": 0, "stream": True}
    short = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 8, "method": "confidence", "threshold": 0.9}
    waiting = []
    with httpx.stream("POST", limited.url + "/v1/completions", json=long, timeout=300) as r:
        assert r.status_code == 200
        _wait_health(limited, lambda h: h["running"] == 1)
        t = threading.Thread(target=lambda: waiting.append(httpx.post(limited.url + "/v1/completions", json=short,
                                                                      timeout=300)))
        t.start()
        _wait_health(limited, lambda h: h["queue"] == 1)
        refused = httpx.post(limited.url + "/v1/completions", json=short, timeout=60)
        _check_error(refused, 429, "queue is full")
        assert refused.json()["error"]["code"] == "queue_full"
        for line in r.iter_lines():           # one piece of text, then hang up mid-stream
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break
    stats = _wait_health(limited, lambda h: h["stats"]["aborted_batches"] > before["aborted_batches"], 60)["stats"]
    assert stats["cancelled"] == before["cancelled"] + 1
    t.join(300)
    assert waiting[0].status_code == 200 and waiting[0].json()["usage"]["completion_tokens"] >= 1
    assert limited.health()["status"] == "ok"


def test_a_non_streamed_client_that_goes_away_is_cancelled_at_once(limited):
    """A non-streamed request whose client closes the connection mid-decode: its row is cancelled
    at once, although the worker sends its handler an event every model call (`left`: one token a
    call). The handler used to look for the disconnect only after 0.5 s without an event, so the
    row decoded all its calls for nobody."""
    import socket

    _wait_health(limited, lambda h: h["running"] == 0 and h["queue"] == 0)
    before = limited.health()["stats"]
    body = json.dumps({"model": NAME, "prompt": PROMPTS[0], "max_tokens": 192, "ignore_eos": True,
                       "method": "left"}).encode()
    s = socket.create_connection(("127.0.0.1", limited.port))
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n" % len(body) + body)
    _wait_health(limited, lambda h: h["stats"]["calls"] >= before["calls"] + 8)
    s.close()
    gone = limited.health()["stats"]["calls"]
    after = _wait_health(limited, lambda h: h["running"] == 0, 60)["stats"]
    assert after["cancelled"] == before["cancelled"] + 1
    assert after["calls"] - gone <= 8, (gone, after)        # 192 calls alone; at once: the calls in flight
    assert after["calls"] - before["calls"] < 100


def test_chat_without_a_template(limited):
    r = httpx.post(limited.url + "/v1/chat/completions", timeout=30,
                   json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
    _check_error(r, 400, "no chat template")


# ---------------------------------------------------------------------------------------- command line
@pytest.mark.parametrize("flags,words", [(["--model", "/nonexistent/dir"], "does not exist"),
                                         (["--method", "confidence", "--threshold", "2"], "outside (0, 1]"),
                                         (["--chat-template", "nofile"], "neither a file")])
def test_bad_command_line_is_one_line(flags, words):
    res = subprocess.run([sys.executable, "-m", "engine.serve", "--port", str(free_port()), *flags], cwd=REPO,
                         capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert res.returncode == 2 and res.stderr.strip().startswith("error:") and words in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
