"""A SentencePiece `tokenizer.model` read as a `tokenizers` tokenizer, with no sentencepiece or protobuf
installed: for checkpoints that ship no tokenizer.json (openPangu's layout, SentencePiece-era releases).

The model file is a protobuf `ModelProto`; the few fields the conversion needs are read from its wire
format here (`read_model`): the pieces (text, score, kind), the trainer's model type and byte fallback,
and the normalizer's settings. `tokenizer_json` turns them into the tokenizers library's JSON:

- normalizer: the precompiled character map (when the model has one), SentencePiece's whitespace
  handling (runs of spaces collapsed and the text stripped, `remove_extra_whitespaces`), spaces as
  U+2581 and the dummy prefix (`add_dummy_prefix`);
- model: BPE, whose merges are every split of a piece into two pieces, in the order of the merged
  piece's score (SentencePiece merges the best-scoring piece first), or Unigram with the scores;
  byte fallback as the model has it;
- decoder: U+2581 back to spaces, byte runs to their UTF-8, the dummy prefix's space dropped;
- control pieces (`<s>`, `</s>`) and the unknown piece are special tokens, user-defined pieces added
  tokens, matched in the text as transformers does (SentencePiece never matches control pieces in text;
  a chat template writes them). The text on each side of such a token is normalized on its own (the
  tokenizers library splits at added tokens first): its own dummy prefix, its own stripped ends.
  SentencePiece normalizes the whole text first, so "call <tool> now" is "▁call", "▁", "<tool>", "▁now"
  there and "▁call", "<tool>", "▁now" here (tests/test_sentencepiece.py shows the difference); text
  without such tokens is encoded alike;
- BOS first (`add_bos_token`, default true) and EOS last (`add_eos_token`, default false) when
  `tokenizer_config.json` does not say otherwise, as transformers' Llama-style tokenizers.

tests/test_sentencepiece.py compares the result with SentencePiece's own encoding and decoding for
BPE and Unigram models trained with each of these settings.
"""
from __future__ import annotations

import base64
import hashlib
import json
import struct
from pathlib import Path

from .config import cache_dir, keep_file, read_bytes
from .errors import CheckpointError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
UNIGRAM, BPE = 1, 2
SPACE = "\u2581"


# The version of `tokenizer_json`'s output: conversions kept between runs (`converted`) are redone when
# it changes, so raise it with any change to what the conversion writes.
CONVERSION = 1


class ModelError(ValueError):
    """The bytes are not a SentencePiece model this conversion supports (one line)."""


def _fields(data: bytes):
    """(field number, wire type, value) of one protobuf message: ints for varints and fixed, bytes for
    length-delimited fields."""
    i, n = 0, len(data)

    def varint():
        nonlocal i
        shift = value = 0
        while True:
            if i >= n or shift > 63:
                raise ModelError("truncated or malformed protobuf")
            b = data[i]
            i += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                return value

    while i < n:
        key = data[i]                  # one byte in all but exotic files: read without the call
        if key < 0x80:
            i += 1
        else:
            key = varint()
        field, wire = key >> 3, key & 7
        if wire == 0:
            yield field, wire, varint()
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            if i + size > n:
                raise ModelError("truncated protobuf")
            yield field, wire, data[i:i + size]
            i += size
        elif wire == 2:
            size = data[i] if i < n else 0x80
            if size < 0x80:
                i += 1
            else:
                size = varint()
            if i + size > n:
                raise ModelError("truncated protobuf")
            yield field, wire, data[i:i + size]
            i += size
        else:
            raise ModelError(f"protobuf wire type {wire} in field {field}")


def read_model(data: bytes) -> dict:
    """The pieces [(text, score, kind)], `model_type`, `byte_fallback`, `unk_id` and the normalizer's
    `charsmap`, `add_dummy_prefix`, `remove_extra_whitespaces`, `escape_whitespaces` of a model file."""
    model = dict(pieces=[], model_type=UNIGRAM, whitespace_as_suffix=False, byte_fallback=False, unk_id=0,
                 charsmap=b"", add_dummy_prefix=True, remove_extra_whitespaces=True, escape_whitespaces=True)
    for field, wire, value in _fields(data):
        if field == 1 and wire == 2:                   # SentencePiece pieces
            piece, score, kind = None, 0.0, NORMAL
            for f, w, v in _fields(value):
                if f == 1 and w == 2:
                    piece = v.decode("utf-8")
                elif f == 2 and w == 5:
                    score = struct.unpack("<f", v)[0]
                elif f == 3 and w == 0:
                    kind = v
            if piece is None:
                raise ModelError(f"piece {len(model['pieces'])} has no text")
            model["pieces"].append((piece, score, kind))
        elif field == 2 and wire == 2:                 # TrainerSpec
            for f, w, v in _fields(value):
                if w == 0 and f in (3, 24, 35, 40):
                    model[{3: "model_type", 24: "whitespace_as_suffix", 35: "byte_fallback", 40: "unk_id"}[f]] = v
        elif field == 3 and wire == 2:                 # NormalizerSpec
            for f, w, v in _fields(value):
                if f == 2 and w == 2:
                    model["charsmap"] = v
                elif w == 0 and f in (3, 4, 5):
                    model[{3: "add_dummy_prefix", 4: "remove_extra_whitespaces", 5: "escape_whitespaces"}[f]] = bool(v)
    if not model["pieces"]:
        raise ModelError("no pieces (not a SentencePiece model)")
    if model["model_type"] not in (UNIGRAM, BPE):
        kind = {3: "WORD", 4: "CHAR"}.get(model["model_type"], str(model["model_type"]))
        raise ModelError(f"model type {kind}: only BPE and Unigram models are read")
    if model["whitespace_as_suffix"]:
        raise ModelError("treat_whitespace_as_suffix is set: only models with the space before a word are read")
    model["byte_fallback"] = bool(model["byte_fallback"])
    return model


