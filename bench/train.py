"""Train the default checkpoint: a small LLaDA-layout masked-diffusion LM on the procedural suites.

    python -m bench.train --out models/default --minutes 100 [--resume]

One seeded, reproducible script (issue #5):

* a byte-level BPE tokenizer (digits split one per token, small vocabulary, special tokens
  `<|eos|>` and `<|mask|>`) trained on generated text of the `math` and `code` suites;
* a LLaDA-family `ModelConfig` (bidirectional attention, no biases, absolute positions);
* masked-diffusion SFT as in LLaDA: canvas = left-padded prompt + an answer region of
  `--answer-len` tokens (the answer, then EOS up to the end); prompts are never masked; per
  sequence t ~ stratified U(eps, 1); every answer-region token is masked with probability t;
  cross-entropy on masked tokens weighted 1/t and normalised by the answer-region length;
* fresh problems every step from each suite's `generate_train(n, seed)` (seeded by step, so a
  resumed run sees the same stream), `--math-frac` of each batch math (default 0.5),
  `--drill-frac` arithmetic drills (`bench.tasks.math.generate_drill`: the equations of fresh
  math problems, 3-4 per item; default 0), the rest code;
* AdamW, linear warm-up + cosine decay (`--restart-schedule` plans a fresh segment on resume),
  gradient clipping, bf16 autocast on CPU (AMX) or CUDA;
* the resumable state (model, optimiser, step, schedule, RNG states) lives in `--state-dir`
  (default `~/.cache/psd-engine/train_runs/<name of --out>`), never in the shipped directory; at the end (and
  at every checkpoint) the weights are exported to `--out` with `models.save_checkpoint`.

Loss is logged to stdout and `<state-dir>/log.csv`.
"""
from __future__ import annotations

import csv
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.frontend import Parser, threads_value
from models.checkpoint import save_checkpoint
from models.config import ModelConfig
from models.transformer import Transformer, attention_mask, position_ids

EOS, MASK = "<|eos|>", "<|mask|>"
SUITES = ("math", "code")
FRESH_SCHEDULE = {"lr": 1e-3, "warmup": 100}   # peak lr and warm-up of a run that is not resumed


# ---------------------------------------------------------------------- data
def _task(name):
    from bench.tasks import get_task

    return get_task(name)


def problems(suite: str, n: int, seed: int) -> list[dict]:
    """`n` fresh training problems of one suite (disjoint from its held-out file), seeded."""
    return _task(suite).generate_train(n, seed) if n > 0 else []


def drills(n: int, seed: int) -> list[dict]:
    """`n` arithmetic drills (the suite's own equations, see `bench.tasks.math.generate_drill`), seeded."""
    from bench.tasks import math as math_suite

    return math_suite.generate_drill(n, seed) if n > 0 else []


def pair(suite: str, p: dict) -> tuple[str, str]:
    """(prompt text, answer text): the training text is their concatenation."""
    return _task(suite).format_prompt(p), p["answer"]


def corpus(n_per_suite: int, seed: int) -> list[str]:
    out = []
    for s in SUITES:
        for p in problems(s, n_per_suite, seed):
            a, b = pair(s, p)
            out += [a, b, a + b]
    return out


# ---------------------------------------------------------------------- tokenizer
def build_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE; digits are pre-split one per token; special tokens get ids 0 (EOS) and 1 (mask)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, MASK], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer_files(tok, out: Path, max_length: int, gen_length: int = 64) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    eos, mask = tok.token_to_id(EOS), tok.token_to_id(MASK)
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS, "mask_token": MASK, "pad_token": EOS,
        "model_max_length": max_length, "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(eos): {"content": EOS, "special": True}, str(mask): {"content": MASK, "special": True}},
    }, indent=2), encoding="utf-8")
    (out / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": eos, "pad_token_id": eos, "mask_token_id": mask,
         # the canvas the model was trained on: python -m engine.generate uses these by default
         "gen_length": gen_length, "block_length": min(32, gen_length)}, indent=2), encoding="utf-8")


