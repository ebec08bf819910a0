"""Issue 22, class 3: one request cannot kill, wedge or bloat `python -m engine.serve`.

One server (the shipped model, default limits, a plugin policy that fails while decoding) in a
subprocess, as tests/test_serve.py starts it. Each class of hostile input is one test: numeric
options out of range, bodies beyond --max-body-bytes, JSON a Python parser accepts but the engine
cannot use, a request that fails inside the worker, field names that would split a header or forge
a log line, and a bad --port or --host. Every hostile request must get a 4xx with a one-line JSON error, the server's peak memory
(VmHWM, reset through /proc/PID/clear_refs) must not grow with the size of what was asked for,
and the next good request must be answered.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("openai")           # tests/test_serve.py, whose server helper this reuses, needs it

from support import MODEL_DIR, NAME, REPO, ServerProcess, free_port  # noqa: E402

from engine.graph import MAX_NODES  # noqa: E402
from engine.options import MAX_TEMPERATURE, MIN_TEMPERATURE  # noqa: E402
from engine.serve.cli import MAX_BODY_BYTES  # noqa: E402
from models import ModelConfig, Tokenizer  # noqa: E402

MC = ModelConfig.from_dir(MODEL_DIR)
PROMPT = "Question: Tom has 3 apples and buys 4 more. How many apples does he have?\nAnswer: "
HUGE = 10 ** 400                       # beyond any float: int(...) / float(...) overflow on it
MIB = 1 << 20
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


# a user's policy that runs out of memory in its first step: a request for it fails inside the worker
EXPLODE = '''
from dataclasses import dataclass

import engine


@dataclass(frozen=True)
class Explode(engine.Policy):
    name = "explode"

    def select(self, conf, masked, step, *args):
        raise MemoryError("a step asked for more than there is")


engine.register(engine.Method("explode", "fails in its first step", Explode, is_policy=True))
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile")
    (tmp / "explode.py").write_text(EXPLODE)
    s = ServerProcess(tmp, "--plugin", str(tmp / "explode.py"))
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


class Peak:
    """Growth of the server's resident memory over a block of requests, in MiB: its peak (VmHWM,
    reset to the current RSS by writing 5 to /proc/PID/clear_refs) less its RSS at the start."""

    def __init__(self, pid: int):
        self.proc = Path(f"/proc/{pid}")

    def _kib(self, field: str) -> int:
        for line in (self.proc / "status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
        raise KeyError(field)

    def __enter__(self):
        try:
            (self.proc / "clear_refs").write_text("5")
            self.base = self._kib("VmRSS")
        except OSError as e:
            pytest.skip(f"cannot reset the server's peak RSS: {e}")
        return self

    def __exit__(self, *exc):
        self.growth = (self._kib("VmHWM") - self.base) / 1024
        return False


def _post(server, body, path="/v1/completions", timeout=60):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(server.url + path, content=raw, headers={"Content-Type": "application/json"}, timeout=timeout)


def _refusal(r, status=400) -> dict:
    """The error object of a refusal in OpenAI's shape, its message one line."""
    assert r.status_code == status, (r.status_code, r.text[:500])
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}, err
    assert err["message"] and "\n" not in err["message"] and len(err["message"]) < 800, err
    assert "Traceback" not in err["message"] and "internal error" not in err["message"], err
    return err


