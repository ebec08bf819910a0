"""`python -m engine.generate`: decode one prompt with a local checkpoint and print the result.

Bad input (a missing model directory, a bad argument, an empty prompt, ...) gets one line on
stderr starting with `error:` and exit status 2, never a traceback.

Under `torchrun --nproc-per-node N -m engine.generate ...` the model is split over the N ranks
(tensor parallel, docs/distributed.md): rank 0 reads the prompt, decodes and prints; the other
ranks run the model calls it sends them.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from models import CheckpointError, ModelConfig, Tokenizer

from .config import DecodeConfig, prompt_ids
from .errors import MAX_FILE_BYTES, InputError, read_user_text
from .frontend import (DEFAULT_MODEL_DIR, DTYPE_CHOICES, DefaultsFormatter, Parser, add_decoding_flags, add_gemm_flag,
                       add_plugin_flag, add_threads_flag, checked_gemm, decoding_options, guarded, plugins_loaded,
                       resolve_device, set_threads, suggested_config)
from .methods import METHODS
from .uniform import for_model

def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m engine.generate", description=__doc__.split("\n")[0], formatter_class=DefaultsFormatter)
    p.add_argument("prompt", nargs="?", help="prompt text, encoded exactly as given; '-' reads stdin; "
                                             "default: the model's sample_prompt.txt")
    p.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--model", help="checkpoint directory (config.json, safetensors, tokenizer.json); "
                                    "default: the shipped models/default")
    p.add_argument("--method", choices=list(METHODS),
                   help="default greedy; eb on a uniform-noise model (diffusion_gemma). " +
                   "; ".join(f"{m.name}: {m.help}" for m in METHODS.values()))
    add_decoding_flags(p)
    add_plugin_flag(p)
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="model weights' dtype")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto")
    add_gemm_flag(p)
    add_threads_flag(p)
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the checkpoint's chat template")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--stream", action="store_true", help="print the text as it becomes final (decoding order)")
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
            text = read_user_text(sample, "the model's sample prompt")
            print(f"prompt (the model's sample question): {text!r}", file=sys.stderr)
            args.sample_answer = Path(args.model) / "sample_answer.txt"
            return text
        return args.prompt
    if src == "-":
        return _read_stdin(MAX_FILE_BYTES)
    return read_user_text(src, "prompt file")      # a regular file of sane size (a FIFO would block)


def _read_stdin(limit: int) -> str:
    """The prompt on stdin, bounded like a named file: never more than `limit` bytes (characters
    where stdin has no bytes) are read, so /dev/zero or an endless pipe is one error line."""
    stdin = getattr(sys.stdin, "buffer", None)          # bytes, so invalid UTF-8 is our error
    source = stdin if stdin is not None else sys.stdin
    chunks, size = [], 0
    while size <= limit:
        chunk = source.read(min(1 << 20, limit + 1 - size))
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    if size > limit:
        raise InputError(f"the prompt on stdin is too large: over {limit} bytes ({limit >> 20} MiB), the most "
                         f"that is read")
    if stdin is None:
        return "".join(chunks)
    try:
        return b"".join(chunks).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"the prompt on stdin is not valid UTF-8 ({e.reason} at byte {e.start})") from None


def run(args: argparse.Namespace, on_text=None) -> dict:
    """Decode the CLI's prompt; `on_text(piece)`, if given, receives the text as it becomes final."""
    if args.stream and args.json:
        raise InputError("--stream prints text as it is decoded; it does not combine with --json")
    if args.model is None:
        if not (DEFAULT_MODEL_DIR / "config.json").is_file():
            raise InputError(f"--model DIR is required (the shipped default model {DEFAULT_MODEL_DIR} is missing)")
        args.model = str(DEFAULT_MODEL_DIR)
    model_dir = Path(args.model)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory {model_dir} does not exist or is not a directory")
    mc = ModelConfig.from_dir(model_dir)          # cheap checks before the weights are read
    args.uniform = mc.mask_token_id is None        # (for _explain's advice)
    dc = suggested_config(lambda given: for_model(mc, DecodeConfig(method=args.method, **given)).validate(),
                          decoding_options(args), mc.generation_defaults, model_dir)   # the checkpoint's, if no flag
    tok = args.tokenizer = Tokenizer(model_dir)     # and the plain output's --top-logprobs lines
    from . import distributed

    tp = distributed.setup(args.device, mc)            # None unless launched by torchrun
    text = distributed.from_leader(lambda: _read_prompt(args))     # stdin and files are rank 0's
    if not text.strip():
        raise InputError("the prompt is empty")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:          # argv bytes that are not UTF-8 arrive as lone surrogates
        raise InputError("the prompt is not valid UTF-8") from None
    from .loop import check_prompts

    ids = prompt_ids(tok, text, chat=args.chat)
    check_prompts(mc, dc, [ids])
    device = resolve_device(args.device) if tp is None else tp.device
    checked_gemm(args.gemm, device, args.dtype, tp is not None)
    set_threads(args.threads)

    from models import load_model

    model = load_model(model_dir, dtype=args.dtype, device=device, tp=tp).set_gemm(args.gemm)
    decoder = distributed.decoder(model, dc)            # under torchrun: rank 0 decodes, the others follow
    if on_text is None:
        res = decoder.generate([ids])[0]
    else:
        res = _stream_text(decoder, tok, ids, on_text)
    res.text = tok.decode(res.token_ids)
    out = res.as_dict()
    out.update(method=dc.method, policy=dc.describe(), cache=dc.cache, model=str(model_dir), dtype=args.dtype, device=device)
    if tp is not None:
        out["tensor_parallel"] = tp.world
    return out


