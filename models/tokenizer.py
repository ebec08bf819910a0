"""The checkpoint's own tokenizer (`tokenizer.json`, else a SentencePiece `tokenizer.model` read by
models/sentencepiece.py), with a decode that never crashes.

Real LLaDA has more embedding rows (126464) than tokenizer entries, so a model may emit ids the
tokenizer cannot map; `decode` drops them instead of raising.

The chat template (`chat_template.jinja`, else `chat_template` of tokenizer_config.json) is checked
and compiled when the tokenizer is built, so a broken one fails at load with one line naming the
file; it runs in Jinja's immutable sandbox (it is code shipped with the checkpoint) with the
globals Hugging Face provides (`raise_exception`, `strftime_now`, a JSON `tojson`).
"""
from __future__ import annotations

import json
import operator
import os
import re
import sys
from pathlib import Path

from .config import _Fields, family_of, read_bytes, read_json, read_text
from .errors import CheckpointError


_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def _byte_level_table() -> dict[str, int]:
    """The character a byte-level BPE (GPT-2's convention) writes for each byte: printable Latin-1
    bytes stand for themselves, the other 68 are shifted to the characters from U+0100 on."""
    kept = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    shifted = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(0x100 + n): b for n, b in enumerate(shifted)}}


def _drops_first_space(decoder) -> bool:
    """Whether a tokenizer.json `decoder` removes the space a text's first token begins with."""
    if not isinstance(decoder, dict):
        return False
    kind = decoder.get("type")
    if kind == "Sequence":
        return any(_drops_first_space(d) for d in decoder.get("decoders") or ())
    if kind == "Strip":
        return decoder.get("content") == " " and (decoder.get("start") or 0) > 0
    if kind == "Metaspace":       # its prepended space is taken off the first token again
        scheme = decoder.get("prepend_scheme")
        return scheme in ("first", "always") if scheme is not None else bool(decoder.get("add_prefix_space", True))
    return False


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _sentencepiece_json(path: Path, tc: _Fields | None) -> str:
    """tokenizer.json's text for a checkpoint that ships only a SentencePiece tokenizer.model
    (models/sentencepiece.py), with BOS/EOS as its tokenizer_config.json (`tc`, if any) says in
    add_bos_token / add_eos_token (transformers' Llama-style defaults: BOS, no EOS)."""
    from .sentencepiece import ModelError, converted

    f = path / "tokenizer.model"
    data = read_bytes(f)
    flags = {}
    for key, name in (("add_bos_token", "add_bos"), ("add_eos_token", "add_eos")):
        if tc is not None and tc.raw.get(key) is not None:
            flags[name] = tc.flag(key)
    try:
        return converted(data, **flags)
    except (ModelError, UnicodeDecodeError) as e:
        raise CheckpointError(f"cannot read {f} as a SentencePiece model: {_one_line(e)}") from None


def _text(text) -> str:
    if not isinstance(text, str):       # tokenizers' own TypeError says "TextInputSequence must be str"
        raise TypeError(f"encode takes a str, got {type(text).__name__}")
    return text


def _family(raw: dict) -> str | None:
    """The family of a parsed config.json's `model_type` (`models.config.family_of`), or None (the
    config's own checks name a bad one)."""
    try:
        return family_of(raw.get("model_type"))
    except CheckpointError:
        return None


def _special_tokens(path: Path, tc: _Fields | None) -> dict[str, str]:
    """The bos/eos token strings a chat template sees, found as transformers finds them: those of
    tokenizer_config.json, with a legacy special_tokens_map.json's over them where the config has no
    `added_tokens_decoder` (older exports keep them only there)."""
    sources = [tc] if tc is not None else []
    legacy = path / "special_tokens_map.json"
    if os.path.lexists(legacy) and (tc is None or "added_tokens_decoder" not in tc.raw):
        sources.append(_Fields(read_json(legacy), str(legacy)))
    found = {}
    for src in sources:
        for k in ("bos_token", "eos_token"):
            v = src.raw.get(k)
            if isinstance(v, dict) and isinstance(v.get("content"), str):   # a saved AddedToken
                v = v["content"]
            if v is not None and not isinstance(v, str):
                src.fail(k, "a string or an object with a string \"content\"", v)
            if v is not None:
                found[k] = v
    return found