def _still_serves(server, before: dict):
    """The worker was not wedged: a good request and a good stream are answered, no request was a
    500, the process lives."""
    r = _post(server, {"model": NAME, "prompt": PROMPT, "max_tokens": 8})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                      json={"model": NAME, "prompt": PROMPT, "max_tokens": 8, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert s.status_code == 200 and lines[-1] == "data: [DONE]"
    h = server.health()
    assert h["status"] == "ok" and h["stats"]["errors"] == before["stats"]["errors"], h     # no 500
    assert server.proc.poll() is None


# ------------------------------------------------------------------------------ 1. numeric ranges
def test_every_numeric_option_is_range_checked_before_anything_is_allocated(server):
    """Each value here would size a graph, a schedule, a canvas or a loop far beyond memory or time
    (depth 10**9 built a 10^9-node graph and the kernel killed the server): a 400 naming the field,
    with the server's peak memory unchanged."""
    n = MC.max_length
    cases = [  # (changes to a good completion request, the field the error must name)
        ({"method": "psd", "depth": 10 ** 9}, "depth"),
        ({"method": "psd", "d": MAX_NODES}, "depth"),             # a chain of MAX_NODES + 1 nodes
        ({"method": "lopa", "k": 10 ** 9}, "k"),
        ({"method": "fdm", "k": HUGE}, "k"),
        ({"method": "ete", "k": -1}, "k"),
        ({"method": "topk", "steps": 10 ** 9}, "steps"),
        ({"method": "topk", "steps": n + 1}, "steps"),             # bounded by the model's length
        ({"method": "localleap", "window": 10 ** 9}, "window"),
        ({"block_length": 10 ** 9}, "block_length"),
        ({"block_length": n + 1}, "block_length"),
        ({"gen_length": 10 ** 9}, "gen_length"),
        ({"max_tokens": 10 ** 9}, "max_tokens"),
        ({"max_tokens": HUGE}, "max_tokens"),
        ({"max_tokens": n}, "max_tokens"),                         # no room left for one prompt token
        ({"temperature": 1e308}, "temperature"),
        ({"temperature": MAX_TEMPERATURE * 2}, "temperature"),
        ({"temperature": MIN_TEMPERATURE / 1e6}, "temperature"),   # logits / T overflows float32
        ({"temperature": HUGE}, "temperature"),
        ({"temperature": -1e-300}, "temperature"),
        ({"threshold": 1e308}, "threshold"),
        ({"tau": -HUGE}, "threshold"),
        ({"seed": 2 ** 64}, "seed"),
        ({"seed": -HUGE}, "seed"),
        ({"n": HUGE}, "n"),
        ({"top_p": 1e308}, "top_p"),
        ({"logprobs": HUGE}, "logprobs"),
        ({"method": "psd", "graph": [[]] + [[i] for i in range(50_000)]}, "graph"),
        ({"method": "psd", "graph": [[], [0], [0, 10 ** 12]]}, "graph"),
    ]
    before = server.health()
    wrong = []
    with Peak(server.proc.pid) as peak:
        for change, field in cases:
            r = _post(server, {"model": NAME, "prompt": PROMPT, "max_tokens": 8, **change})
            try:
                assert _refusal(r)["param"] == field
            except AssertionError as e:
                wrong.append((change if len(json.dumps(change)) < 200 else list(change), str(e)[:300]))
        r = _post(server, {"model": NAME, "messages": [{"role": "user", "content": "hi"}],
                           "max_completion_tokens": HUGE}, "/v1/chat/completions")
        assert _refusal(r)["param"] == "max_completion_tokens"
    assert not wrong, wrong
    assert peak.growth < 64, f"the server's peak memory grew by {peak.growth:.0f} MiB"
    _still_serves(server, before)


# ------------------------------------------------------------------------------ 2. body size
def _raw_exchange(server, head: bytes, pieces=(), timeout=30) -> bytes:
    """Send a request's head and body pieces on a raw socket (a send the server cut off is fine),
    then read the answer's head and body."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(head)
        try:
            for p in pieces:
                s.sendall(p)
        except OSError:
            pass
        data = b""
        try:
            while not (b"\r\n\r\n" in data and data.rstrip().endswith(b"}")):
                more = s.recv(65536)
                if not more:
                    break
                data += more
        except OSError:
            pass
    return data


def _raw_refusal(data: bytes, status: int) -> dict:
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), data[:300]
    err = json.loads(body)["error"]
    assert "\n" not in err["message"], err
    return err


def test_request_body_size_is_limited_while_it_is_read(server):
    """A 60 MiB body (it took 12.8 GB) is refused with 413 from its Content-Length, unread; a
    chunked one without a length as soon as it passes --max-body-bytes; the server's peak memory
    does not grow by the body. A body within the limit whose prompt cannot fit the model's length
    is a 400 without the prompt ever being tokenized whole (about 200 bytes a character)."""
    before = server.health()
    post = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    with Peak(server.proc.pid) as peak:
        t0 = time.monotonic()
        err = _raw_refusal(_raw_exchange(server, post + b"Content-Length: %d\r\n\r\n" % (60 * MIB),
                                         [b'{"model": "default", "prompt": "']), 413)
        assert err["code"] == "body_too_large" and "--max-body-bytes" in err["message"]
        assert str(MAX_BODY_BYTES) in err["message"]
        assert time.monotonic() - t0 < 10              # answered from the header, not after 60 MiB

        chunk = b"x" * MIB
        pieces = [b"%x\r\n%s\r\n" % (len(chunk), chunk)] * (MAX_BODY_BYTES // MIB + 2)
        err = _raw_refusal(_raw_exchange(server, post + b"Transfer-Encoding: chunked\r\n\r\n", pieces), 413)
        assert err["code"] == "body_too_large"

        r = httpx.post(server.url + "/v1/completions", content=b" " * (60 * MIB), timeout=60,
                       headers={"Content-Type": "application/json"})
        assert _refusal(r, 413)["code"] == "body_too_large"
        assert r.headers.get("connection") == "close"
    assert peak.growth < 32, f"the server's peak memory grew by {peak.growth:.0f} MiB reading refused bodies"

    words = "one two three four five six seven "
    long_text = words * ((MAX_BODY_BYTES - 1000) // len(words))
    assert len(Tokenizer(MODEL_DIR).encode(long_text[:20_000])) > MC.max_length     # it cannot fit
    long_ids = [5] * (4 * MC.max_length)
    with Peak(server.proc.pid) as peak:
        err = _refusal(_post(server, {"model": NAME, "prompt": long_text, "max_tokens": 8}))
        assert f"maximum length of {MC.max_length} tokens" in err["message"]
        err = _refusal(_post(server, {"model": NAME, "prompt": long_ids, "max_tokens": 8}))
        assert f"maximum length {MC.max_length}" in err["message"]
    assert peak.growth < 128, f"a {len(long_text) >> 20} MiB prompt grew the server's peak by {peak.growth:.0f} MiB"
    _still_serves(server, before)


# ------------------------------------------------------------------------------ 3. hostile JSON
def field_ok(err: dict, field: str | None) -> bool:
    return field is None or err["param"] == field


def test_hostile_json_is_a_400_and_never_wedges_the_worker(server):
    """Python's json module accepts NaN, Infinity, 1e999 (inf), 10**400 and lone surrogates; the
    engine cannot use any of them (math.isfinite(10**400) raises, a tokenizer cannot encode
    "\\ud800", a JSON answer cannot hold it). Each is a 400 with a one-line error, sent alone and
    among good requests; the good ones are answered and no request is a 500."""
    good = json.dumps({"model": NAME, "prompt": PROMPT, "max_tokens": 8})[:-1]     # without the closing }
    bodies = [  # (raw body, endpoint, the field the error must name or None)
        (good + ', "temperature": 1e308}', "completions", "temperature"),
        (good + ', "temperature": NaN}', "completions", None),
        (good + ', "temperature": Infinity}', "completions", None),
        (good + ', "threshold": -Infinity}', "completions", None),
        (good + ', "temperature": 1e999}', "completions", "temperature"),
        (good + ', "decoding": {"threshold": 1e999}}', "completions", "decoding"),
        (good + f', "temperature": {HUGE}}}', "completions", "temperature"),
        (good + f', "seed": {HUGE}}}', "completions", "seed"),
        (good + f', "max_tokens": {"9" * 5000}}}', "completions", None),   # past Python's int digits
        (good + ', "stop": ["\\ud800"]}', "completions", "stop"),
        (good + ', "\\udc00": 1}', "completions", None),
        ((good + "}").replace('"prompt": "', '"prompt": "\\ud800'), "completions", "prompt"),
        ((good + "}").replace('"prompt": "', '"prompt": "\\udfff\\ud800'), "completions", "prompt"),
        (json.dumps({"model": NAME, "max_tokens": 8, "messages": [{"role": "user", "content": "hi \ud83d"}]}),
         "chat/completions", "messages"),
        (json.dumps({"model": "\udc80", "prompt": "x"}), "completions", "model"),
        ('{"model": "default", "prompt": "\xff\xfe"}'.encode("latin-1"), "completions", None),   # not UTF-8
        ("[" * 200_000 + "]" * 200_000, "completions", None),
    ]
    before = server.health()

    def send(item):
        body, endpoint, field = item
        raw = body if isinstance(body, bytes) else body.encode("utf-8", "surrogatepass")
        return item, _post(server, raw, "/v1/" + endpoint)

    for item, r in map(send, bodies):                      # one at a time
        err = _refusal(r)
        assert field_ok(err, item[2]), (item[0][:120], err)
    with ThreadPoolExecutor(6) as pool:                    # and among good requests
        mixed = [(good + "}", "completions", "good")] * 4 + bodies
        for item, r in pool.map(send, mixed):
            if item[2] == "good":
                assert r.status_code == 200, r.text
            else:
                _refusal(r)
    _still_serves(server, before)


def test_a_request_that_fails_while_decoding_does_not_wedge_the_worker(server):
    """A request that passes every check and then fails inside the worker (a plugin policy that
    runs out of memory in its first step) is a one-line 500 for its own batch only, streamed or
    not; requests of other batches sent with it are answered, and so is the next one."""
    before = server.health()
    bad = {"model": NAME, "prompt": PROMPT, "max_tokens": 8, "method": "explode"}
    good = {"model": NAME, "prompt": PROMPT, "max_tokens": 8}

    def send(body):
        if body.get("stream"):
            with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
                events = [json.loads(line[6:]) for line in r.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            return r.status_code, events
        r = _post(server, body)
        return r.status_code, r.json()

    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(send, [bad, good, {**bad, "stream": True}, good, bad, good]))
    for (status, answer), sent in zip(results, [bad, good, {**bad, "stream": True}, good, bad, good]):
        if sent.get("method") != "explode":
            assert status == 200 and answer["choices"][0]["finish_reason"], answer
        elif sent.get("stream"):                    # the stream had begun: the error is its last event
            err = answer[-1]["error"]
            assert status == 200 and "MemoryError" in err["message"] and "\n" not in err["message"], answer
        else:
            assert status == 500 and answer["error"]["code"] == "decoding_failed", answer
            assert "MemoryError" in answer["error"]["message"] and "\n" not in answer["error"]["message"]
    h = server.health()
    assert h["stats"]["errors"] > before["stats"]["errors"]
    r = _post(server, good)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    assert server.health()["status"] == "ok" and server.proc.poll() is None


# ------------------------------------------------------------------------------ 4. field names
NAMES = {  # an unknown field's name -> how the X-PSD-Ignored-Fields header names it
    "crlf": ("a\r\nX-Evil: 1", "a%0D%0AX-Evil:%201"),      # split the header: the connection was dropped
    "nul": ("n\x00l", "n%00l"),                             # likewise
    "beyond latin-1": ("\u540d\u524d", "%E5%90%8D%E5%89%8D"),  # no header value at all: a 500
    "latin-1": ("\u00e9", "%C3%A9"),
    "forged log line": ("\nerror: forged", "%0Aerror:%20forged"),
    "long": ("x" * 5000, "x" * 64 + "..."),
    "comma": ("a,b", "a%2Cb"),                               # would split the list
}


@pytest.mark.parametrize("case", list(NAMES))
def test_field_names_are_data_never_headers_or_log_lines(server, case):
    """An unknown field is named back in the X-PSD-Ignored-Fields header and the server's log line:
    each name goes out percent-encoded as printable ASCII and cut; JSON (psd.ignored_fields) carries
    it as data."""
    name, header = NAMES[case]
    r = _post(server, {"model": NAME, "prompt": PROMPT, "max_tokens": 4, name: 1})
    assert r.status_code == 200, r.text
    assert "x-evil" not in r.headers
    assert r.headers["x-psd-ignored-fields"] == header and r.headers["x-psd-ignored-count"] == "1"
    assert r.json()["psd"]["ignored_fields"] == [name[:64]]
    log = server.log.read_text(encoding="utf-8", errors="replace").splitlines()
    assert not any(line.startswith("error: forged") for line in log)
    assert any(line.startswith("warning: ") and line.endswith(f"ignored unknown fields {header} (--strict refuses "
                                                              f"them)") for line in log)


def test_unknown_fields_echoed_are_capped(server):
    """100 000 unknown fields made a 690 KB header: the first 16 are named, with their count, and a
    request with more than 64 (each is compared with every known name) is a 400."""
    before = server.health()
    many = {f"field{i}": i for i in range(40)}
    r = _post(server, {"model": NAME, "prompt": PROMPT, "max_tokens": 4, **many})
    assert r.status_code == 200 and r.headers["x-psd-ignored-count"] == "40", r.text
    assert r.headers["x-psd-ignored-fields"].split(",") == list(many)[:16]
    assert len(r.json()["psd"]["ignored_fields"]) == 16 and r.json()["psd"]["ignored_count"] == 40
    r = _post(server, {"model": NAME, "prompt": PROMPT, "max_tokens": 4, **{f"k{i}": 0 for i in range(100_000)}})
    assert "more than 64 unknown fields" in _refusal(r)["message"]
    assert sum(len(k) + len(v) for k, v in r.headers.items()) < 1000
    _still_serves(server, before)


# ------------------------------------------------------------------------------ 5. --port, --host
@pytest.mark.slow
def test_bad_port_or_host_is_one_error_line(tmp_path, monkeypatch, capsys):
    """Checked by binding before the model is read: exit status 2 and exactly one `error:` line on
    stderr, never a traceback or uvicorn's abort. Every case runs in-process through
    `engine.serve.cli.main` (with the checkpoint's loading replaced by a failure, so a check that
    lets a bad flag through fails the test instead of starting a server); three also run as
    `python -m engine.serve`, and one makes uvicorn itself fail on the bound socket (closed under
    it): still one error line of ours, status 2. A port below 1024 is refused only to a user
    without the privilege (not checkable as root)."""
    from engine.serve import cli

    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    cases = [  # (flags, words of the error line)
        (["--port", "70000"], "not a TCP port"),
        (["--port", "-1"], "not a TCP port"),
        (["--port", "0"], "not a TCP port"),
        (["--port", "x"], "invalid int value"),
        (["--port", str(busy.getsockname()[1])], "already in use"),
        (["--host", "no-such-host.invalid"], "cannot be resolved"),
        (["--host", "192.0.2.1"], "not one of this machine's"),        # TEST-NET-1: never local
        (["--host", "::ffff:192.0.2.1"], "not one of this machine's"),
        (["--host", "a" * 300], "cannot be resolved"),
        (["--host", "a\0b"], "cannot be resolved"),
        (["--max-body-bytes", "0"], "--max-body-bytes must be >= 1"),
    ]
    if os.geteuid() != 0:
        cases.append((["--port", "80"], "permission denied"))

    def with_port(flags):
        return flags if "--port" in flags else flags + ["--port", str(free_port())]

    def no_server(args):
        raise AssertionError(f"the flags {args.host}:{args.port} got past the checks")

    closer = tmp_path / "closed_socket.py"
    closer.write_text("import sys\nimport engine.serve.cli as cli\nbind = cli.listen\n"
                      "def closed(host, port):\n    s = bind(host, port)\n    s.close()\n    return s\n"
                      "cli.listen = closed\nsys.exit(cli.main(sys.argv[1:]))\n")

    def run(flags, script=None):
        argv = [sys.executable] + ([str(script)] if script else ["-m", "engine.serve"])
        return subprocess.run(argv + ["--model", str(MODEL_DIR), "--device", "cpu", *with_port(flags)], cwd=REPO,
                              env=ENV, capture_output=True, text=True, timeout=300)

    try:
        with ThreadPoolExecutor(3) as pool:
            fallback = pool.submit(run, ["--threads", "1"], closer)
            real = [(c, pool.submit(run, c[0])) for c in (cases[1], cases[4], cases[5])]
            monkeypatch.setattr(cli, "Server", no_server)
            for flags, words in cases:
                capsys.readouterr()
                try:
                    status = cli.main(["--model", str(MODEL_DIR), *with_port(flags)])
                except SystemExit as e:           # argparse's own refusal
                    status = e.code
                err = capsys.readouterr().err
                assert status == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err, \
                    (flags, status, err)
            for (flags, words), res in [(c, f.result()) for c, f in real]:
                assert res.returncode == 2 and res.stderr.startswith("error: ") and words in res.stderr, \
                    (flags, res.returncode, res.stderr[-1000:])
                assert res.stderr.count("\n") == 1, res.stderr[-2000:]
            fallback = fallback.result()
    finally:
        busy.close()
    lines = fallback.stderr.strip().splitlines()
    assert fallback.returncode == 2 and "Traceback" not in fallback.stderr, fallback.stderr[-2000:]
    assert lines[-1].startswith("error: cannot serve on 127.0.0.1:") and \
        sum(line.startswith("error:") for line in lines) == 1, fallback.stderr[-2000:]