# ---------------------------------------------------------------------- model
def make_config(tok, args) -> ModelConfig:
    V = tok.get_vocab_size(with_added_tokens=True)
    V = (V + 63) // 64 * 64      # embedding rows rounded up (LLaDA's embedding_size may exceed the tokenizer)
    eos = tok.token_to_id(EOS)
    return ModelConfig(
        family="llada", model_type="llada", vocab_size=V, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.heads, head_dim=args.hidden // args.heads,
        rope_theta=10000.0, rms_eps=1e-5, max_length=args.max_length, mask_token_id=tok.token_to_id(MASK),
        eos_token_id=eos, pad_token_id=eos,
    )


def init_model(config: ModelConfig, seed: int) -> Transformer:
    """GPT-2-style init: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * layers)."""
    torch.manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
                p.normal_(0.0, 0.02 / math.sqrt(2 * config.num_layers))
            else:
                p.normal_(0.0, 0.02)
    return model


# ---------------------------------------------------------------------- batches and loss
def encode_pairs(tok, pairs: list[tuple[str, str]], answer_len: int, eos: int):
    """[(prompt ids, answer ids + EOS padding to answer_len)], skipping answers longer than answer_len - 1."""
    out = []
    for prompt, answer in pairs:
        p, a = tok.encode(prompt).ids, tok.encode(answer).ids
        if len(a) >= answer_len:          # keep room for at least one EOS
            continue
        out.append((p, a + [eos] * (answer_len - len(a))))
    return out


def collate(examples, pad_id: int):
    """Canvas like the engine's: prompts left-padded to the longest, then the answer region.

    Returns ids [B, N], valid [B, N] (False at padding), P (padded prompt length)."""
    P = max(len(p) for p, _ in examples)
    P = -(-P // 8) * 8                   # a few distinct shapes only (the CPU kernels are built per shape)
    A = len(examples[0][1])
    B = len(examples)
    ids = torch.full((B, P + A), pad_id, dtype=torch.long)
    valid = torch.ones(B, P + A, dtype=torch.bool)
    for b, (p, a) in enumerate(examples):
        ids[b, P - len(p):P] = torch.tensor(p, dtype=torch.long)
        ids[b, P:] = torch.tensor(a, dtype=torch.long)
        valid[b, :P - len(p)] = False
    return ids, valid, P


def sample_t(B: int, eps: float, gen: torch.Generator) -> torch.Tensor:
    """Stratified t ~ U(eps, 1): one sample per stratum [i/B, (i+1)/B), shuffled."""
    u = (torch.arange(B, dtype=torch.float32) + torch.rand(B, generator=gen)) / B
    return eps + (1 - eps) * u[torch.randperm(B, generator=gen)]


def canvas_logits(model: Transformer, x, valid, P: int, autocast: bool = False):
    """Logits [B, N, V] of a training canvas (`collate`'s layout: prompts left-padded to P, then
    the answer region) in one bidirectional call; x, valid on the model's device."""
    N = x.shape[1]
    idx = torch.arange(N, device=x.device)
    am = attention_mask(model.config, valid, P, P, N - P, idx, idx)
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits, _ = model(x, position_ids(model.config, valid), am)
    return logits


def diffusion_loss(model: Transformer, ids, valid, P: int, gen: torch.Generator, eps: float = 1e-3,
                   autocast: bool = False):
    """LLaDA SFT loss. Only answer-region positions (index >= P) can be masked.

    Returns (loss, info) with info = {"t", "masked" (bool [B, N])}."""
    config = model.config
    B, N = ids.shape
    dev = model.device
    t = sample_t(B, eps, gen)
    is_answer = torch.zeros(B, N, dtype=torch.bool)
    is_answer[:, P:] = True
    masked = (torch.rand(B, N, generator=gen) < t[:, None]) & is_answer
    ids, valid, masked, t = ids.to(dev), valid.to(dev), masked.to(dev), t.to(dev)
    x = torch.where(masked, torch.full_like(ids, config.mask_token_id), ids)
    logits = canvas_logits(model, x, valid, P, autocast)
    ce = F.cross_entropy(logits.float().reshape(B * N, -1), ids.reshape(-1), reduction="none").view(B, N)
    w = masked.float() / t[:, None]
    loss = (ce * w).sum() / (B * (N - P))
    return loss, {"t": t, "masked": masked}


# ---------------------------------------------------------------------- schedule and state
def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * frac)))


