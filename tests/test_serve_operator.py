"""Issue 31, items 3, 5 and 6: `python -m engine.serve` is fair between requests, refuses bad flags
before it reports ready, and gives an operator request ids, Retry-After, a read timeout and
queue/running gauges. One server (the shipped model, 4 rows) serves the whole module; the
scheduler's order is also checked without a model."""
from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from support import NAME, REPO, ServerProcess, free_port, run_main  # noqa: E402
from test_serve import PROMPTS  # noqa: E402

from engine.config import DecodeConfig  # noqa: E402
from engine.serve.protocol import Spec  # noqa: E402

ROWS, QUEUE = 4, 66
SHORT = {"model": NAME, "prompt": PROMPTS[3], "max_tokens": 8}
# 16 prompts times n 4: 64 choices, the default --max-choices; 16 times the server's rows
BIG = {"model": NAME, "prompt": (PROMPTS * 4)[:16], "n": 4, "max_tokens": 32, "stream": True}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("operator"), "--max-batch", str(ROWS), "--max-queue", str(QUEUE),
                      "--method", "confidence", "--threshold", "0.9", "--read-timeout", "1", "--access-log")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def _post(server, body, **kw):
    return httpx.post(server.url + "/v1/completions", json=body, timeout=kw.pop("timeout", 120), **kw)


def _gauges(server) -> dict:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return {k: float(v) for k, v in re.findall(r"^(psd_queue_length|psd_running_batch_size) (\S+)$", text, re.M)}


# ------------------------------------------------------------------------------ 3. fair between requests
def test_a_short_request_is_not_starved_by_a_many_choice_request(server):
    """While a 64-choice request holds every row, a short request gets the next free row: it is
    answered within a small multiple of its time alone, with the same tokens, long before the big
    one ends. (Before: it queued behind all 64 choices.) Meanwhile the gauges say 1 request
    waiting and 4 rows running, and a request that would overfill the queue gets 429 + Retry-After."""
    alone_answers = [_post(server, SHORT) for _ in range(2)]
    alone = min(r.elapsed.total_seconds() for r in alone_answers)
    finished = []                                    # the big request's choices, as they finish
    with httpx.Client(timeout=300) as client, client.stream("POST", server.url + "/v1/completions",
                                                            json=BIG) as big:
        assert big.status_code == 200

        def read():
            try:
                for line in big.iter_lines():
                    if line.startswith("data: {") and json.loads(line[6:])["choices"][0].get("finish_reason"):
                        finished.append(time.perf_counter())
            except httpx.HTTPError:                  # closed below
                pass
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + 60
        while (h := server.health())["running"] < ROWS:
            assert time.monotonic() < deadline, h
            time.sleep(0.01)
        # the big request's choices wait in the queue (a loaded machine may finish a few before this poll)
        assert h["queue"] == 1 and h["queued_choices"] > 0 and h["queued_choices"] + ROWS + len(finished) >= 64 - ROWS
        assert _gauges(server) == {"psd_queue_length": 1, "psd_running_batch_size": ROWS}
        full = _post(server, {**SHORT, "n": 64})          # over the queue's room while 3+ choices wait
        assert full.status_code == 429 and full.headers["retry-after"] == "1", full.text
        at_submit = len(finished)
        r = _post(server, SHORT, timeout=30 * alone + 30)
        done_then = len(finished) - at_submit            # the big request's choices answered meanwhile
        big.close()                                  # the big request's client goes away: its rows are dropped
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == alone_answers[0].json()["choices"][0]["text"]    # temperature 0
    assert done_then < 64 // 4, f"the short request waited for {done_then} of the big request's 64 choices"
    assert r.elapsed.total_seconds() < 10 * alone + 5, (r.elapsed.total_seconds(), alone)     # (+5: a loaded machine)
    deadline = time.monotonic() + 60
    while _gauges(server) != {"psd_queue_length": 0, "psd_running_batch_size": 0}:     # idle again
        assert time.monotonic() < deadline, _gauges(server)
        time.sleep(0.05)


