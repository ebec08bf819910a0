"""Continuous against static batching in one process, without HTTP (docs/serve.md, "In one process").

    python -m bench.serve_sim [--clients 16 64] [--cache none dual] [--max-tokens 64 32] [--rounds 2]

The same closed loop as `bench.serve_load`, with the schedulers' decoding and none of the server:
`--clients` requests are in flight at once and each one that ends is replaced by the next (prompt i
of the held-out math questions asks for the i-th of `--max-tokens`, cyclically). *continuous*: as
the server's default, one `engine.live.LiveBatch` (at most `--max-batch` rows) that requests of every
length join between two model calls; *by-length* (`--modes ... by-length`): as the server with
`--batch-by-length`, a `LiveBatch` per generation length, taking turns one call each, at most
`--max-batch` rows in all; *one-cursor* (`--modes ... one-cursor`): continuous with every row of a
running batch on one block cursor (`LiveBatch(rolling=False)`: where the cache mode lets rows roll,
what rolling rows gain, docs/loop.md);
*static*: as `--batching static`, the first waiting request and every waiting one of its length (up
to `--max-batch`) decoded together from start to end (`Decoder.stream`); *serial* (`--modes ...
serial`): one request at a time, which computes each request's own columns only (no padding at
all: the floor of the token-columns a scheduler can reach). Per cache mode and client
count, the modes run one after the other, alternating which goes first each round, on one model, so
both see the same machine; rounds are pooled. Reported per cell: requests/s by wall time and by the
process's CPU time (one thread: on a shared machine CPU time leaves the neighbours out), p50 latency
and time to first token (the first model call that makes one of its tokens final), model calls and
token-columns computed per request (rows × columns of every forward pass, or its real positions where
it runs on those only, `--unpad`: what a CPU pays for), and
whether every request's tokens are equal across modes. The last line is one JSON object.
"""
from __future__ import annotations

import collections
import cProfile
import json
import pstats
import sys
import time

from engine import DecodeConfig, Decoder
from engine.frontend import DEFAULT_MODEL_DIR, DTYPE_CHOICES, Parser, add_threads_flag, guarded, set_threads, thread_count
from engine.live import LiveBatch
from models import CheckpointError, Tokenizer, load_model

from ._common import versions
from .eval import parse_method
from .serve_load import pct, prompts

MODES = ("continuous", "static", "serial", "by-length", "one-cursor")


class Meter:
    """Counts the model's forward passes and the token-columns they compute."""

    def __init__(self, model):
        self.calls = self.columns = self.rows = 0
        self.held = 0              # sequences the calling batch held, summed over calls (the schedulers add it)
        forward = model.forward

        def counted(ids, *a, **k):
            self.calls += 1
            self.rows += ids.shape[0]
            real = k.get("tokens")          # a call on its real positions only (models.Tokens): those
            self.columns += ids.shape[0] * ids.shape[1] if real is None else real.index.numel()
            return forward(ids, *a, **k)

        model.forward = counted