def step_batch(tok, step: int, args, eos: int):
    """The training batch of `step` (depends only on the seed and the step)."""
    n_math = round(args.batch * args.math_frac)
    n_drill = min(round(args.batch * args.drill_frac), args.batch - n_math)
    seed = args.seed * 1_000_003 + step
    pairs = [pair("math", p) for p in problems("math", n_math, seed)]
    pairs += [pair("math", p) for p in drills(n_drill, seed)]
    pairs += [pair("code", p) for p in problems("code", args.batch - n_math - n_drill, seed)]
    random.Random(seed).shuffle(pairs)
    return collate(encode_pairs(tok, pairs, args.answer_len, eos), eos)


def save_state(path: Path, model, opt, step: int, total: int, args, extra: dict) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "total_steps": total,
                "args": vars(args), "config": model.config.to_hf(), "torch_rng": torch.get_rng_state(),
                "py_rng": random.getstate(), **extra}, tmp)
    os.replace(tmp, path)


def export(model: Transformer, tok, out: Path, max_length: int, dtype: torch.dtype | None = None,
           gen_length: int = 64) -> None:
    save_checkpoint(model, out, dtype=dtype)
    save_tokenizer_files(tok, out, max_length, gen_length)
    write_sample_prompt(out)


def write_sample_prompt(out: Path) -> None:
    """The question `python -m engine.generate` answers when given no prompt: the first problem
    of the held-out math file, formatted exactly as in evaluation."""
    from bench.tasks import get_task

    task = get_task("math")
    (out / "sample_prompt.txt").write_text(task.format_prompt(task.load(limit=1)[0]), encoding="utf-8")