def test_choices_per_request_are_limited(server):
    r = _post(server, {**SHORT, "n": 65})
    assert r.status_code == 400 and "65 choices" in r.text and "--max-choices" in r.text
    r = _post(server, {**SHORT, "prompt": [PROMPTS[0]] * 33, "n": 2})
    assert r.status_code == 400 and "33 prompts times n 2 is 66 choices" in r.text


def _job(owner, seed=0):
    from engine.serve.worker import Job

    return Job(Spec([1, 2], DecodeConfig(seed=seed), 8, [], False, False, False), None, owner)


def test_rows_go_round_robin_over_requests():
    """The scheduler's order without a model: a request holding rows yields the next free row to one
    holding fewer; a request alone takes them all; static batches mix requests in turn."""
    from engine.serve.worker import Owner, StaticScheduler

    sch = StaticScheduler(max_queue=100, max_batch=4)
    a, b, c = Owner(), Owner(), Owner()
    big = [_job(a) for _ in range(10)]
    for j in big:
        sch.submit(j)
    assert sch._next_batch() == big[:4]                  # alone: every row
    small = [_job(b), _job(b)]
    other = [_job(c, seed=1)]                            # other options: a batch of its own
    for j in small + other:
        sch.submit(j)
    assert sch.queued() == 3
    assert sch._next_batch() == [small[0], big[4], small[1], big[5]]     # b waited since a's batch: first
    assert sch._next_batch() == other                    # c waited longer than a's last turn
    held = {id(a): 4}                                    # continuous: a holds 4 rows, b arrives
    late = _job(b)
    sch.submit(late)
    assert sch._fair(held) is late


def test_a_request_is_queued_whole_or_refused_and_a_gone_one_counted_once():
    """A request's choices are queued all or none: one that does not fit whole is refused (429) with
    nothing of it queued or counted. `cancelled` counts requests whose client went away, once
    whatever their n; a choice cancelled because another failed is not counted."""
    from engine.serve.worker import Owner, QueueFull, StaticScheduler

    sch = StaticScheduler(max_queue=3, max_batch=1)
    a, b, c = Owner(), Owner(), Owner()
    mine = [_job(a), _job(a)]
    sch.submit(*mine)
    with pytest.raises(QueueFull):
        sch.submit(_job(b), _job(b))
    assert sch.waiting == mine and sch.stats["cancelled"] == 0
    for j in mine:
        sch.cancel(j)
    assert sch.waiting == [] and sch.stats["cancelled"] == 1
    failed = _job(c)
    sch.submit(failed)
    sch.cancel(failed, gone=False)
    assert sch.waiting == [] and sch.stats["cancelled"] == 1


def test_a_bug_in_a_handler_is_a_500_with_the_request_id_and_a_405_names_allow(capsys):
    """In process, no model loaded: a handler that raises answers a JSON 500 that carries the
    request's X-Request-Id (the 500 used to be made outside the middleware that adds it) and is
    logged once; a wrong method's 405 says which are allowed."""
    from starlette.testclient import TestClient

    from engine.serve.cli import build_parser
    from engine.serve.routes import build_app
    from engine.serve.server import Server

    srv = Server(build_parser().parse_args(["--device", "cpu"]))
    srv.status = "ok"

    def boom(body, chat):
        raise RuntimeError("a bug")

    srv.parse = boom
    client = TestClient(build_app(srv), raise_server_exceptions=False)
    r = client.post("/v1/completions", json={"model": NAME, "prompt": "hi"}, headers={"X-Request-Id": "bug-1"})
    assert r.status_code == 500 and r.headers["x-request-id"] == "bug-1"
    assert r.json()["error"]["code"] == "internal_error" and "RuntimeError: a bug" in r.json()["error"]["message"]
    assert capsys.readouterr().err.count("RuntimeError: a bug") == 1
    r = client.delete("/v1/completions")
    assert r.status_code == 405 and r.headers["allow"] == "POST" and r.headers["x-request-id"]


