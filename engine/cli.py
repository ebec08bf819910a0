"""`python -m engine.generate`: decode one prompt with a local checkpoint and print the result.

Bad input (a missing model directory, a bad argument, an empty prompt, ...) gets one line on
stderr starting with `error:` and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from models import DTYPES, CheckpointError, ModelConfig, Tokenizer

from .config import ACCEPTANCE, CACHE_MODES, CONF_DTYPES, METHODS, POLICIES, SCORES, DecodeConfig
from .graph import DraftGraph
from .errors import InputError

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "models" / "default"


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit 2 (argparse would print the whole usage first)
        self.exit(2, f"error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine.generate", description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="?", help="prompt text, encoded exactly as given; '-' reads stdin; "
                                             "default: the model's sample_prompt.txt")
    p.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--model", help="checkpoint directory (config.json, safetensors, tokenizer.json); "
                                    "default: the shipped models/default")
    p.add_argument("--method", default="greedy", choices=METHODS)
    p.add_argument("--gen-length", type=int, help="default: the checkpoint's generation_config.json, else 128")
    p.add_argument("--block-length", type=int, help="default: the checkpoint's generation_config.json, else 32")
    p.add_argument("--steps", type=int, help="topk: total steps (default: gen length)")
    p.add_argument("--threshold", type=float, help="confidence: tau (default 0.9); localleap: tau (default 0.75)")
    p.add_argument("--kappa", type=float, default=0.9, help="localleap anchor threshold")
    p.add_argument("--window", type=int, default=4, help="localleap window W")
    p.add_argument("--cache", default="none", choices=CACHE_MODES)
    p.add_argument("--score", default="prob", choices=SCORES)
    p.add_argument("--conf-dtype", default="float32", choices=CONF_DTYPES)
    p.add_argument("--policy", default="confidence", choices=POLICIES, help="psd: the spatial policy")
    p.add_argument("--depth", type=int, default=3, help="spiffy/psd: depth of the default chain draft graph")
    p.add_argument("--graph", help="spiffy/psd: draft graph JSON file (list of rank lists)")
    p.add_argument("--acceptance", default="policy", choices=ACCEPTANCE,
                   help="psd: the policy's own criterion, or exact (lossless)")
    p.add_argument("--k", type=int, default=3, help="lopa: branches; ete: blocks per window; fdm: future steps")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=[d for d in DTYPES if d != "float16"])
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    return p


def _read_prompt(args) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise InputError("give the prompt either as an argument or with --prompt-file, not both")
    src = args.prompt_file if args.prompt_file is not None else ("-" if args.prompt == "-" else None)
    if src is None:
        if args.prompt is None:
            sample = Path(args.model) / "sample_prompt.txt"
            if not sample.is_file():
                raise InputError("no prompt given (pass PROMPT, '-' for stdin, or --prompt-file)")
            text = sample.read_text(encoding="utf-8")
            print(f"prompt (the model's sample question): {text!r}", file=sys.stderr)
            return text
        return args.prompt
    if src == "-":
        return sys.stdin.read()
    try:
        return Path(src).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read prompt file {src}: {e.strerror if isinstance(e, OSError) else e}") from None


def _device(name: str):
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise InputError(f"device {name} requested but CUDA is not available")
    try:
        return str(torch.device(name))
    except RuntimeError:
        raise InputError(f"unknown device {name!r}") from None


def _generation_defaults(model_dir: Path) -> dict:
    """gen_length / block_length a checkpoint suggests in its generation_config.json, if any."""
    f = model_dir / "generation_config.json"
    try:
        cfg = json.loads(f.read_text(encoding="utf-8")) if f.is_file() else {}
    except (OSError, ValueError):
        cfg = {}
    return {k: int(cfg[k]) for k in ("gen_length", "block_length") if isinstance(cfg.get(k), int)}


def run(args: argparse.Namespace) -> dict:
    if args.model is None and (DEFAULT_MODEL_DIR / "config.json").is_file():
        args.model = str(DEFAULT_MODEL_DIR)
    sizes = _generation_defaults(Path(args.model)) if args.model else {}
    args.gen_length = args.gen_length or sizes.get("gen_length", 128)
    args.block_length = args.block_length or sizes.get("block_length", 32)
    dc = DecodeConfig(method=args.method, gen_length=args.gen_length, block_length=args.block_length, steps=args.steps,
                      threshold=args.threshold, kappa=args.kappa, window=args.window, cache=args.cache,
                      score=args.score, temperature=args.temperature, seed=args.seed, conf_dtype=args.conf_dtype,
                      acceptance=args.acceptance, policy_name=args.policy, depth=args.depth, k=args.k,
                      graph=DraftGraph.load(args.graph) if args.graph else None).validate()
    if args.model is None:
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            raise InputError(f"--model DIR is required (the shipped default model {DEFAULT_MODEL_DIR} is missing)")
        args.model = str(DEFAULT_MODEL_DIR)
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist or is not a directory")
    mc = ModelConfig.from_dir(model_dir)          # cheap checks before the weights are read
    tok = Tokenizer(model_dir)
    text = _read_prompt(args)
    if not text.strip():
        raise InputError("the prompt is empty")
    if args.chat:
        text = tok.apply_chat_template(text)
    from .loop import Decoder, check_prompts

    check_prompts(mc, dc, [tok.encode(text)])
    device = _device(args.device)

    from models import load_model

    model = load_model(model_dir, dtype=args.dtype, device=device)
    res = Decoder(model, dc).generate([tok.encode(text)])[0]
    res.text = tok.decode(res.token_ids)
    out = res.as_dict()
    out.update(method=dc.method, policy=dc.describe(), cache=dc.cache, model=str(model_dir), dtype=args.dtype, device=device)
    return out


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = run(args)
    except (InputError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    if args.json:
        print(json.dumps(out))
    else:
        print(out["text"])
        print(f"[{out['policy']} cache={out['cache']}] tokens={out['tokens']} calls={out['calls']} "
              f"tpf={out['tpf']:.2f} rows/call={out['rows_per_call']:.2f} seconds={out['seconds']:.2f}"
              f"{' (stopped at EOS)' if out['stopped'] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