class Tokenizer:
    def __init__(self, path: str | Path):
        from tokenizers import Tokenizer as _Tok

        path = Path(path)
        cfg = path / "tokenizer_config.json"
        tc = _Fields(read_json(cfg), str(cfg)) if os.path.lexists(cfg) else None
        f = path / "tokenizer.json"
        if not os.path.lexists(f) and os.path.lexists(path / "tokenizer.model"):
            f = path / "tokenizer.model"
            text = _sentencepiece_json(path, tc)
        else:
            text = read_text(f)          # a regular file of sane size, checked before it is opened
        try:
            self._tok = _Tok.from_str(text)
        except Exception as e:  # the tokenizers library raises a generic Exception subclass
            raise CheckpointError(f"cannot read {f}: {_one_line(e)}") from None
        self.size = self._tok.get_vocab_size(with_added_tokens=True)
        self._byte_fallback = '"ByteFallback"' in text      # its decoder joins runs of <0xNN> tokens
        self._byte_level = _byte_level_table() if '"ByteLevel"' in text else None
        self._anchor = self._left_context()          # (id, its text), or None
        self.chat_template, self._template, self._template_source = None, None, ""
        self._specials = _special_tokens(path, tc)
        self._check_mask(tc, path / "config.json")
        jinja = path / "chat_template.jinja"      # newer exporters write the template to its own file,
        if os.path.lexists(jinja):                # which comes first, as in transformers
            self.chat_template = read_text(jinja)
            self._template_source = f"the chat template {jinja}"
        elif tc is not None:
            self.chat_template = _pick_template(tc)
            self._template_source = f"the chat_template of {cfg}"
        if self.chat_template:
            self._template = self._compile()

    def _check_mask(self, tc: _Fields | None, config: Path) -> None:
        """config.json's mask_token_id against the tokenizer's own mask token: a config naming an
        ordinary word (5 = "t5", or LLaDA's 126336 copied into a Dream config) decoded garbage.
        tokenizer_config.json's `mask_token` is the tokenizer's word (another id: an error); without
        it, a mask id that is no added token while a special token named like a mask is: a warning."""
        token = tc.raw.get("mask_token") if tc is not None else None
        token = token.get("content") if isinstance(token, dict) else token
        want = self._tok.token_to_id(token) if isinstance(token, str) else None
        raw = read_json(config) if os.path.lexists(config) else {}
        got = raw.get("mask_token_id") if isinstance(raw, dict) else None
        if not isinstance(got, int) or isinstance(got, bool) or _family(raw) == "diffusion_gemma":
            return          # (the config's own checks name a bad value; DiffusionGemma ignores a mask id)
        name = self._tok.id_to_token(got)
        shown = f"mask_token_id {got} ({'token ' + repr(name) if name is not None else 'no token'} of the tokenizer)"
        if want is not None and got != want:
            raise CheckpointError(f"{config}: {shown} is not the tokenizer's mask token {token!r}, id {want} "
                                  f"(tokenizer_config.json's mask_token): fix one of them")
        added = self._tok.get_added_tokens_decoder()
        masks = {i: t.content for i, t in added.items() if t.special and "mask" in t.content.lower()}
        if want is None and masks and got not in added:
            listed = ", ".join(f"{c!r} (id {i})" for i, c in sorted(masks.items())[:3])
            print(f"warning: {config}: {shown} is an ordinary token, while the tokenizer's special {listed} "
                  f"looks like the mask: decoding masks with a word gives garbage", file=sys.stderr)

    def _compile(self):
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:          # a broken install; --chat reports it when asked for
            return None

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
            return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

        def strftime_now(fmt):
            from datetime import datetime

            return datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = tojson
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        try:
            return env.from_string(self.chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise CheckpointError(f"{self._template_source} does not compile: {_one_line(e.message)} "
                                  f"(line {e.lineno} of the template)") from None
        except Exception as e:       # noqa: BLE001 -- any failure to compile is the checkpoint's
            raise CheckpointError(f"{self._template_source} does not compile: {_one_line(e)}") from None

    def encode(self, text: str, special: bool = True) -> list[int]:
        """Token ids of `text` exactly as given, with the tokenizer's own post-processing (e.g. BOS);
        `special=False` without it: for a rendered chat template, which writes its own BOS (as
        transformers' `apply_chat_template(tokenize=True)` encodes; else the prompt would hold two)."""
        return self._tok.encode(_text(text), add_special_tokens=special).ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each token's (start, end) character span in `text`."""
        enc = self._tok.encode(_text(text))
        return enc.ids, [tuple(o) for o in enc.offsets]

    def id_to_token(self, token_id: int) -> str | None:
        """The tokenizer's entry for `token_id`, or None where it has none (a model row past it)."""
        return self._tok.id_to_token(token_id) if 0 <= token_id else None

    def decode(self, ids) -> str:
        """The text of token ids (ints, numpy or torch integers); ids outside the vocabulary are left out.
        A float or bool is a TypeError (int() would have made 1.5 token 1: silently another text)."""
        try:
            if isinstance(ids, (str, bytes)):
                raise TypeError
            ids = list(ids)                            # (an iterator is read once)
            if any(isinstance(i, bool) for i in ids):
                raise TypeError
            ids = [operator.index(i) for i in ids]
        except TypeError:
            raise TypeError("decode takes a list of integer token ids") from None
        ids = [i for i in ids if self.id_to_token(i) is not None]
        return self._tok.decode(ids, skip_special_tokens=True)

    def continuation(self, ids) -> str:
        """The text `ids` add after earlier text (a completion after its prompt): `decode`, except where
        the decoder drops the space a text begins with (SentencePiece-style: a `Strip` of leading spaces,
        or `Metaspace`), which would join "Answer:" and " 42" as "Answer:42": there the first token's
        space is kept (the ids are decoded after a plain token, whose text is then cut off)."""
        if self._anchor is None:
            return self.decode(ids)
        anchor, base = self._anchor
        text = self.decode([anchor, *ids])
        return text[len(base):] if text.startswith(base) else self.decode(ids)

    def _left_context(self) -> tuple[int, str] | None:
        """A plain token to decode a continuation after, and its text, where the decoder drops a text's
        first space (else None: `continuation` is `decode`)."""
        decoder = self._tok.decoder
        try:
            spec = json.loads(decoder.__getstate__()) if decoder is not None else None
        except (AttributeError, TypeError, ValueError):
            return None
        if not _drops_first_space(spec):
            return None
        for probe in ("a", "x", "0", "."):
            ids = self.encode(probe, special=False)
            if ids and self.decode(ids[-1:]) == probe:
                return ids[-1], probe
        return None

    def settled(self, ids) -> int:
        """How many of `ids` (the start of a longer answer) have a text no later token changes: all but a
        trailing run of byte tokens (<0xNN>) where the decoder has ByteFallback, which decodes such a run as
        one: U+FFFD per byte wherever it is not valid UTF-8, so a later byte can undo a character it showed."""
        n = len(ids)
        if self._byte_fallback:
            while n and _BYTE_TOKEN.fullmatch(self._tok.id_to_token(int(ids[n - 1])) or ""):
                n -= 1
        return n

    def token_bytes(self, i: int) -> bytes:
        """The bytes of one token's text (OpenAI's logprob `bytes`): its UTF-8, except for a token that
        holds part of a character (its text alone is U+FFFD), whose own bytes are given: <0xNN> with a
        byte-fallback decoder, the byte-level characters of a byte-level BPE."""
        text = self.decode([i])
        piece = self._tok.id_to_token(int(i)) if "\ufffd" in text else None
        if piece is not None and self._byte_fallback and _BYTE_TOKEN.fullmatch(piece):
            return bytes([int(piece[3:5], 16)])
        if piece is not None and self._byte_level is not None and all(c in self._byte_level for c in piece):
            return bytes(self._byte_level[c] for c in piece)
        return text.encode("utf-8")

    def token_id(self, token: str) -> int | None:
        """The id of a token string (None if the tokenizer has no such token)."""
        return self._tok.token_to_id(token)

    def set_chat_template(self, text: str, source: str) -> None:
        """Replace the chat template (a server's --chat-template); `source` names it in errors.
        It is compiled at once, so a broken template fails here with one line."""
        self.chat_template, self._template_source = text, source
        self._template = self._compile()

    def apply_chat_template(self, conversation: str | list[dict], add_generation_prompt: bool = True) -> str:
        """A conversation through the checkpoint's chat template, ready for generation (the assistant's
        turn opened; `add_generation_prompt=False`: not, as for a conversation that ends in a prefilled
        assistant message): a string is one user turn, a list holds {"role", "content"} messages."""
        if not self.chat_template:
            raise CheckpointError("a chat prompt (--chat, chat=True) needs the checkpoint's chat template "
                                  "(chat_template.jinja, or chat_template in tokenizer_config.json), and this "
                                  "checkpoint has none")
        if self._template is None:
            self._template = self._compile()
        if self._template is None:
            raise CheckpointError("--chat needs the jinja2 package (pip install jinja2)")
        messages = [{"role": "user", "content": conversation}] if isinstance(conversation, str) else conversation
        try:
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self._specials.get("bos_token", ""), eos_token=self._specials.get("eos_token", ""))
        except Exception as e:       # noqa: BLE001 -- raise_exception, undefined names, type errors, sandbox
            # raise_exception(...) raises a plain TemplateError: its text is the template's own message
            kind = "" if type(e).__name__ == "TemplateError" else f"{type(e).__name__}: "
            raise CheckpointError(f"{self._template_source} failed to render: {kind}{_one_line(e)}") from None


def _pick_template(tc: _Fields) -> str | None:
    """`chat_template` as a string, or the one named "default" of a list of named templates."""
    v = tc.raw.get("chat_template")
    if v is None or isinstance(v, str):
        return v or None
    expected = 'a string or a list of {"name": ..., "template": ...} objects'
    if not isinstance(v, list) or not all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                          and isinstance(t.get("template"), str) for t in v):
        tc.fail("chat_template", expected, v)
    named = {t["name"]: t["template"] for t in v}
    if "default" not in named:
        raise CheckpointError(f"{tc.source}: chat_template lists the named templates {sorted(named)} "
                              f"but none named 'default'")
    return named["default"] or None