class Load:
    """The closed loop's requests: request i is prompt i % len(ids) with its max_tokens."""

    def __init__(self, ids: list[list[int]], max_tokens: list[int], block: int, total: int):
        self.ids, self.max_tokens, self.block, self.total = ids, max_tokens, block, total

    def request(self, i: int) -> tuple[list[int], int, int]:
        """(prompt ids, gen length, max tokens) of request i (the server's gen length: max_tokens
        rounded up to the block)."""
        mt = self.max_tokens[(i % len(self.ids)) % len(self.max_tokens)]
        return self.ids[i % len(self.ids)], -(-mt // self.block) * self.block, mt


def run_continuous(dec_for, load: Load, clients: int, max_batch: int, by_length: bool = False,
                   meter: Meter | None = None, rolling: bool | None = None) -> dict:
    """As the server's continuous scheduler: one running `LiveBatch` for every length (with
    `by_length`, --batch-by-length: one per generation length, taking turns one model call each); at
    most `max_batch` rows in all of them, a request beyond that waiting (oldest first) for a row."""
    lives: dict[int, LiveBatch] = {}
    turn: collections.deque = collections.deque()
    queue: collections.deque = collections.deque()         # (request index, submitted at)
    info, out, nxt = {}, {}, 0

    def admit():
        while queue and sum(lv.rows_held for lv in lives.values()) < max_batch:
            i, t = queue.popleft()
            p, g, mt = load.request(i)
            key = g if by_length else 0
            if key not in lives:
                lives[key] = LiveBatch(dec_for(g if by_length else None), max_rows=max_batch, rolling=rolling)
                turn.append(key)
            info[key, lives[key].add(p, g)] = [i, mt, t, None]

    nxt = min(clients, load.total)
    queue.extend((i, time.perf_counter()) for i in range(nxt))
    admit()
    while turn:
        key = turn[0]
        turn.rotate(-1)
        u = lives[key].step()
        if u is None:                                      # idle: its batch goes
            del lives[key]
            turn.remove(key)
            admit()
            continue
        if meter is not None:
            meter.held += u.rows                           # the batch's sequences during this call
        now = time.perf_counter()
        for h in u.pieces:
            info[key, h][3] = now if info[key, h][3] is None else info[key, h][3]
        for h, res in u.done.items():
            i, mt, t, first = info.pop((key, h))
            out[i] = (res.token_ids[:mt], now - t, (first or now) - t)
            if nxt < load.total:
                queue.append((nxt, time.perf_counter()))
                nxt += 1
        admit()
    return out


def run_static(dec_for, load: Load, clients: int, max_batch: int, meter: Meter | None = None) -> dict:
    out, waiting, nxt = {}, [], 0
    for _ in range(min(clients, load.total)):
        waiting.append((nxt, time.perf_counter()))
        nxt += 1
    while waiting:
        g = load.request(waiting[0][0])[1]
        batch = [w for w in waiting if load.request(w[0])[1] == g][:max_batch]
        waiting = [w for w in waiting if w not in batch]
        first = [None] * len(batch)
        calls = meter.calls if meter is not None else 0
        for u in dec_for(g).stream([load.request(i)[0] for i, _ in batch]):
            now = time.perf_counter()
            first = [f if f is not None or not piece else now for f, piece in zip(first, u.pieces)]
            if u.results is not None:
                for (i, t), res, f in zip(batch, u.results, first):
                    out[i] = (res.token_ids[:load.request(i)[2]], now - t, (f or now) - t)
                    if nxt < load.total:
                        waiting.append((nxt, time.perf_counter()))
                        nxt += 1
        if meter is not None:              # every sequence of a static batch holds its row to the end
            meter.held += len(batch) * (meter.calls - calls)
    return out


def measure(mode: str, model, meter: Meter, config: dict, load: Load, clients: int, max_batch: int,
            profile: bool = False) -> dict:
    """One mode's run of the closed loop; `profile`: under cProfile (its stats in "profile")."""
    prof = cProfile.Profile() if profile else None
    if prof is not None:
        prof.enable()
    try:
        return _measure(mode, model, meter, config, load, clients, max_batch) | {"profile": prof}
    finally:
        if prof is not None:
            prof.disable()


def _measure(mode: str, model, meter: Meter, config: dict, load: Load, clients: int, max_batch: int) -> dict:
    max_batch = 1 if mode == "serial" else max_batch
    meter.calls = meter.columns = meter.rows = meter.held = 0
    t0, c0 = time.perf_counter(), time.process_time()
    decs = {}
    dec_for = lambda g: decs.setdefault(g, Decoder(model, DecodeConfig(**config) if g is None else  # noqa: E731
                                                   DecodeConfig(**{**config, "gen_length": g})))
    if mode in ("continuous", "by-length", "one-cursor"):
        out = run_continuous(dec_for, load, clients, max_batch, by_length=mode == "by-length", meter=meter,
                             rolling=False if mode == "one-cursor" else None)
    else:
        out = run_static(dec_for, load, clients, max_batch, meter=meter)
    return {"wall": time.perf_counter() - t0, "cpu": time.process_time() - c0, "calls": meter.calls,
            "columns": meter.columns, "rows": meter.rows, "held": meter.held, "out": out}


def summary(runs: list[dict]) -> dict:
    n = sum(len(r["out"]) for r in runs)
    lat = [v[1] for r in runs for v in r["out"].values()]
    ttft = [v[2] for r in runs for v in r["out"].values()]
    wall, cpu = sum(r["wall"] for r in runs), sum(r["cpu"] for r in runs)
    return {"requests": n, "req_s": n / wall, "req_cpu_s": n / cpu, "p50_latency": pct(lat, 50),
            "p50_ttft": pct(ttft, 50), "p10_ttft": pct(ttft, 10), "p90_ttft": pct(ttft, 90),
            "mean_ttft": sum(ttft) / max(len(ttft), 1), "calls_per_request": sum(r["calls"] for r in runs) / n,
            "columns_per_request": sum(r["columns"] for r in runs) / n,
            "rows_per_call": sum(r["rows"] for r in runs) / max(1, sum(r["calls"] for r in runs)),
            "held_per_call": sum(r["held"] for r in runs) / max(1, sum(r["calls"] for r in runs))}


def run(args) -> int:
    args.threads = args.threads or 1
    set_threads(args.threads)     # and the C allocator, as engine.generate
    tok = Tokenizer(args.model)
    model = load_model(args.model, args.dtype, "cpu")
    model.unpad = {"auto": None, "on": True, "off": False}[args.unpad]
    meter = Meter(model)
    name, opts = parse_method(args.method)
    rows = []
    for cache in args.cache:
        config = {"method": name, "cache": cache, "block_length": args.block_length, **opts}
        DecodeConfig(**config)                                              # a bad option: one line, now
        load = Load([tok.encode(t) for t in prompts(64)], args.max_tokens, args.block_length, 0)
        for clients in args.clients:
            load.total = args.requests or max(16, 2 * clients)
            runs = {m: [] for m in args.modes}
            for r in range(args.rounds):
                for mode in (args.modes if r % 2 == 0 else args.modes[::-1]):
                    runs[mode].append(measure(mode, model, meter, config, load, clients, args.max_batch,
                                              profile=bool(args.profile)))
            if args.profile:
                print_profile(cache, clients, runs, args.profile)
            first = runs[args.modes[0]]
            same = all(a["out"][i][0] == b["out"][i][0] for m in args.modes for a, b in zip(first, runs[m])
                       for i in a["out"])
            cell = {m: summary(runs[m]) for m in args.modes}
            rows.append({"cache": cache, "clients": clients, "identical": same, **cell,
                         "ratio_req_s": cell["continuous"]["req_s"] / cell["static"]["req_s"],
                         "ratio_req_cpu_s": cell["continuous"]["req_cpu_s"] / cell["static"]["req_cpu_s"],
                         "ratio_p50_ttft": cell["continuous"]["p50_ttft"] / cell["static"]["p50_ttft"]})
    print_table(rows, args.modes)
    print(json.dumps({"method": args.method, "max_tokens": args.max_tokens, "max_batch": args.max_batch,
                      "unpad": args.unpad,
                      "rounds": args.rounds, "threads": args.threads, "dtype": args.dtype, **versions(),
                      "rows": rows}))
    return 0


def print_profile(cache: str, clients: int, runs: dict, top: int) -> None:
    """Per mode, the `top` functions by their own time (cProfile, the rounds pooled): where one
    scheduler's time per request goes that the other's does not."""
    for mode, rs in runs.items():
        stats = pstats.Stats(rs[0]["profile"])
        for r in rs[1:]:
            stats.add(r["profile"])
        n = sum(len(r["out"]) for r in rs)
        print(f"profile: cache {cache}, {clients} clients, {mode}, {n} requests, "
              f"{stats.total_tt:.2f} s under the profiler\n| function | calls | own s | own ms / request |\n|---|---|---|---|")
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]
        for where, (_, ncalls, own, _, _) in rows:
            print(f"| `{function_name(*where)}` | {ncalls} | {own:.3f} | {1e3 * own / max(n, 1):.2f} |")


