"""Load benchmark of `python -m engine.serve` on loopback (docs/serve.md).

    python -m bench.serve_load [--model DIR] [--modes continuous static serial] [--levels 1 16 64]
                               [--requests N] [--max-tokens 64 [32 ...]]
    python -m bench.serve_load --url http://127.0.0.1:8000 [--model-name NAME]     # a running server

Without --url it starts one server per mode on free loopback ports, with the same decoding flags
(--server-args): continuous (continuous batching, --max-batch 32), static (--batching static
--max-batch 32: a batch runs start to end) and serial (--max-batch 1), and measures them side by
side, level by level, so all see the same machine. --max-tokens with several values gives prompt
i the i-th value (cyclically), so requests of different lengths are mixed and a prompt always
asks for the same length. Every request streams (`stream: true`, usage included): latency is the time to
`data: [DONE]`, time to first token the time to the first chunk with text. Per level: requests/s,
completion tokens/s, p50/p95/p99 latency and time to first token (nearest rank), mean batch size (the
`batch_size` the server reports in usage), model calls per request (the server's `calls`
counter in /health) and the server process's CPU seconds per request (/proc; both change far less
with the machine's other load than wall-clock figures do). Bounded: --requests per
level (default 2 x concurrency, at least 8) and --time-limit seconds per level (no new request
after it); --rounds R repeats each level, alternating which mode goes first, and pools the rounds.
"""
from __future__ import annotations

import json
import math
import os
import platform
import shlex
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "bench" / "data" / "math_test.jsonl"


