"""Peak host memory and time of loading a checkpoint, against the model's size and its largest shard.

    python -m bench.load_memory --model DIR [--dtype float32]
    python -m bench.load_memory --random-params 300e6 [--shard-mib 1024] [--dtype float32]

Each load runs in a fresh child process that reports its own peak resident set (`VmHWM` of
/proc/self/status, which counts the memory-mapped shard pages it touched); the Python + torch
baseline of a child that only imports is measured the same way and reported beside it. `--random-params N` writes a
random llada checkpoint of about N parameters (the vocabulary carries the size) to a temporary
directory first. docs/models.md quotes this command's output.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

_CHILD = r"""
import json, sys, time, torch
t = time.perf_counter()
if sys.argv[1] != "-":
    from models import load_model
    m = load_model(sys.argv[1], dtype=sys.argv[2])
    n = sum(p.numel() * p.element_size() for p in m.parameters())
else:
    import models  # the imports a load pays for
    n = 0
hwm = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"seconds": time.perf_counter() - t, "model_bytes": n, "peak_rss": hwm}))
"""


def _child(model: str, dtype: str) -> dict:
    r = subprocess.run([sys.executable, "-c", _CHILD, model, dtype], capture_output=True, text=True,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    if r.returncode:
        raise SystemExit(f"error: loading {model} failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(r.stdout)


def measure(model: str, dtype: str) -> dict:
    """One load in a child process: its seconds, model bytes and peak RSS, with the empty child's RSS."""
    base = _child("-", dtype)["peak_rss"]
    out = _child(model, dtype)
    shards = sorted(Path(model).glob("*.safetensors"), key=lambda f: f.stat().st_size)
    return {**out, "baseline_rss": base, "largest_shard": shards[-1].stat().st_size,
            "shards": len(shards), "dtype": dtype}


def _random(params: float, shard_mib: int | None, root: Path) -> Path:
    from models.checkpoint import init_random, save_checkpoint
    from models.config import ModelConfig

    hidden = 1024
    vocab = max(1024, int(params) // (2 * hidden))
    cfg = ModelConfig.tiny("llada", vocab_size=vocab, hidden_size=hidden, head_dim=256, intermediate_size=256,
                           num_layers=2)
    model = init_random(cfg, seed=0)
    return save_checkpoint(model, root / "ckpt", shard_bytes=None if shard_mib is None else shard_mib << 20)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load_memory", description=__doc__.split("\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="checkpoint directory to load")
    src.add_argument("--random-params", type=float, help="write a random checkpoint of about this many parameters")
    p.add_argument("--shard-mib", type=int, default=None, help="with --random-params: shard size (default: one file)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = p.parse_args(argv)
    if args.model is not None and not Path(args.model).is_dir():
        p.exit(2, f"error: --model {args.model} is not a directory\n")
    with tempfile.TemporaryDirectory(prefix="psd-load-memory-") as tmp:
        model = args.model or str(_random(args.random_params, args.shard_mib, Path(tmp)))
        r = measure(model, args.dtype)
    mib = lambda n: f"{n / 2**20:.0f} MiB"
    print(f"model {mib(r['model_bytes'])} in {r['dtype']}, {r['shards']} shard(s), largest {mib(r['largest_shard'])}; "
          f"peak RSS {mib(r['peak_rss'])} (empty child {mib(r['baseline_rss'])}): "
          f"{(r['peak_rss'] - r['baseline_rss']) / max(1, r['model_bytes'] + r['largest_shard']):.2f}x "
          f"(model + largest shard); load {r['seconds']:.2f} s")
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