def _merges(pieces) -> list[list[str]]:
    """BPE merges: each split of a normal piece into two pieces of the vocabulary, the merged piece's
    score first (then its id, then the left part's)."""
    ids = {p: i for i, (p, _, _) in enumerate(pieces)}
    found = []
    for i, (p, score, kind) in enumerate(pieces):
        if kind == NORMAL:
            for k in range(1, len(p)):
                left = ids.get(p[:k])
                if left is not None and p[k:] in ids:
                    found.append((-score, i, left, k))
    found.sort()
    return [[pieces[i][0][:k], pieces[i][0][k:]] for _, i, _, k in found]


def _normalizer(m: dict):
    steps = []
    if m["charsmap"]:
        steps.append({"type": "Precompiled", "precompiled_charsmap": base64.b64encode(m["charsmap"]).decode()})
    if m["remove_extra_whitespaces"]:
        # spaces only (U+0020: the character map has already turned other blanks into it, or kept them)
        steps += [{"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "},
                  {"type": "Replace", "pattern": {"Regex": "\\A +| +\\z"}, "content": ""}]
    if m["escape_whitespaces"]:
        steps.append({"type": "Replace", "pattern": {"String": " "}, "content": SPACE})
    if m["add_dummy_prefix"]:       # unconditional, as SentencePiece's ("  a" is three U+2581 and "a")
        steps.append({"type": "Prepend", "prepend": SPACE if m["escape_whitespaces"] else " "})
    return {"type": "Sequence", "normalizers": steps}


def _decoder(m: dict):
    steps = [{"type": "Replace", "pattern": {"String": SPACE}, "content": " "}]
    if m["byte_fallback"]:
        steps.append({"type": "ByteFallback"})
    steps.append({"type": "Fuse"})
    if m["add_dummy_prefix"]:
        steps.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    return {"type": "Sequence", "decoders": steps}


def _post_processor(pieces, add_bos: bool, add_eos: bool):
    specials = {p: i for i, (p, _, kind) in enumerate(pieces) if kind == CONTROL}
    bos = next((p for p in ("<s>", "<bos>", "[BOS]") if p in specials), None) if add_bos else None
    eos = next((p for p in ("</s>", "<eos>", "[EOS]") if p in specials), None) if add_eos else None
    if bos is None and eos is None:
        return None

    def seq(name):
        return ([{"SpecialToken": {"id": bos, "type_id": 0}}] if bos else []) + \
            [{"Sequence": {"id": name, "type_id": 0}}] + ([{"SpecialToken": {"id": eos, "type_id": 0}}] if eos else [])

    return {"type": "TemplateProcessing", "single": seq("A"), "pair": seq("A") + seq("B"),
            "special_tokens": {t: {"id": t, "ids": [specials[t]], "tokens": [t]} for t in (bos, eos) if t}}


def tokenizer_json(m: dict, add_bos: bool = True, add_eos: bool = False) -> dict:
    """The tokenizers library's JSON for a model read by `read_model`."""
    pieces = m["pieces"]
    unk = pieces[m["unk_id"]][0] if 0 <= m["unk_id"] < len(pieces) else None
    if m["model_type"] == BPE:
        model = {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": m["byte_fallback"],
                 "ignore_merges": False, "vocab": {p: i for i, (p, _, _) in enumerate(pieces)},
                 "merges": _merges(pieces)}
    else:
        model = {"type": "Unigram", "unk_id": m["unk_id"], "vocab": [[p, s] for p, s, _ in pieces],
                 "byte_fallback": m["byte_fallback"]}
    added = [{"id": i, "content": p, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": kind != USER_DEFINED}
             for i, (p, _, kind) in enumerate(pieces) if kind in (CONTROL, UNKNOWN, USER_DEFINED)]
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": _normalizer(m), "pre_tokenizer": None,
            "post_processor": _post_processor(pieces, add_bos, add_eos), "decoder": _decoder(m), "model": model}


def converted(data: bytes, add_bos: bool = True, add_eos: bool = False) -> str:
    """tokenizer.json's text for the model file's bytes `data`, converted once and kept for later runs:
    a real vocabulary (openPangu's 153k pieces) takes seconds to read and to find its merges, a kept
    conversion is read back in milliseconds. Kept in `cache_dir("tokenizers", "PSD_TOKENIZER_CACHE")`
    under a digest of the bytes, the flags, `CONVERSION` and the tokenizers library's version; each file
    starts with its own digest, so a damaged one is converted again and replaced, never used."""
    import tokenizers

    where = cache_dir("tokenizers", "PSD_TOKENIZER_CACHE")
    key = f"{CONVERSION} {tokenizers.__version__} {int(add_bos)} {int(add_eos)}\n".encode()
    path = None if where is None else where / (hashlib.sha256(key + data).hexdigest() + ".json")
    text = _kept(path)
    if text is None:
        text = json.dumps(tokenizer_json(read_model(data), add_bos, add_eos))
        if path is not None:
            body = text.encode()
            keep_file(path, hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
    return text


def _kept(path: Path | None) -> str | None:
    """A kept conversion's text, or None (none kept, the store off, or a file whose digest fails)."""
    try:
        raw = read_bytes(path) if path is not None and path.is_file() else b""
        head, _, body = raw.partition(b"\n")
        return body.decode() if head and head.decode() == hashlib.sha256(body).hexdigest() else None
    except (OSError, CheckpointError, UnicodeDecodeError):
        return None
