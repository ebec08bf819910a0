"""Tensor parallelism over torch.distributed (docs/distributed.md), on CPU with 2 gloo ranks.

The ranks are real processes: this file run as a script is one rank (torchrun's environment set
by hand, `_launch`), or `torchrun` itself launches `engine.generate`. Every comparison is against
the same checkpoint decoded by one process:

  * logits of the split model equal the whole model's within fp32 tolerance (llada with and
    without biases, dream with GQA and q/k/v biases, pangu with an o bias and context-causal
    attention), with and without a KV cache; dropping the all-reduce breaks the equality (so the
    comparison can fail);
  * tokens equal in float64 for every method of the table, caches none and dual (prefix for three),
    sampling with a temperature, --draft-budget auto (times differ between ranks) and
    --cross-block, with rank 0 alone running the loop and rank 1 only the model calls it sends
    (as many as rank 0 made; every cache dropped when rank 0's is);
  * engine.serve's pattern on rank 0 (streams, a stream closed early, continuous batching with a
    sequence joining a running batch, a bad request, a --cuda-graphs wrapper's stand-in) while
    rank 1 follows;
  * each rank loads only its slice; sizes that do not divide give one error line;
  * `torchrun --nproc-per-node 2 -m engine.generate` prints what the single process prints, and
    `torchrun -m engine.serve` batches two overlapping requests continuously, each answered as
    one process answers it, then stops.
"""
from __future__ import annotations

import collections
import json
import os
import pickle
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if __name__ == "__main__":                      # a rank: the repository on the path, as under pytest
    sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402
import torch  # noqa: E402

from models import CheckpointError, ModelConfig, ParallelError, TensorParallel, attention_mask, load_model, position_ids  # noqa: E402
from models.parallel import check_divisible, parameter_count_per_rank, split_dim  # noqa: E402
from models.random_checkpoint import make_checkpoint  # noqa: E402
from support import free_port, random_canvas  # noqa: E402

WORLD = 2
TIMEOUT = 600                    # seconds a launch may take before its ranks are killed (a hang, not slowness)
# (name, family, overrides): every split kind and bias the families have
MODELS = [
    ("llada", "llada", {}),
    ("llada_bias", "llada", {"qkv_bias": True, "o_bias": True, "intermediate_size": 96}),
    ("dream_gqa", "dream", {}),
    ("pangu_obias", "pangu", {}),
]
CACHES = ("none", "dual")                       # every method; prefix for a few (EXTRA)
GEN = dict(gen_length=12, block_length=4)
PROMPTS = [[5, 9, 14, 3, 22, 7], [11, 2, 40]]


# ---------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp")
    return {name: str(make_checkpoint(root / name, family, seed=3, std=0.3, eos_bias=2.0, **kw)[0])
            for name, family, kw in MODELS}


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1", **extra)
    return env