def _stream_text(decoder, tok, ids, on_text):
    """Decode one prompt, handing `on_text` each new piece of final text (text is decoded from
    the whole final prefix, so a multi-byte character is never split)."""
    tokens, shown = [], ""
    for update in decoder.stream([ids]):
        tokens += update.pieces[0]
        if update.results is None:        # an incomplete UTF-8 sequence waits for its next bytes
            text = tok.decode(tokens[:tok.settled(tokens)]).rstrip("\ufffd")
        else:
            text = tok.decode(tokens)
        if text.startswith(shown) and len(text) > len(shown):
            on_text(text[len(shown):])
            shown = text
    return update.results[0]


def _explain(args, out: dict) -> None:
    """For a person at a terminal (stderr, so scripts reading stdout see nothing new): the
    reference answer of the sample question, what the statistics mean, and what to try next."""
    answer = getattr(args, "sample_answer", None)
    if answer is not None and answer.is_file():
        print(f"reference answer: {answer.read_text(encoding='utf-8').strip()}", file=sys.stderr)
    if not out["text"].strip() and Path(args.model).resolve() == DEFAULT_MODEL_DIR.resolve():
        print("note: the model generated no text; the shipped demo model only knows its math/code suite "
              "formats ('Question: ...\\nAnswer: '), see README", file=sys.stderr)
    elif not out["text"].strip():
        tok, ids = args.tokenizer, out["token_ids"]
        unknown = sum(tok.id_to_token(i) is None for i in ids)
        why = (f"{unknown} of its {len(ids)} generated ids are outside the tokenizer's {tok.size} entries: "
               f"the model's vocabulary is larger than its tokenizer's" if unknown else
               "its first token was a stop token, or only special tokens")
        print(f"note: the model generated no text ({why})", file=sys.stderr)
    print("tokens = generated tokens, calls = model calls, tpf = tokens per call (higher: fewer calls), "
          "rows/call = canvases per call (drafts verified together); " +
          ("a uniform-noise model decodes with eb alone: --entropy-bound sets its γ, --max-denoising-steps its "
           "steps" if out["method"] == "eb" and getattr(args, "uniform", False) else
           "try --method psd --policy confidence --depth 3, or --method confidence --threshold 0.9"), file=sys.stderr)


def _top_lines(tok, out: dict) -> list[str]:
    """--top-logprobs K without --json: one line per generated token, after the text: its position,
    its text and the K most likely tokens of the output that committed it with their probabilities."""
    k = max(map(len, out["commit_top"]), default=0)
    lines = [f"top {k} per generated token (position: token | alternatives and probabilities, most likely first):"]
    for i, (t, top) in enumerate(zip(out["token_ids"], out["commit_top"])):
        lines.append(f"{i}: {_token_text(tok, t)} | " + ", ".join(f"{_token_text(tok, a)} {p:.3g}" for a, p in top))
    return lines


def _token_text(tok, token_id: int) -> str:
    """A token as its own decoding (quoted, escapes shown), or <id N> where that is empty (a special token)."""
    text = tok.decode([token_id])
    return repr(text) if text else f"<id {token_id}>"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    from models.parallel import launched

    if launched():                               # torchrun: every rank runs the command, rank 0 prints
        from .distributed import leader_prints

        return leader_prints(_command, argv, ranks=True)
    return _command(argv)


def _command(argv, ranks: bool = False) -> int:
    if not plugins_loaded(argv):                 # before the parser: a plugin's methods bring flags
        return 2
    args = build_parser().parse_args(argv)
    if ranks:
        from .distributed import run_ranks

        return run_ranks(_main, args, guard=guarded)
    return guarded(_main, args)


def _main(args) -> int:
    out = run(args, on_text=(lambda piece: print(piece, end="", flush=True)) if args.stream else None)
    if args.stream:
        print()
    elif args.json:
        print(json.dumps(out))
    if not args.json:
        if not args.stream:
            print(out["text"])
        for line in _top_lines(args.tokenizer, out) if out.get("commit_top") is not None else ():
            print(line)
        print(f"[{out['policy']} cache={out['cache']}] tokens={out['tokens']} calls={out['calls']} "
              f"tpf={out['tpf']:.2f} rows/call={out['rows_per_call']:.2f} seconds={out['seconds']:.2f}"
              f"{' (stopped at EOS)' if out['stopped'] else ''}")
        _explain(args, out)
    sys.stdout.flush()              # a closed pipe fails here, inside guarded, not at exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