# ---------------------------------------------------------------------- main
def build_parser():
    p = Parser(prog="python -m bench.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", default="models/default", help="export directory (shipped weights + tokenizer)")
    p.add_argument("--state-dir", help="resumable training state + logs (default ~/.cache/psd-engine/train_runs/<out name>)")
    p.add_argument("--minutes", type=float, default=100.0, help="wall-clock budget of this invocation")
    p.add_argument("--steps", type=int, help="total optimiser steps of the schedule (default: estimated from --minutes)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--restart-schedule", action="store_true",
                   help="with --resume: plan a fresh warm-up + cosine segment from the resumed step to the new end "
                        "(instead of continuing the saved one; --lr is its peak)")
    p.add_argument("--math-frac", type=float, default=0.5, help="share of math problems in each batch (rest: code)")
    p.add_argument("--drill-frac", type=float, default=0.0,
                   help="share of arithmetic drills in each batch (taken from the non-math share; rest: code)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--answer-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate (default {FRESH_SCHEDULE['lr']:g}; with --resume, the saved run's)")
    p.add_argument("--warmup", type=int, default=None,
                   help=f"warm-up steps (default {FRESH_SCHEDULE['warmup']}; with --resume, the saved run's)")
    p.add_argument("--wd", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--eps", type=float, default=1e-3)
    p.add_argument("--ckpt-every", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--threads", type=threads_value, default=2, metavar="N",
                   help="torch CPU threads (default: 2, the setting the shipped model was trained with, unlike the "
                        "other commands' torch default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 (default: bf16 autocast)")
    p.add_argument("--export-dtype", default="float32", choices=["float32", "bfloat16"])
    return p


def check_args(args) -> None:
    """Exit with a one-line error on batch shares or flags that do not fit together."""
    if not 0.0 <= args.math_frac <= 1.0:
        raise SystemExit(f"error: --math-frac must be in [0, 1], got {args.math_frac}")
    if not 0.0 <= args.drill_frac <= 1.0 - args.math_frac + 1e-9:
        raise SystemExit(f"error: --drill-frac must be in [0, 1 - --math-frac], got {args.drill_frac}")
    if args.restart_schedule and not args.resume:
        raise SystemExit("error: --restart-schedule needs --resume")


def resume_or_start(args, state_path: Path, tok_path: Path):
    """(saved state or None, tokenizer). On --resume the run's identity (sizes, seed, batch) comes
    from the saved state and its tokenizer is reloaded; otherwise a tokenizer is trained and saved.
    --lr and --warmup default to the saved run's schedule (or the fresh defaults)."""
    from tokenizers import Tokenizer

    state = None
    if args.resume:
        if not state_path.is_file():
            raise SystemExit(f"error: --resume but {state_path} does not exist")
        state = torch.load(state_path, map_location="cpu", weights_only=False)
        saved = state["args"]
        for k in ("seed", "vocab", "hidden", "layers", "heads", "intermediate", "max_length", "answer_len", "batch"):
            setattr(args, k, saved[k])        # the run's identity comes from the state
        tok = Tokenizer.from_file(str(tok_path))
    else:
        saved = FRESH_SCHEDULE
        tok = build_tokenizer(corpus(20000, seed=10_000 + args.seed), args.vocab)
        tok.save(str(tok_path))
    for k in ("lr", "warmup"):                # the saved run's schedule (or the fresh defaults) unless given
        if getattr(args, k) is None:
            setattr(args, k, saved[k])
    return state, tok


def make_optimizer(model: Transformer, args) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices except the token embeddings."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "tok_embeddings" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "tok_embeddings" not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=args.lr, betas=(0.9, 0.95), eps=1e-8)


@dataclass
class Run:
    """One invocation's training objects and where the run stands (what `save_state` keeps)."""
    args: Any
    tok: Any
    model: Transformer
    opt: torch.optim.Optimizer
    eos: int
    step: int = 0
    total: int | None = None            # planned optimiser steps; None until estimated from the budget
    tokens: int = 0
    elapsed_before: float = 0.0         # training seconds of earlier invocations
    sched_start: int = 0                # step where the current warm-up + cosine segment starts

    def restore(self, state: dict | None) -> None:
        """Continue from a saved state: weights, optimiser, step, schedule and RNG states."""
        args = self.args
        self.total = args.steps
        if state is None:
            return
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step, self.elapsed_before = state["step"], state.get("train_seconds", 0.0)
        self.total = args.steps or (None if args.restart_schedule else state["total_steps"])
        self.sched_start = self.step if args.restart_schedule else state.get("sched_start", 0)
        torch.set_rng_state(state["torch_rng"])
        random.setstate(state["py_rng"])
        self.tokens = state.get("tokens", 0)

    def optimiser_step(self) -> tuple[torch.Tensor, float, float]:
        """One step on the step's batch: (loss, learning rate, gradient norm before clipping)."""
        args = self.args
        ids, valid, P = step_batch(self.tok, self.step, args, self.eos)
        gen = torch.Generator().manual_seed(args.seed * 7_919 + self.step)
        lr = lr_at(self.step - self.sched_start, (self.total or 10**9) - self.sched_start, args.lr, args.warmup)
        for g in self.opt.param_groups:
            g["lr"] = lr
        loss, _ = diffusion_loss(self.model, ids, valid, P, gen, args.eps, autocast=not args.no_bf16)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.model.parameters(), args.clip).item()
        self.opt.step()
        self.step += 1
        self.tokens += int(valid.sum())
        return loss, lr, gn

    def checkpoint(self, state_path: Path, out: Path, train_seconds: float) -> None:
        """Save the resumable state and export the weights and tokenizer to `out`."""
        args = self.args
        save_state(state_path, self.model, self.opt, self.step, self.total, args,
                   {"tokens": self.tokens, "train_seconds": train_seconds, "sched_start": self.sched_start})
        export(self.model, self.tok, out, args.max_length, getattr(torch, args.export_dtype), args.answer_len)


def validation(model: Transformer, tok, args, eos: int):
    """A function returning the loss on a fixed validation batch (held-out-disjoint generator seed,
    fixed masks), computed in eval mode."""
    vseed = 987_654_321
    vpairs = [pair("math", p) for p in problems("math", 64, vseed)] + [pair("code", p) for p in problems("code", 64, vseed)]
    vids, vvalid, vP = collate(encode_pairs(tok, vpairs, args.answer_len, eos), eos)

    def val_loss() -> float:
        model.eval()
        with torch.no_grad():
            loss, _ = diffusion_loss(model, vids, vvalid, vP, torch.Generator().manual_seed(0), args.eps,
                                     autocast=not args.no_bf16)
        model.train()
        return loss.item()

    return val_loss


