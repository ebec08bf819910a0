"""Seconds to load a checkpoint's SentencePiece tokenizer.model at a real vocabulary size.

    python -m bench.tokenizer_load                   # 153,376 pieces (openPangu's vocabulary size)
    python -m bench.tokenizer_load --pieces 32000 --rounds 5

Writes a synthetic BPE model of that many pieces into a temporary checkpoint (control and byte pieces,
then pieces that are each two earlier pieces joined, so every one has merges, as a trained BPE's) and
times `models.Tokenizer` on it, interleaved round by round: with the conversion store off (converted
every time), with an empty store (converted and kept) and with the conversion kept
(models/sentencepiece.py `converted`). Checks that all three encode a text alike.
"""
from __future__ import annotations

import os
import random
import statistics
import struct
import tempfile
import time
from pathlib import Path

from engine.errors import InputError
from engine.frontend import Parser, guarded
from models import Tokenizer

TEXT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. 汉字"


def _varint(v: int) -> bytes:
    out = bytearray()
    while True:
        out.append((v & 0x7F) | (0x80 if v > 0x7F else 0))
        v >>= 7
        if not v:
            return bytes(out)


def _field(number: int, wire: int, payload) -> bytes:
    key = _varint(number << 3 | wire)
    if wire == 0:
        return key + _varint(payload)
    return key + (payload if wire == 5 else _varint(len(payload)) + payload)


def synthetic_model(pieces: int, seed: int = 0) -> bytes:
    """A SentencePiece BPE ModelProto of `pieces` pieces with byte fallback and the identity normalizer."""
    rng = random.Random(seed)
    head = [("<unk>", 2), ("<s>", 3), ("</s>", 3)] + [(f"<0x{b:02X}>", 6) for b in range(256)]
    chars = list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,;:!?'\"()+-*/=")
    chars += ["汉", "字", "测", "试", "\u2581"]
    joined, seen = [], set()
    while len(joined) < pieces - len(head) - len(chars):
        left = joined[int(rng.random() ** 2 * len(joined))] if len(joined) > 200 else rng.choice(chars)
        p = left + rng.choice(joined[:2000] + chars)
        if p not in seen and len(p) <= 16:
            seen.add(p)
            joined.append(p)
    rows = [(p, 0.0, kind) for p, kind in head] + [(p, -float(i), 1) for i, p in enumerate(joined)]
    rows += [(c, -1e6 - i, 1) for i, c in enumerate(chars)]
    out = b"".join(_field(1, 2, _field(1, 2, p.encode()) + _field(2, 5, struct.pack("<f", s)) + _field(3, 0, k))
                   for p, s, k in rows)
    trainer = _field(3, 0, 2) + _field(35, 0, 1)                       # BPE, byte fallback
    normalizer = _field(1, 2, b"identity") + _field(3, 0, 1) + _field(4, 0, 0)
    return out + _field(2, 2, trainer) + _field(3, 2, normalizer)


def _load(ckpt: Path, store: str) -> tuple[float, list[int]]:
    before = os.environ.get("PSD_TOKENIZER_CACHE")
    os.environ["PSD_TOKENIZER_CACHE"] = store
    try:
        t0 = time.perf_counter()
        tok = Tokenizer(ckpt)
        return time.perf_counter() - t0, tok.encode(TEXT)
    finally:
        if before is None:
            del os.environ["PSD_TOKENIZER_CACHE"]
        else:
            os.environ["PSD_TOKENIZER_CACHE"] = before


def run(args) -> int:
    if args.pieces < 1000 or args.rounds < 1:
        raise InputError(f"--pieces must be >= 1000 and --rounds >= 1, got {args.pieces} and {args.rounds}")

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        (ckpt / "tokenizer.model").write_bytes(synthetic_model(args.pieces))
        times = {"store off": [], "empty store": [], "kept": []}
        ids = set()
        for r in range(args.rounds):
            for mode in times:
                store = "off" if mode == "store off" else str(Path(tmp) / f"store{r}")
                seconds, got = _load(ckpt, store)
                times[mode].append(seconds)
                ids.add(tuple(got))
        if len(ids) != 1:
            print("error: the three ways encode the text differently")
            return 1
        print(f"{args.pieces} pieces, {(ckpt / 'tokenizer.model').stat().st_size / 2**20:.1f} MiB, "
              f"{args.rounds} rounds; seconds for models.Tokenizer")
        print("| store | median | runs |\n|---|---|---|")
        for mode, ts in times.items():
            print(f"| {mode} | {statistics.median(ts):.2f} | {' '.join(f'{t:.2f}' for t in ts)} |")
    return 0


def main(argv=None) -> int:
    ap = Parser(prog="python -m bench.tokenizer_load", description=__doc__.split("\n")[0])
    ap.add_argument("--pieces", type=int, default=153376)
    ap.add_argument("--rounds", type=int, default=3)
    return guarded(run, ap.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