def test_head_wherever_get_one_model_by_id_and_an_absolute_form_target(capsys):
    """HEAD answers wherever GET does (RFC 9110; load balancers probe /health so), GET /v1/models/ID
    is the openai client's `models.retrieve`, and `GET http://host/health` (absolute form, RFC 9112:
    what proxies send) is routed as `/health`: open without the API key, the rest behind it."""
    from starlette.testclient import TestClient

    from engine.serve.cli import build_parser
    from engine.serve.routes import build_app
    from engine.serve.server import Server

    srv = Server(build_parser().parse_args(["--device", "cpu", "--api-key", "k"]))
    srv.status = "ok"
    app = build_app(srv)
    client = TestClient(app, raise_server_exceptions=False)
    key = {"Authorization": "Bearer k"}
    for path in ("/health", "/v1/models", "/metrics", "/version"):
        got, head = client.get(path, headers=key), client.head(path, headers=key)
        assert got.status_code == head.status_code == 200 and head.content == b"", path
    card = client.get(f"/v1/models/{NAME}", headers=key)
    assert card.status_code == 200 and card.json() == client.get("/v1/models", headers=key).json()["data"][0]
    other = client.get("/v1/models/nope", headers=key)
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
    assert client.get(f"/v1/models/{NAME}").status_code == 401

    def absolute(path: str, headers=()) -> int:
        sent, target = [], f"http://evil{path}"
        scope = {"type": "http", "method": "GET", "path": target, "raw_path": target.encode(), "query_string": b"",
                 "headers": [(k.lower().encode(), v.encode()) for k, v in headers], "http_version": "1.1",
                 "scheme": "http", "server": ("x", 80), "client": ("y", 1), "root_path": ""}

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message):
            sent.append(message)

        asyncio.run(app(scope, receive, send))
        return sent[0]["status"]

    assert absolute("/health") == 200 and absolute("/v1/models") == 401
    assert absolute("/v1/models", [("Authorization", "Bearer k")]) == 200