def _launch(job: dict, tmp_path: Path, world: int = WORLD) -> list:
    """Run `job` on `world` ranks (this file as a script); each rank's result, rank order. (The
    single-process references are computed after, not meanwhile: ranks in lockstep slow down
    sharply when a third busy process takes their cores.)"""
    job_file = tmp_path / f"job-{time.monotonic_ns()}.pkl"
    job_file.write_bytes(pickle.dumps(job))
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = _env(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        procs.append(subprocess.Popen([sys.executable, __file__, str(job_file)], env=env, cwd=ROOT,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    deadline = time.monotonic() + TIMEOUT
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"the {world} ranks did not finish within {TIMEOUT} s (a rank waits in a collective)")
    for rank, (p, (_, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {rank} failed:\n{err[-3000:]}"
    return [pickle.loads(Path(f"{job_file}.{rank}").read_bytes()) for rank in range(world)]


def _logits(model):
    """Logits of a whole-canvas call, and of a block call over the KV cache of the rest (dual)."""
    from models import KVCache

    cfg = model.config
    ids, valid, P = random_canvas(cfg, [9, 5], 8)
    N = ids.shape[1]
    idx = torch.arange(N)
    pos = position_ids(cfg, valid)
    with torch.no_grad():
        full, kvs = model(ids, pos, attention_mask(cfg, valid, P, P, 4, idx, idx), return_kv=True)
        blk = torch.arange(P, P + 4)
        rest = torch.cat((torch.arange(P), torch.arange(P + 4, N)))
        cache = KVCache([(k[:, :, rest], v[:, :, rest]) for k, v in kvs],
                        attention_mask(cfg, valid, P, P, 4, blk[:1], rest)[:, 0, 0])
        cached, _ = model(ids[:, blk], pos[:, blk], attention_mask(cfg, valid, P, P, 4, blk, blk), cache=cache)
    return full, cached


class _one_thread:
    """One intra-op thread inside (as the ranks run): on a loaded 2-core machine, tiny ops spread
    over threads that wait for each other take many times longer."""

    def __enter__(self):
        self.was = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.was)


@pytest.fixture(autouse=True)
def _single_thread():
    with _one_thread():
        yield


def _decode_all(model, methods, caches, extra=()):
    """{(method, cache, options): token ids per prompt, or the error's text} for every combination
    (on rank 0 of a group, its decoders send their model calls to the other ranks)."""
    from engine.config import DecodeConfig
    from engine.distributed import decoder_class
    from engine.errors import InputError

    Decoder = decoder_class()

    out = {}
    combos = [(m, c, ()) for m in methods for c in caches] + list(extra)
    for method, cache, opts in combos:
        try:
            dc = DecodeConfig(method=method, cache=cache, conf_dtype="float64", **GEN, **dict(opts)).validate()
            res = Decoder(model, dc).generate(PROMPTS)
            out[(method, cache, opts)] = [(r.token_ids, r.calls) for r in res]
        except InputError as e:                  # a combination the method refuses: the same on every rank
            out[(method, cache, opts)] = f"refused: {e}"
    return out


EXTRA = [("greedy", "prefix", ()), ("psd", "prefix", ()), ("ete", "prefix", ()),
         ("confidence", "none", (("temperature", 0.7), ("seed", 11))),
         ("psd", "dual", (("draft_budget", "auto"), ("acceptance", "exact"))),
         ("spiffy", "none", (("draft_budget", "auto"), ("depth", 3))),
         ("psd", "none", (("cross_block", True),))]


# ---------------------------------------------------------------------- one rank (this file as a script)
def _rank_main(job_file: str) -> None:
    from models.parallel import init_tensor_parallel, shutdown

    job = pickle.loads(Path(job_file).read_bytes())
    torch.set_num_threads(1)
    tp = init_tensor_parallel("cpu")
    out = {}
    if job["kind"] == "logits":
        for name, path in job["ckpts"].items():
            model = load_model(path, dtype="float32", tp=tp)
            out[name] = {"logits": _logits(model),
                         "shapes": {k: tuple(p.shape) for k, p in model.named_parameters()},
                         "params": sum(p.numel() for p in model.parameters())}
            for m in model.modules():                           # the same model without its all-reduces
                if getattr(m, "tp", None) is not None:
                    m.tp = _NoReduce(tp.rank, tp.world, tp.device)
            out[name]["unreduced"] = _logits(model)
    elif job["kind"] == "tokens":
        for name, path in job["ckpts"].items():
            model = load_model(path, dtype="float64", tp=tp)
            out[name] = _lead_or_follow(tp, model, lambda: _decode_all(model, job["methods"], CACHES, EXTRA))
    elif job["kind"] == "follow":
        out = _follow_job(job, tp)
    elif job["kind"] == "live_random":
        from engine import distributed

        model = load_model(job["ckpt"], dtype="float64", tp=tp)
        out = _lead_or_follow(tp, model, lambda: _live_runs(model, distributed.decoder_class(), job["cases"]))
    Path(f"{job_file}.{tp.rank}").write_bytes(pickle.dumps(out))
    shutdown()


class _NoReduce(TensorParallel):
    def all_reduce(self, t):
        return t


def _lead_or_follow(tp, model, work):
    """Rank 0 runs `work()` (its decoders send their calls), then ends the followers; every other
    rank runs the calls it is sent. Rank 0's result with the calls it sent; the others' calls
    run, and the caches and decoders they still held at the end (rank 0 dropped them all)."""
    import gc

    from engine import distributed

    if tp.rank != 0:
        ran = collections.Counter()
        distributed.follow(model, ran)
        return dict(ran)
    out = work()
    gc.collect()                              # decoders in reference cycles go: their ids ride on "exit"
    sent = dict(distributed._channel(tp).sent)
    distributed.stop_followers()
    distributed._channel(tp).sent.clear()
    return {"out": out, "sent": sent}


# prompts of a continuous batch: (prompt index, gen length, the step before which it joins)
LIVE_PROMPTS = [[5, 9, 14, 3, 22, 7], [11, 2, 40], [8, 30, 6, 12], [4, 17, 29, 33, 8, 2, 19, 25, 31]]
LIVE = [(0, 12, 0), (1, 8, 2), (2, 4, 5), (3, 4, 6)]     # the last: a longer prompt (the canvas widens)


def _serve_pattern(model, make):
    """engine.serve's work on rank 0, decoders from `make(model, config)`: a stream, a stream closed
    early, continuous batching (sequences joining a running batch), a bad request, more after it,
    and a --cuda-graphs wrapper (its CPU stand-in, support.EagerBackend) inside rank 0's."""
    from engine import distributed
    from engine.config import DecodeConfig
    from engine.graphs import GraphedCall
    from support import EagerBackend, run_live

    out = {}
    out["stream"] = [u.pieces for u in make(model, DecodeConfig(method="psd", cache="dual", **GEN)).stream(PROMPTS)]
    steps = make(model, DecodeConfig(method="confidence", **GEN)).stream(PROMPTS)
    out["early"] = [next(steps).pieces, next(steps).pieces]
    steps.close()                                 # a client went away: nothing to tell the followers
    live = run_live(make(model, DecodeConfig(method="psd", cache="dual", **GEN)), LIVE_PROMPTS, LIVE)
    out["live"] = ({i: r.token_ids for i, r in live.done.items()}, live.rows)
    # ETE: a longer row would widen the open block's window, so it waits for the boundary (can_join)
    ete = run_live(make(model, DecodeConfig(method="ete", cache="prefix", **GEN)), LIVE_PROMPTS,
                   [(1, 4, 0), (0, 12, 1), (2, 4, 1)])
    out["ete"] = ({i: r.token_ids for i, r in ete.done.items()}, ete.rows)
    try:                                          # a bad request: refused on rank 0 before any call
        make(model, DecodeConfig(method="greedy", **GEN)).generate([[]])
    except Exception as e:                        # noqa: BLE001
        out["bad"] = type(e).__name__
    out["after"] = [r.token_ids for r in make(model, DecodeConfig(method="topk", **GEN)).generate(PROMPTS)]
    dec = make(model, DecodeConfig(method="psd", cache="dual", static_rows=True, **GEN))
    inner = dec.cache_mode.mode if isinstance(dec.cache_mode, distributed.Announced) else dec.cache_mode
    graphed = GraphedCall(inner, EagerBackend(), max_graphs=2)
    dec.cache_mode = graphed
    distributed.lead(dec)                         # wrapped outside the graphs, as engine.graphs' docs say
    out["graphed"] = ([r.token_ids for r in dec.generate(PROMPTS)], graphed.stats["captures"])
    return out


def _live_cases(n: int, seed: int) -> list:
    """`n` random continuous batches: (options, schedule [(prompt index, gen length, step)], max rows)
    over methods whose joins differ (windows, plans, drafts) and every cache mode."""
    import random

    rnd = random.Random(seed)
    methods = [dict(method="confidence"), dict(method="psd", depth=3), dict(method="ete"), dict(method="ete", k=2),
               dict(method="psd", depth=2, cross_block=True), dict(method="psd", depth=2, draft_budget="auto")]
    out = []
    for _ in range(n):
        m = rnd.choice(methods)
        cache = "none" if m.get("cross_block") else rnd.choice(["none", "prefix", "dual"])
        sched = sorted(((i, 4 * rnd.randint(1, 4), rnd.randrange(0, 8)) for i in rnd.sample(range(len(LIVE_PROMPTS)),
                                                                                             rnd.randint(2, 4))),
                       key=lambda s: s[2])
        out.append(({**GEN, "cache": cache, **m}, sched, rnd.choice([None, 2, 3])))
    return out


def _live_runs(model, make, cases) -> list:
    """Each case's sequences' tokens (by prompt index) from a continuous batch of `make` decoders."""
    from engine.config import DecodeConfig
    from support import run_live

    return [{i: r.token_ids for i, r in run_live(make(model, DecodeConfig(**cfg)), LIVE_PROMPTS, sched,
                                                 max_rows=rows).done.items()} for cfg, sched, rows in cases]


def _follow_job(job, tp):
    from engine import distributed

    model = load_model(job["ckpt"], dtype="float64", tp=tp)
    return _lead_or_follow(tp, model, lambda: _serve_pattern(model, distributed.decoder_class()))


# ---------------------------------------------------------------------- (a) logits, (c) shapes
def test_split_model_logits_equal_the_whole_model(ckpts, tmp_path):
    ranks = _launch({"kind": "logits", "ckpts": ckpts}, tmp_path)
    for name, family, kw in MODELS:
        whole = load_model(ckpts[name], dtype="float32")
        ref_full, ref_cached = _logits(whole)
        scale = ref_full.abs().max().item()
        for rank, res in enumerate(ranks):
            full, cached = res[name]["logits"]
            assert (full - ref_full).abs().max().item() < 1e-5 * max(scale, 1), (name, rank)
            assert (cached - ref_cached).abs().max().item() < 1e-5 * max(scale, 1), (name, rank)
            assert torch.equal(full, ranks[0][name]["logits"][0]), "ranks disagree on the logits"
            unreduced = res[name]["unreduced"][0]       # the comparison catches a missing all-reduce
            assert (unreduced - ref_full).abs().max().item() > 1e-2 * scale, (name, rank)
        # each rank holds its slice only: split tensors 1/WORLD of the whole, the rest whole
        cfg = whole.config
        for k, p in whole.named_parameters():
            dim = split_dim(k)
            for res in ranks:
                got = res[name]["shapes"][k]
                want = list(p.shape)
                if dim is not None:
                    want[dim] //= WORLD
                assert list(got) == want, (name, k)
        assert ranks[0][name]["params"] == parameter_count_per_rank(cfg, WORLD) < cfg.parameter_count()


# ---------------------------------------------------------------------- (b) tokens, every method
@pytest.mark.slow
def test_split_model_decodes_the_same_tokens_for_every_method(ckpts, tmp_path):
    from engine.methods import METHODS

    methods = list(METHODS)
    use = {name: ckpts[name] for name in ("llada_bias", "dream_gqa", "pangu_obias")}
    ranks = _launch({"kind": "tokens", "ckpts": use, "methods": methods}, tmp_path)
    decoded = 0
    for name, path in use.items():
        ref = _decode_all(load_model(path, dtype="float64"), methods, CACHES, EXTRA)
        lead, follower = ranks[0][name], ranks[1][name]
        for key, want in ref.items():
            got = lead["out"][key]
            if ("draft_budget", "auto") in key[2]:   # measured times choose the drafts: calls vary, never tokens
                got, want = [t for t, _ in got], [t for t, _ in want]
            assert got == want, (name, key)
            decoded += not isinstance(want, str)
        # rank 1 ran exactly rank 0's model calls (probe calls of --draft-budget auto included), and
        # holds no cache or cache mode after rank 0 dropped its own
        assert follower["held"] == 0, (name, follower)
        assert {k: follower[k] for k in ("start", "call")} == lead["sent"], (name, follower, lead["sent"])
        assert lead["sent"]["call"] > lead["sent"]["start"] > 0
        for method in methods:                 # every method decoded under caches none and dual
            for cache in ("none", "dual"):
                runs = [v for (m, c, _), v in ref.items() if m == method and c == cache]
                assert runs and not isinstance(runs[0], str), (name, method, cache, runs)
    assert decoded >= len(use) * len(methods) * 2


def test_rank0_leads_and_the_others_follow(ckpts, tmp_path):
    """engine.serve's work on rank 0 (streams, continuous batching with rows joining open blocks,
    a bad request, a graphed cache mode) equals one process, rows per call included, and rank 1
    ran rank 0's calls only (the open block's cache widened and joined there too)."""
    from engine.loop import Decoder

    path = ckpts["llada"]
    ranks = _launch({"kind": "follow", "ckpt": path}, tmp_path)
    lead, follower = ranks[0], ranks[1]
    one = _serve_pattern(load_model(path, dtype="float64"), Decoder)
    assert lead["out"] == one
    assert lead["out"]["bad"] == "InputError" and max(one["live"][1]) == 4      # the batch held 4 sequences
    assert one["graphed"][1] > 0                                                  # graphs were captured
    assert follower.pop("held") == 0 and follower.pop("built GraphedCall") == 1, follower
    assert {k: follower.get(k, 0) for k in lead["sent"]} == lead["sent"], (follower, lead["sent"])
    assert lead["sent"].get("joined", 0) > 0 and lead["sent"].get("widen", 0) > 0   # rows joined open blocks


def test_random_continuous_batches_under_tensor_parallelism(ckpts, tmp_path):
    """Rows joining open blocks under tensor parallelism (the block's cache widened and joined on
    every rank), over random schedules of mixed lengths, methods and caches: every sequence's tokens
    equal one process's, and rank 1 ran exactly the messages rank 0 sent."""
    from engine.loop import Decoder

    cases = _live_cases(12, seed=13)
    path = ckpts["llada"]
    lead, follower = _launch({"kind": "live_random", "ckpt": path, "cases": cases}, tmp_path)
    assert lead["out"] == _live_runs(load_model(path, dtype="float64"), Decoder, cases)
    assert follower.pop("held") == 0
    assert {k: follower.get(k, 0) for k in lead["sent"]} == lead["sent"], (follower, lead["sent"])
    assert lead["sent"].get("joined", 0) > 0 and lead["sent"].get("widen", 0) > 0


# ---------------------------------------------------------------------- (c) sharded loading, in one process
def test_each_rank_reads_only_its_slice(ckpts, monkeypatch):
    """Loading for rank r of 2 needs no process group: the slices concatenate to the whole
    tensors, and no split tensor is ever read whole (safetensors get_tensor)."""
    import models.checkpoint as ck

    opened = ck._safe_open
    whole_reads = []

    class Spy:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            whole_reads.append(name)
            return self.f.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self.f, name)

    monkeypatch.setattr(ck, "_safe_open", lambda f: Spy(opened(f)))
    path = ckpts["pangu_obias"]
    whole = dict(load_model(path).named_parameters())
    whole_reads.clear()
    parts = [dict(load_model(path, tp=TensorParallel(rank, WORLD)).named_parameters()) for rank in range(WORLD)]
    names = ck.checkpoint_names(ModelConfig.from_dir(path))
    split = {names[k] for k in whole if split_dim(k) is not None}
    assert split and not split & set(whole_reads)
    for k, w in whole.items():
        dim = split_dim(k)
        got = torch.cat([p[k] for p in parts], dim) if dim is not None else parts[1][k]
        assert torch.equal(got, w), k


def test_sizes_that_do_not_divide_are_one_error_line(tmp_path):
    path, _ = make_checkpoint(tmp_path / "odd", "dream", num_heads=6, num_kv_heads=3, head_dim=16)
    with pytest.raises(ParallelError) as e:
        load_model(path, tp=TensorParallel(0, WORLD))
    msg = str(e.value)
    assert "\n" not in msg and "num_kv_heads 3" in msg and "num_heads 6" not in msg
    assert isinstance(e.value, CheckpointError)
    with pytest.raises(ParallelError, match="intermediate_size 5"):
        check_divisible(ModelConfig.tiny("llada", intermediate_size=5), WORLD)
    check_divisible(ModelConfig.tiny("llada", intermediate_size=5), 1)


def test_launch_errors_are_one_line(tmp_path, ckpts):
    """WORLD_SIZE without RANK, and a fixed cuda:N for every rank: one `error:` line, exit 2."""
    cases = [({"WORLD_SIZE": "2"}, ["--device", "cpu"], "RANK"),
             ({"WORLD_SIZE": "2", "RANK": "0"}, ["--device", "cuda:1"], "cuda:LOCAL_RANK")]
    for env, argv, msg in cases:
        p = subprocess.run([sys.executable, "-m", "engine.generate", "--model", ckpts["llada"], "t1 t2", *argv],
                           cwd=ROOT, env=_env(**env), capture_output=True, text=True, timeout=120)
        assert p.returncode == 2, p.stderr
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and msg in lines[0], p.stderr


# ---------------------------------------------------------------------- (d) torchrun end to end
def _torchrun(argv, nproc=WORLD):
    exe = shutil.which("torchrun")
    launcher = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    return subprocess.run([*launcher, "--standalone", f"--nproc-per-node={nproc}", "-m", "engine.generate", *argv],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)


def _without_seconds(stdout: str) -> list[str]:
    return [line.split(" seconds=")[0] for line in stdout.splitlines()]


@pytest.mark.slow
def test_torchrun_generate_prints_what_one_process_prints(ckpts, tmp_path):
    argv = ["--model", ckpts["dream_gqa"], "--dtype", "float64", "--device", "cpu", "--method", "psd",
            "--cache", "dual", "--gen-length", "12", "--block-length", "4", "--prompt-file", "-"]
    prompt = "t5 t9 t14 t3"
    one = subprocess.run([sys.executable, "-m", "engine.generate", *argv], input=prompt, cwd=ROOT, env=_env(),
                         capture_output=True, text=True, timeout=120)
    assert one.returncode == 0, one.stderr
    exe = shutil.which("torchrun")
    launcher = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    two = subprocess.run([*launcher, "--standalone", f"--nproc-per-node={WORLD}", "-m", "engine.generate", *argv],
                         input=prompt, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=TIMEOUT)
    assert two.returncode == 0, two.stderr[-3000:]
    assert _without_seconds(two.stdout) == _without_seconds(one.stdout)     # printed once: by rank 0
    assert len(one.stdout.splitlines()) == 2 and one.stdout.split()[0]


def test_torchrun_refuses_a_model_that_does_not_split(tmp_path):
    path, _ = make_checkpoint(tmp_path / "odd", "dream", num_heads=6, num_kv_heads=3, head_dim=16)
    p = _torchrun(["--model", str(path), "--device", "cpu", "t1 t2"])
    assert p.returncode != 0
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "num_kv_heads 3" in errors[0] and "divisible by 2" in errors[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr.split("error:")[0]          # (torchrun's own report follows it)
    assert "exitcode: 2" in p.stderr and "terminate called" not in p.stderr, p.stderr[-3000:]

    # rank 0 made slow (a plugin every rank imports first): rank 1 fails first, and its launch must
    # not stop rank 0 before rank 0's error line is out (a flake on a loaded machine)
    (tmp_path / "slow_leader.py").write_text("import os, time\nif os.environ.get('RANK') == '0':\n    time.sleep(3)\n")
    p = _torchrun(["--plugin", str(tmp_path / "slow_leader.py"), "--model", str(path), "--device", "cpu", "t1 t2"])
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert p.returncode != 0 and len(errors) == 1 and "num_kv_heads 3" in errors[0], p.stderr[-3000:]


def _fails(message: str, code: int = 2):
    def command():
        print("output", flush=True)
        print(message, file=sys.stderr)
        return code
    return command


def test_a_failed_follower_waits_for_rank_0_then_prints_its_own_error(monkeypatch, capsys):
    from engine import distributed

    monkeypatch.setattr(distributed, "FOLLOWER_GRACE_S", 0.4)
    monkeypatch.setenv("RANK", "0")
    assert distributed.leader_prints(_fails("error: bad")) == 2
    assert capsys.readouterr() == ("output\n", "error: bad\n")          # rank 0: as it is, at once
    monkeypatch.setenv("RANK", "1")
    t0 = time.perf_counter()
    assert distributed.leader_prints(_fails("error: shard 1 unreadable")) == 2
    assert time.perf_counter() - t0 >= 0.4                               # time for rank 0's line first
    assert capsys.readouterr() == ("", "error: rank 1: shard 1 unreadable\n")
    monkeypatch.setattr(distributed, "FOLLOWER_GRACE_S", 30.0)
    t0 = time.perf_counter()
    assert distributed.leader_prints(_fails("a warning", code=0)) == 0
    assert time.perf_counter() - t0 < 10 and capsys.readouterr() == ("", "")       # success: silent, no wait


def test_a_follower_usage_error_is_held_then_one_line(monkeypatch, capsys):
    from engine import cli, distributed

    monkeypatch.setattr(distributed, "FOLLOWER_GRACE_S", 0.0)
    monkeypatch.setenv("RANK", "1")
    assert distributed.leader_prints(cli._command, ["--no-such-flag"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: rank 1: ") and "--no-such-flag" in err and err.count("\n") == 1


if __name__ == "__main__":
    _rank_main(sys.argv[1])


@pytest.mark.slow
def test_torchrun_serve_batches_continuously_as_one_process_answers(ckpts, tmp_path):
    """`torchrun -m engine.serve` (continuous batching, the default): rank 0 serves HTTP and runs
    the loop, rank 1 runs its model calls. A short request sent while a long one decodes joins
    its batch and is answered first; each answer (and a streamed one) equals engine.generate in
    one process; the launch stops when told."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    import threading

    from engine import generate
    from models import Tokenizer, load_model

    path, port = ckpts["llada"], free_port()
    exe = shutil.which("torchrun")
    launcher = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([*launcher, "--standalone", f"--nproc-per-node={WORLD}", "-m", "engine.serve", "--model",
                             path, "--port", str(port), "--device", "cpu", "--dtype", "float64", "--ignore-eos"],
                            cwd=ROOT, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    base = {"model": Path(path).name, "method": "greedy", "block_length": 4}
    asks = {"long": {**base, "prompt": "t5 t9 t14 t3", "max_tokens": 64},
            "short": {**base, "prompt": "t7 t2", "max_tokens": 8},
            "psd": {**base, "prompt": "t5 t9 t14 t3", "max_tokens": 8, "method": "psd"}}
    answers, order = {}, []

    def ask(name):
        answers[name] = httpx.post(url + "/v1/completions", json=asks[name], timeout=TIMEOUT).json()
        order.append(name)

    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(url + "/health", timeout=5).json().get("status") == "ok":
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        long = threading.Thread(target=ask, args=("long",))
        long.start()
        while httpx.get(url + "/health", timeout=10).json()["running"] < 1:      # the long one decodes
            assert time.monotonic() < deadline and long.is_alive(), "the long request never started"
            time.sleep(0.01)
        ask("short")
        long.join(TIMEOUT)
        ask("psd")
        streamed = []
        with httpx.stream("POST", url + "/v1/completions", json={**asks["psd"], "stream": True}, timeout=TIMEOUT) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed.append(json.loads(line[6:])["choices"][0]["text"])
    finally:
        proc.terminate()
        proc.wait(60)                        # both ranks stop (a hang fails here)
    assert order[:2] == ["short", "long"], (order, answers)
    assert answers["short"]["usage"]["batch_size"] == 2, answers["short"]      # it joined the long one's batch
    tok, model = Tokenizer(path), load_model(path, dtype="float64")
    for name, body in asks.items():
        res = generate(model, [tok.encode(body["prompt"])], method=body["method"], gen_length=body["max_tokens"],
                       block_length=4, ignore_eos=True)[0]
        assert answers[name]["choices"][0]["text"] == tok.decode(res.token_ids), name
    assert "".join(streamed) == answers["psd"]["choices"][0]["text"]