def function_name(file: str, line: int, fn: str) -> str:
    """A cProfile entry as `folder/module.py:line(function)`; a built-in as its name; a file with no
    folder (`<frozen importlib._bootstrap>`) as it is."""
    return fn if file == "~" else f"{'/'.join(file.split('/')[-2:])}:{line}({fn})"


def print_table(rows: list[dict], modes) -> None:
    print("| cache | clients | mode | requests | req/s | req/CPU s | p50 latency s | p50 TTFT s | TTFT p10 / p90 s "
          "| mean TTFT s | calls / request | token-columns / request | canvases / call | sequences held / call |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        for m in modes:
            s = r[m]
            print(f"| {r['cache']} | {r['clients']} | {m} | {s['requests']} | {s['req_s']:.2f} | {s['req_cpu_s']:.2f} | "
                  f"{s['p50_latency']:.3f} | {s['p50_ttft']:.3f} | {s['p10_ttft']:.2f} / {s['p90_ttft']:.2f} | "
                  f"{s['mean_ttft']:.3f} | {s['calls_per_request']:.2f} | "
                  f"{s['columns_per_request']:.0f} | {s['rows_per_call']:.1f} | {s['held_per_call']:.1f} |")
    for r in rows:
        print(f"cache {r['cache']}, {r['clients']} clients: continuous ÷ static req/s {r['ratio_req_s']:.2f} "
              f"(by CPU time {r['ratio_req_cpu_s']:.2f}), p50 TTFT {r['ratio_p50_ttft']:.2f}; "
              f"answers identical: {'yes' if r['identical'] else 'NO'}")


def main(argv=None) -> int:
    p = Parser(prog="python -m bench.serve_sim", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--method", default="confidence:threshold=0.9", help="method[:option=value,...] as bench.eval")
    p.add_argument("--modes", nargs="+", default=list(MODES[:2]), choices=MODES,
                   help="schedulers to compare (continuous and static are required: the ratios are theirs)")
    p.add_argument("--cache", nargs="+", default=["none", "dual"], choices=("none", "prefix", "dual"))
    p.add_argument("--clients", nargs="+", type=thread_count, default=[16, 64])
    p.add_argument("--requests", type=thread_count, help="requests per cell and round (default 2 x clients, >= 16)")
    p.add_argument("--max-tokens", nargs="+", type=thread_count, default=[64, 32])
    p.add_argument("--max-batch", type=thread_count, default=32)
    p.add_argument("--block-length", type=thread_count, default=32)
    p.add_argument("--rounds", type=thread_count, default=2)
    p.add_argument("--unpad", default="auto", choices=("auto", "on", "off"),
                   help="whole-canvas calls on real positions only (Transformer.unpads; auto: on a CPU)")
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    add_threads_flag(p, "torch CPU threads (default 1: CPU time then measures one core)")
    p.add_argument("--profile", type=thread_count, metavar="N",
                   help="run each mode under cProfile and print its N functions with the most own time per cell "
                        "(the profiler adds its own overhead: compare modes with each other, not with unprofiled runs)")
    args = p.parse_args(argv)
    if not {"continuous", "static"} <= set(args.modes):
        p.error("--modes needs continuous and static (the ratios are theirs)")
    return guarded(lambda: run(args), errors=(CheckpointError, ValueError, OSError))


if __name__ == "__main__":
    sys.exit(main())