# ------------------------------------------------------------------------------ 5. bad flags fail at start
def test_a_flag_engine_generate_refuses_fails_before_ready(tmp_path, capsys):
    """`--cuda-graphs` off CUDA and a bad `--cost-profile` used to start a server that answered 400
    to every request; now they are one `error:` line and exit 2 before anything is served."""
    proc = subprocess.run([sys.executable, "-m", "engine.serve", "--port", str(free_port()), "--device", "cpu",
                           "--cuda-graphs", "--static-rows"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == ["error: --cuda-graphs needs a CUDA device"]
    from engine.serve.cli import main

    bad_profile = tmp_path / "profile.json"
    bad_profile.write_text("{}")
    for flags, words in [(["--method", "psd", "--draft-budget", "auto", "--cost-profile", str(bad_profile)],
                          "is not a psd-cost-profile/1 file"),
                         (["--method", "psd", "--draft-budget", "auto", "--cost-profile", str(tmp_path / "none")],
                          "cannot read cost profile"),
                         (["--max-choices", "0"], "--max-choices must be >= 1"),
                         (["--read-timeout", "0"], "--read-timeout must be in"),
                         (["--gemm", "onednn", "--dtype", "float64"], "--gemm onednn takes float32 or bfloat16"),
                         (["--served-model-name", " "], "--served-model-name must be a printable, non-blank"),
                         (["--threads", "100000"], "argument --threads: must be at most")]:
        rc, _, err = run_main(main, ["--port", str(free_port()), "--device", "cpu", *flags], capsys)
        assert rc == 2 and err.strip().startswith("error:") and words in err, (flags, err)
        assert len(err.strip().splitlines()) == 1, err


# ------------------------------------------------------------------------------ 6. operator basics
def test_request_id_is_echoed_or_made_and_logged(server):
    mine = httpx.get(server.url + "/v1/models", headers={"X-Request-Id": "trace-42/a.b"}, timeout=10)
    assert mine.headers["x-request-id"] == "trace-42/a.b"
    made = _post(server, {**SHORT, "max_tokens": 0})                # an error answer gets one too
    assert made.status_code == 400 and re.fullmatch(r"[0-9a-f]{32}", made.headers["x-request-id"])
    odd = httpx.get(server.url + "/health", headers={"X-Request-Id": "a b" + "x" * 200}, timeout=10)
    assert re.fullmatch(r"[0-9a-f]{32}", odd.headers["x-request-id"])     # not printable-ASCII-only or too long
    deadline = time.monotonic() + 10
    while True:
        log = server.log.read_text()
        if "request_id=trace-42/a.b" in log and f"request_id={made.headers['x-request-id']}" in log:
            break
        assert time.monotonic() < deadline, log[-2000:]
        time.sleep(0.05)
    assert re.search(r'"POST /v1/completions HTTP/1.1" 400 \S+s request_id=' + made.headers["x-request-id"], log)


@pytest.mark.parametrize("sent", [b"GARBAGE\r\n\r\n", b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header: y\r\n\r\n"])
def test_a_request_that_is_not_http_gets_a_json_400_with_a_request_id(server, sent):
    """uvicorn answers what h11 cannot parse itself, outside the app: that 400 was plain text with no
    X-Request-Id and no access line; it is OpenAI's error shape with a new id, logged like the rest."""
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(sent)
        _, got = _closed_after(s, 15)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 "), got
    rid = re.search(rb"(?im)^x-request-id: ([0-9a-f]{32})\r?$", head)
    assert rid and json.loads(body)["error"]["code"] == "invalid_http", got
    deadline = time.monotonic() + 10
    while f"400 0.000s request_id={rid.group(1).decode()}" not in server.log.read_text():
        assert time.monotonic() < deadline, server.log.read_text()[-2000:]
        time.sleep(0.05)


def _closed_after(sock: socket.socket, limit: float, t0: float | None = None) -> tuple[float, bytes]:
    """Seconds from `t0` (default now; pass the time before connecting, since the server's clock
    starts at accept) until the server closes `sock` (reading what it sent), at most `limit`."""
    t0, got = time.monotonic() if t0 is None else t0, b""
    sock.settimeout(limit)
    while True:
        piece = sock.recv(4096)
        if not piece:
            return time.monotonic() - t0, got
        got += piece


@pytest.mark.parametrize("sent", [b"", b"POST /v1/compl", b"GET /health HTTP/1.1\r\nHost: x\r\n"])
def test_a_client_that_stalls_in_its_request_head_is_disconnected(server, sent):
    """--read-timeout 1: a connection that sends nothing, half a request line, or headers without
    their end is closed after about a second (uvicorn alone never closes the last two). (Bounds
    generous for a loaded machine: never at once, never left open.)"""
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(sent)
        seconds, got = _closed_after(s, 30, t0)
    assert 0.9 < seconds < 15 and got == b""


def test_a_client_that_stalls_in_its_body_gets_408(server):
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
        seconds, got = _closed_after(s, 30, t0)
    assert 0.9 < seconds < 15 and got.startswith(b"HTTP/1.1 408 ") and b"--read-timeout" in got
    # a keep-alive connection is given the same time for its next request, then closed
    with socket.create_connection(("127.0.0.1", server.port)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        seconds, got = _closed_after(s, 30)
    assert got.startswith(b"HTTP/1.1 200 ") and seconds < 15


@pytest.mark.slow
def test_shutdown_answers_every_request_503(tmp_path):
    """SIGTERM with one stream decoding and two requests waiting (--max-batch 1): the waiting plain
    request gets the JSON 503 `shutting_down`, the waiting and the running streams end with that
    error event and [DONE], and the server exits. (Before, the scheduler closed only after uvicorn
    had cancelled the handlers: a plain-text 500 and streams cut off without an end.)"""
    import signal

    s = ServerProcess(tmp_path, "--max-batch", "1")
    try:
        s.wait_ready()
        long = {"model": NAME, "prompt": PROMPTS[0], "max_tokens": 192, "ignore_eos": True, "method": "left"}
        got: dict = {}

        def stream(name):
            with httpx.stream("POST", s.url + "/v1/completions", json={**long, "stream": True}, timeout=60) as r:
                got[name] = (r.status_code, [line for line in r.iter_lines() if line.startswith("data: ")])

        def plain():
            got["plain"] = _post(s, long, timeout=60)

        running = threading.Thread(target=stream, args=("running",))
        running.start()
        s.wait_running()
        waiting = [threading.Thread(target=stream, args=("waiting",)), threading.Thread(target=plain)]
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 60
        while s.health()["queue"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        s.proc.send_signal(signal.SIGTERM)
        for t in [running, *waiting]:
            t.join(60)
        s.proc.wait(30)
    finally:
        s.stop()
    assert got["plain"].status_code == 503 and got["plain"].json()["error"]["code"] == "shutting_down"
    for name in ("running", "waiting"):
        status, lines = got[name]
        assert status == 200 and lines[-1] == "data: [DONE]", (name, lines[-3:])
        assert json.loads(lines[-2][6:])["error"]["code"] == "shutting_down", (name, lines[-3:])


def _drain(loop, job) -> list:
    """The events pushed to `job` so far (the worker pushes them onto its event loop)."""
    import asyncio

    loop.run_until_complete(asyncio.sleep(0))
    out = []
    while not job.events.empty():
        out.append(job.events.get_nowait())
    return out


def test_a_stopping_worker_tells_every_running_job_and_a_job_it_cannot_start_fails_alone(tmp_path, monkeypatch):
    """In process, a tiny random model: a job whose running batch cannot be formed is answered 500
    and the worker goes on; when the worker itself stops (an exception it does not survive) inside
    one running batch's call, the jobs of the other running batch are told too, not left waiting."""
    import asyncio

    from engine.live import LiveBatch
    from engine.serve.continuous import ContinuousScheduler
    from engine.serve.worker import Job, Owner
    from models import load_model
    from models.random_checkpoint import make_checkpoint

    model = load_model(make_checkpoint(tmp_path / "m", "llada", seed=0)[0])
    loop = asyncio.new_event_loop()
    sch = ContinuousScheduler(max_queue=8, max_batch=4)

    def job(seed, gen=8):
        return Job(Spec([5, 6, 7], DecodeConfig(gen_length=gen, block_length=8, temperature=0.5, seed=seed,
                                                ignore_eos=True), gen, [], False, False, False), loop, Owner())

    real_live_for = ContinuousScheduler._live_for

    def live_for(self, model, j, lives, turn):
        if j.spec.config.seed == 9:
            raise RuntimeError("cannot form this batch")
        return real_live_for(self, model, j, lives, turn)

    monkeypatch.setattr(ContinuousScheduler, "_live_for", live_for)
    real_step, steps = LiveBatch.step, []

    def step(self):
        steps.append(self)
        if len(set(map(id, steps))) == 2 and len(steps) > 3:     # the second batch, some calls in
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(LiveBatch, "step", step)
    a, b, bad = job(1, gen=64), job(2, gen=64), job(9)
    sch.submit(bad)
    sch.submit(a)
    sch.submit(b)
    with pytest.raises(KeyboardInterrupt):
        sch.run(model)
    (kind, err), = [e for e in _drain(loop, bad) if e[0] != "tokens"]
    assert kind == "error" and err.status == 500 and "cannot form this batch" in err.message
    for j in (a, b):
        ends = [e for e in _drain(loop, j) if e[0] != "tokens"]
        assert [(k, e.status, e.code) for k, e in ends] == [("error", 500, "decoding_failed")], ends
        assert "decoding stopped: KeyboardInterrupt" in ends[0][1].message
    loop.close()