def prompts(n: int) -> list[str]:
    rows = [json.loads(line) for line in DATA.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [f"Question: {r['prompt']}\nAnswer: " for r in rows[:n]]


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with few samples p99 is the maximum)."""
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def one_request(client, url: str, model: str, prompt: str, max_tokens: int, extra: dict) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    t0 = time.perf_counter()
    ttft, usage, text = None, None, []
    with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"{r.status_code} {r.read().decode()[:200]}"}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            for c in chunk.get("choices", []):
                if c.get("text"):
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(c["text"])
            usage = chunk.get("usage") or usage
    latency = time.perf_counter() - t0
    return {"latency": latency, "ttft": latency if ttft is None else ttft, "tokens": usage["completion_tokens"],
            "batch_size": usage.get("batch_size", 1), "calls": usage.get("calls"), "text": "".join(text)}


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of a process (Linux /proc), 0 where unknown."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, TypeError):
        return 0.0


def run_level(url: str, model: str, concurrency: int, n: int, max_tokens: int, extra: dict, time_limit: float,
              texts: list[str], pid: int | None = None) -> tuple[list[dict], float, int, float]:
    """Results of up to `n` requests from `concurrency` threads, wall seconds, model calls made,
    CPU seconds the server process used (where the bench started it)."""
    import httpx

    calls0 = httpx.get(url + "/health", timeout=30).json()["stats"]["calls"]
    cpu0 = cpu_seconds(pid)

    lock, out, nxt = threading.Lock(), [], [0]
    t0 = time.perf_counter()
    deadline = t0 + time_limit

    def worker():
        with httpx.Client(timeout=max(time_limit, 60) * 2) as client:
            while True:
                with lock:
                    i = nxt[0]
                    if i >= n or time.perf_counter() > deadline:
                        return
                    nxt[0] += 1
                try:
                    mt = max_tokens[(i % len(texts)) % len(max_tokens)] if isinstance(max_tokens, list) else max_tokens
                    res = one_request(client, url, model, texts[i % len(texts)], mt, extra)
                    res["prompt"] = i % len(texts)
                except Exception as e:        # noqa: BLE001 -- counted, the run goes on
                    res = {"error": f"{type(e).__name__}: {e}"}
                with lock:
                    out.append(res)

    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    calls = httpx.get(url + "/health", timeout=30).json()["stats"]["calls"] - calls0
    return out, wall, calls, cpu_seconds(pid) - cpu0


def summarize(concurrency: int, out: list[dict], wall: float, calls: int, cpu: float) -> dict:
    ok = [r for r in out if "error" not in r]
    lat, ttft = [r["latency"] for r in ok], [r["ttft"] for r in ok]
    tokens = sum(r["tokens"] for r in ok)
    return {"concurrency": concurrency, "requests": len(ok), "errors": len(out) - len(ok),
            "error_sample": next((r["error"] for r in out if "error" in r), None),
            "seconds": round(wall, 3), "req_per_s": round(len(ok) / wall, 3), "tok_per_s": round(tokens / wall, 2),
            "calls_per_request": round(calls / max(len(ok), 1), 2),
            "server_cpu_s_per_request": round(cpu / max(len(ok), 1), 3) if cpu else None,
            "p50_latency": round(pct(lat, 50), 3), "p95_latency": round(pct(lat, 95), 3),
            "p99_latency": round(pct(lat, 99), 3),
            "p50_ttft": round(pct(ttft, 50), 3), "p95_ttft": round(pct(ttft, 95), 3), "p99_ttft": round(pct(ttft, 99), 3),
            "mean_batch": round(sum(r["batch_size"] for r in ok) / max(len(ok), 1), 2),
            "mean_tokens": round(tokens / max(len(ok), 1), 1),
            "answers": {r["prompt"]: r["text"] for r in ok}}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model_dir: str, flags: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "engine.serve", "--model", model_dir, "--host", "127.0.0.1", "--port", str(port),
           *flags]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(url: str, proc: subprocess.Popen | None, timeout: float = 300) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"error: the server at {url} exited with status {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"error: the server at {url} was not ready after {timeout:.0f} s")


def hardware() -> str:
    from ._common import cpu_model

    return f"{cpu_model(platform.machine())}, {os.cpu_count()} logical CPUs, {platform.system()} {platform.release()}"


def loadavg() -> str:
    try:
        return " ".join(open("/proc/loadavg").read().split()[:3])
    except OSError:
        return "?"


def build_parser():
    from engine.frontend import Parser, add_threads_flag

    p = Parser(prog="python -m bench.serve_load", description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server (else one is started per --modes)")
    p.add_argument("--modes", nargs="+", choices=("continuous", "static", "serial"), default=["continuous", "static"],
                   help="servers to start and compare: continuous batching, static batching, one request at a time")
    p.add_argument("--model", default=str(REPO / "models" / "default"), help="checkpoint of the started servers")
    p.add_argument("--model-name", help="the model id to send (default: asked from /v1/models)")
    p.add_argument("--server-args", default="--method confidence --threshold 0.9 --device cpu",
                   help="decoding and device flags of the started servers")
    p.add_argument("--max-batch", type=int, default=32, help="--max-batch of the continuous and static servers")
    add_threads_flag(p, "--threads of the started servers: their torch CPU threads (default: the server's, torch's "
                        "one per core; on a busy or shared CPU fewer, often 1, can be many times faster)")
    p.add_argument("--levels", type=int, nargs="+", default=[1, 16, 64], help="client concurrencies")
    p.add_argument("--requests", type=int, help="requests per level (default: 2 x concurrency, at least 8)")
    p.add_argument("--max-tokens", type=int, nargs="+", default=[64],
                   help="max_tokens of every request; several: prompt i asks for the i-th (cyclically)")
    p.add_argument("--options", default="{}", help="decoding options sent with every request (JSON object)")
    p.add_argument("--time-limit", type=float, default=180, help="seconds per level; no new request after it")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat each level, alternating which mode goes first; figures pool the rounds")
    p.add_argument("--out", help="also write the results as JSON lines here")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        extra = json.loads(args.options)
        assert isinstance(extra, dict)
    except (ValueError, AssertionError):
        print("error: --options must be a JSON object", file=sys.stderr)
        return 2
    try:
        import httpx
    except ImportError:
        print("error: bench.serve_load needs httpx (pip install -e '.[serve,test]')", file=sys.stderr)
        return 2

    procs, servers = [], []
    try:
        servers = start_servers(args, procs)
        for mode, url, proc in servers:
            wait_ready(url, proc)
        name = args.model_name or httpx.get(servers[0][1] + "/v1/models", timeout=10).json()["data"][0]["id"]
        texts = prompts(64)
        for mode, url, _ in servers:       # warm-up: one request each, not measured
            run_level(url, name, 1, 1, args.max_tokens, extra, args.time_limit, texts)
        print_header(args, argv, extra)
        rows = measure(args, servers, name, extra, texts)
        print(f"# load average at end {loadavg()}")
        if len(servers) >= 2:              # batch invariance under load: the same prompt, the same answer
            print_invariance(rows)
        if args.out:
            write_results(args.out, rows, args, extra)
    finally:
        stop_servers(procs)
    return 0


def start_servers(args, procs: list) -> list[tuple[str, str, subprocess.Popen | None]]:
    """(mode, url, process) of the server to measure: --url, else one started per --modes (each
    process appended to `procs` as soon as it starts, for the caller to stop)."""
    if args.url:
        return [("server", args.url.rstrip("/"), None)]
    servers = []
    flags = shlex.split(args.server_args) + ([] if args.threads is None else ["--threads", str(args.threads)])
    mode_flags = {"continuous": ["--max-batch", str(args.max_batch)],
                  "static": ["--max-batch", str(args.max_batch), "--batching", "static"],
                  "serial": ["--max-batch", "1"]}
    for mode in dict.fromkeys(args.modes):
        log = Path(f"/tmp/serve_load_{mode}_{os.getpid()}.log")
        proc, url = start_server(args.model, flags + mode_flags[mode] + ["--max-queue", "1024"], log)
        procs.append(proc)
        servers.append((mode, url, proc))
    return servers


def stop_servers(procs: list) -> None:
    """Terminate the started servers; kill one that has not exited after 15 s."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()