class TrainLog:
    """`log.csv` of a run: a fresh file with its header, or appended to when the run resumes."""
    HEADER = ["step", "loss", "val_loss", "lr", "grad_norm", "tokens", "train_seconds", "wall"]

    def __init__(self, path: Path, resumed: bool):
        new_log = not path.exists() or not resumed
        self.file = open(path, "w" if new_log else "a", newline="")
        self.writer = csv.writer(self.file)
        if new_log:
            self.writer.writerow(self.HEADER)

    def row(self, run: Run, loss: torch.Tensor, ema: float, vl, lr: float, gn: float, ts: float) -> None:
        """Print a progress line and append it to the file (`vl` is "" between validations)."""
        print(f"step {run.step:6d}  loss {loss.item():.4f}  ema {ema:.4f}  val {vl if vl == '' else f'{vl:.4f}'}  "
              f"lr {lr:.2e}  gn {gn:.2f}  tok {run.tokens:,}  {ts / 60:.1f} min", flush=True)
        self.writer.writerow([run.step, f"{loss.item():.5f}", vl if vl == "" else f"{vl:.5f}", f"{lr:.3e}", f"{gn:.3f}",
                              run.tokens, f"{ts:.0f}", time.strftime("%H:%M:%S")])
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def train(run: Run, t_start: float, val_loss, log: TrainLog, state_path: Path, out: Path) -> float | None:
    """Optimiser steps until the wall-clock budget or the planned total; returns the loss EMA.
    Without --steps the total is planned from the time of the first 50 steps."""
    args = run.args
    budget = args.minutes * 60
    run.model.train()
    t_loop, ema, last_ck, first_step = time.time(), None, run.step, run.step
    probe_steps = 50
    while time.time() - t_start < budget and (run.total is None or run.step < run.total):
        loss, lr, gn = run.optimiser_step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        if run.total is None and run.step - first_step == probe_steps:
            per_step = (time.time() - t_loop) / probe_steps
            run.total = run.step + int((budget - (time.time() - t_start)) / per_step * 0.97)
            print(f"{per_step:.2f} s/step -> schedule of {run.total} steps", flush=True)
        if run.step % args.log_every == 0:
            vl = val_loss() if run.step % (args.log_every * 10) == 0 else ""
            log.row(run, loss, ema, vl, lr, gn, run.elapsed_before + time.time() - t_start)
        if run.step - last_ck >= args.ckpt_every:
            run.checkpoint(state_path, out, run.elapsed_before + time.time() - t_start)
            last_ck = run.step
    return ema


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_args(args)              # before anything changes: a bad flag leaves no directory and no setting
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    state_dir = Path(args.state_dir) if args.state_dir else Path.home() / ".cache" / "psd-engine" / "train_runs" / out.resolve().name
    state_dir.mkdir(parents=True, exist_ok=True)
    state_path = state_dir / "train_state.pt"
    dev = torch.device(args.device)
    t_start = time.time()

    state, tok = resume_or_start(args, state_path, state_dir / "tokenizer.json")
    eos = tok.token_to_id(EOS)
    config = make_config(tok, args)
    model = init_model(config, args.seed).to(dev)
    run = Run(args, tok, model, make_optimizer(model, args), eos)
    run.restore(state)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params {n_params:,}  vocab {tok.get_vocab_size()} (embedding rows {config.vocab_size})  eos {eos} "
          f"mask {config.mask_token_id}  step {run.step}  total {run.total}  state {state_path}", flush=True)

    val_loss = validation(model, tok, args, eos)
    log = TrainLog(state_dir / "log.csv", resumed=state is not None)
    ema = train(run, t_start, val_loss, log, state_path, out)
    ts = run.elapsed_before + time.time() - t_start
    run.checkpoint(state_path, out, ts)
    vl = val_loss()
    (state_dir / "summary.json").write_text(json.dumps({
        "step": run.step, "total_steps": run.total, "tokens": run.tokens, "train_seconds": round(ts),
        "params": n_params, "val_loss": vl, "last_loss_ema": ema, "args": vars(args)}, indent=2))
    print(f"done: step {run.step}/{run.total}  val {vl:.4f}  tokens {run.tokens:,}  {ts / 60:.1f} min  -> {out}",
          flush=True)
    log.close()


if __name__ == "__main__":
    main()