def print_header(args, argv, extra: dict) -> None:
    """The command, the machine, the servers' settings and the table's header."""
    print(f"# {' '.join(['python -m bench.serve_load'] + (argv if argv is not None else sys.argv[1:]))}")
    print(f"# hardware: {hardware()}; load average at start {loadavg()}")
    print(f"# servers: {args.server_args} (modes {' '.join(args.modes)}; --max-batch {args.max_batch} but serial); "
          f"max_tokens {args.max_tokens}; options {json.dumps(extra)}")
    print("| mode | concurrency | requests | errors | seconds | req/s | tokens/s | p50 latency s | p95 latency s "
          "| p99 latency s | p50 TTFT s | p95 TTFT s | mean batch | model calls / request | server CPU s / request "
          "| mean tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def measure(args, servers, name: str, extra: dict, texts: list[str]) -> list[dict]:
    """Every concurrency level on every server, --rounds times (alternating which mode goes first),
    the rounds pooled; one table row printed per mode and level as it completes."""
    rows = []
    for c in args.levels:
        n = args.requests or max(8, 2 * c)
        pooled = {mode: ([], 0.0, 0, 0.0) for mode, _, _ in servers}
        for rnd in range(args.rounds):
            for mode, url, proc in (servers if rnd % 2 == 0 else servers[::-1]):
                out, wall, calls, cpu = run_level(url, name, c, n, args.max_tokens, extra, args.time_limit, texts,
                                                  proc.pid if proc is not None else None)
                o, w, k, u = pooled[mode]
                pooled[mode] = (o + out, w + wall, k + calls, u + cpu)
        for mode, _, _ in servers:
            r = {"mode": mode, "rounds": args.rounds, **summarize(c, *pooled[mode])}
            rows.append(r)
            print_row(mode, c, r)
    return rows


def print_row(mode: str, c: int, r: dict) -> None:
    print(f"| {mode} | {c} | {r['requests']} | {r['errors']} | {r['seconds']} | {r['req_per_s']} | "
          f"{r['tok_per_s']} | {r['p50_latency']} | {r['p95_latency']} | {r['p99_latency']} | "
          f"{r['p50_ttft']} | {r['p95_ttft']} | {r['mean_batch']} | {r['calls_per_request']} | "
          f"{r['server_cpu_s_per_request']} | {r['mean_tokens']} |",
          flush=True)
    if r["errors"]:
        print(f"#   first error: {r['error_sample']}", flush=True)


def print_invariance(rows: list[dict]) -> None:
    """Whether every prompt got the same answer in every mode and at every level."""
    seen, differ = {}, 0
    for r in rows:
        for i, text in r["answers"].items():
            differ += seen.setdefault(i, text) != text
    print(f"# answers per prompt identical across modes and levels: {differ == 0} "
          f"({len(seen)} prompts, {differ} differing answers)")


def write_results(path: str, rows: list[dict], args, extra: dict) -> None:
    """The rows as JSON lines (answers left out), with the machine and the request settings."""
    with open(path, "w") as f:
        for r in rows:
            r = {k: v for k, v in r.items() if k != "answers"}
            f.write(json.dumps({**r, "hardware": hardware(), "server_args": args.server_args,
                                "max_tokens": args.max_tokens, "options": extra}) + "\n")

if __name__ == "__main__":
    sys.exit(main())
