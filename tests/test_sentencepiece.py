"""A checkpoint that ships only a SentencePiece tokenizer.model (openPangu's layout) is read natively
(models/sentencepiece.py): its ids and texts are SentencePiece's own, for BPE and Unigram models
trained with each normalizer setting; BOS/EOS follow tokenizer_config.json; a bad file is one line."""
from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest

from engine.generate import main as generate_main
from models import CheckpointError, Tokenizer
from models.random_checkpoint import make_checkpoint
from support import run_main

spm = pytest.importorskip("sentencepiece")
ROOT = Path(__file__).resolve().parent.parent

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "héllo", "wörld", "汉字", "测试",
         "12345", "x=3+4", "Answer:", "Question", "<tool>"]


def _lines(seed=0, n=400):
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(n)]


def _texts():
    rng = random.Random(1)
    fixed = ["the quick fox", "two  spaces", "  lead and trail  ", "汉字 测试 ü", "zzz 😀", "", " ", "a\nb\tc",
             "Answer: 42", "ÆØÅ ñ", "x=3+4;y", "quick brown fox jumps over the lazy dog " * 3, "\u00a0nbsp",
             "\ufb01 ligature", "\uff26\uff55\uff4c\uff4c width", "\n lead newline"]
    return fixed + ["".join(rng.choice("abcdefghij 汉字😀\n\t  xyz0123ü") for _ in range(rng.randint(0, 30)))
                    for _ in range(150)]


def _train(model_type: str, **opts) -> bytes:
    buf = io.BytesIO()
    kw = dict(model_type=model_type, vocab_size=400, hard_vocab_limit=False, byte_fallback=True,
              character_coverage=1.0, user_defined_symbols=["<tool>"], minloglevel=3)
    spm.SentencePieceTrainer.train(sentence_iterator=iter(_lines()), model_writer=buf, **{**kw, **opts})
    return buf.getvalue()


def _checkpoint(path, model: bytes, tokenizer_config: dict | None = None):
    path.mkdir()
    (path / "tokenizer.model").write_bytes(model)
    if tokenizer_config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return path


SETTINGS = [dict(), dict(add_dummy_prefix=False), dict(remove_extra_whitespaces=False),
            dict(normalization_rule_name="identity"), dict(byte_fallback=False), dict(split_digits=True),
            dict(split_by_whitespace=False)]


@pytest.mark.parametrize("opts", SETTINGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
@pytest.mark.parametrize("model_type", ["bpe", "unigram"])
def test_ids_and_texts_are_sentencepieces_own(tmp_path, model_type, opts):
    model = _train(model_type, **opts)
    sp = spm.SentencePieceProcessor(model_proto=model)
    tok = Tokenizer(_checkpoint(tmp_path / "m", model))
    assert tok.size == sp.get_piece_size()
    wrong = []
    for text in _texts():
        want = sp.encode(text)
        got = tok.encode(text, special=False)
        # an unknown piece: SentencePiece writes " ⁇ ", transformers (and the engine) drop it as special
        same_text = sp.unk_id() in want or tok.decode(got) == sp.decode(want)
        if got != want or not same_text or tok.encode(text) != [sp.bos_id(), *want]:
            wrong.append((text, want, got))
    assert not wrong, f"{len(wrong)} of {len(_texts())} texts differ, first: {wrong[0]}"
    assert any(sp.is_byte(i) for t in _texts() for i in sp.encode(t)) == opts.get("byte_fallback", True)


def test_bos_eos_follow_tokenizer_config_and_control_pieces_are_special(tmp_path):
    model = _train("bpe")
    sp = spm.SentencePieceProcessor(model_proto=model)
    body = sp.encode("the fox")
    for cfg, want in (({"add_bos_token": False}, body), ({"add_eos_token": True}, [1, *body, 2]),
                      ({"add_bos_token": False, "add_eos_token": True}, [*body, 2]), (None, [1, *body])):
        tok = Tokenizer(_checkpoint(tmp_path / f"m{len(list(tmp_path.iterdir()))}", model, cfg))
        assert tok.encode("the fox") == want, cfg
    # what a chat template writes: its control pieces are the special tokens, as in transformers
    tok = Tokenizer(_checkpoint(tmp_path / "chat", model, {"chat_template": "<s>{{ messages[0]['content'] }}</s>",
                                                           "bos_token": "<s>", "eos_token": "</s>"}))
    text = tok.apply_chat_template("the fox")
    assert tok.encode(text, special=False) == [sp.bos_id(), *body, sp.eos_id()]
    assert tok.token_id("<s>") == sp.bos_id() and tok.token_id("<tool>") == sp.piece_to_id("<tool>")


def test_text_beside_a_user_defined_piece_is_normalized_on_its_own(tmp_path):
    """The one documented difference (models/sentencepiece.py): SentencePiece keeps the space before a
    user-defined piece as its own U+2581; here, as in transformers, each side is normalized alone."""
    model = _train("bpe")
    sp = spm.SentencePieceProcessor(model_proto=model)
    tok = Tokenizer(_checkpoint(tmp_path / "m", model))
    tool, space = sp.piece_to_id("<tool>"), sp.piece_to_id("\u2581")
    assert sp.encode("call <tool> now") == [*sp.encode("call"), space, tool, *sp.encode("now")]
    assert tok.encode("call <tool> now", special=False) == [*sp.encode("call"), tool, *sp.encode("now")]


@pytest.mark.parametrize("data, msg", [
    (b"", "no pieces"), (b"\x0a\xff", "truncated"), (b"\x0a\x03\x0a\x01\xff", "utf-8"), (b"\x0f", "wire type 7"),
])
def test_a_broken_model_file_is_one_line(tmp_path, data, msg):
    with pytest.raises(CheckpointError, match=r"cannot read .*tokenizer.model as a SentencePiece model: .*" + msg) as e:
        Tokenizer(_checkpoint(tmp_path / "m", data))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("model_type, opts, msg", [
    ("word", dict(byte_fallback=False, user_defined_symbols=[]), "model type WORD: only BPE and Unigram"),
    ("bpe", dict(treat_whitespace_as_suffix=True), "treat_whitespace_as_suffix is set"),
])
def test_a_model_of_another_kind_is_one_line(tmp_path, model_type, opts, msg):
    with pytest.raises(CheckpointError, match=msg):
        Tokenizer(_checkpoint(tmp_path / "m", _train(model_type, **opts)))


def test_engine_generate_decodes_a_checkpoint_with_only_tokenizer_model(tmp_path, capsys):
    """openPangu's layout end to end: a context-causal checkpoint, its tokenizer a SentencePiece model."""
    model = _train("bpe")
    sp = spm.SentencePieceProcessor(model_proto=model)
    path, _ = make_checkpoint(tmp_path / "pangu", "pangu", seed=2, vocab_size=512, mask_token_id=511,
                              eos_token_id=sp.eos_id(), eos_bias=4.0)
    (path / "tokenizer.json").unlink()
    (path / "tokenizer.model").write_bytes(model)
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    rc, out, err = run_main(generate_main, ["the quick fox", "--model", str(path), "--gen-length", "16",
                                            "--block-length", "8", "--json", "--threads", "1"], capsys)
    assert rc == 0, err
    res = json.loads(out)
    assert res["tokens"] == len(res["token_ids"]) > 0
    assert res["text"] == Tokenizer(path).continuation(res["token_ids"])


def test_a_real_sized_vocabulary_on_real_text(tmp_path):
    """An 8,000-piece byte-fallback BPE trained on the shipped GSM8K test set: every question and answer
    encodes to SentencePiece's ids."""
    rows = [json.loads(line) for line in open(ROOT / "bench" / "data" / "gsm8k" / "test.jsonl", encoding="utf-8")]
    texts = [r[k] for r in rows for k in ("question", "answer")]
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=buf, model_type="bpe", vocab_size=8000,
                                   byte_fallback=True, hard_vocab_limit=False, minloglevel=3)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    tok = Tokenizer(_checkpoint(tmp_path / "m", buf.getvalue()))
    assert tok.size > 4000
    wrong = [t for t in texts if tok.encode(t, special=False) != sp.encode(t)]
    assert not wrong, f"{len(wrong)} of {len(texts)} differ, first: {wrong[0]!r}"


def _kept_files(store: Path) -> list[Path]:
    return sorted(store.glob("*.json")) if store.is_dir() else []


def test_a_conversion_is_kept_and_read_back_without_converting(tmp_path, monkeypatch):
    import models.sentencepiece as sp_mod

    store = tmp_path / "store"
    monkeypatch.setenv("PSD_TOKENIZER_CACHE", str(store))
    model = _train("bpe")
    ck = _checkpoint(tmp_path / "m", model)
    ck_eos = _checkpoint(tmp_path / "m_eos", model, {"add_eos_token": True})
    first = Tokenizer(ck)
    assert len(_kept_files(store)) == 1
    want = [first.encode(t) for t in _texts()]

    def no_conversion(data):
        raise AssertionError("converted again although a conversion was kept")

    monkeypatch.setattr(sp_mod, "read_model", no_conversion)
    assert [Tokenizer(ck).encode(t) for t in _texts()] == want
    with pytest.raises(AssertionError, match="converted again"):    # other flags: another conversion
        Tokenizer(ck_eos)
    monkeypatch.undo()
    monkeypatch.setenv("PSD_TOKENIZER_CACHE", str(store))
    eos = Tokenizer(ck_eos)
    assert len(_kept_files(store)) == 2 and eos.encode("the fox")[-1] == spm.SentencePieceProcessor(
        model_proto=model).eos_id()


def test_a_damaged_kept_conversion_is_redone_and_a_store_that_cannot_be_written_is_no_error(tmp_path, monkeypatch):
    store = tmp_path / "store"
    monkeypatch.setenv("PSD_TOKENIZER_CACHE", str(store))
    model = _train("unigram")
    ck = _checkpoint(tmp_path / "m", model)
    want = [Tokenizer(ck).encode(t) for t in _texts()]
    (kept,) = _kept_files(store)
    good = kept.read_bytes()
    kept.write_bytes(good.replace(b'"Unigram"', b'"BPE"'))      # still JSON, not the conversion
    assert [Tokenizer(ck).encode(t) for t in _texts()] == want
    assert kept.read_bytes() == good                           # replaced by a fresh conversion
    blocked = tmp_path / "a_file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("PSD_TOKENIZER_CACHE", str(blocked))
    assert [Tokenizer(ck).encode(t) for t in _texts()] == want
    assert blocked.read_text() == "not a directory"


@pytest.mark.parametrize("setting", ["off", None])
def test_the_store_is_off_or_under_the_cache_home(tmp_path, monkeypatch, setting):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if setting is None:
        monkeypatch.delenv("PSD_TOKENIZER_CACHE", raising=False)
    else:
        monkeypatch.setenv("PSD_TOKENIZER_CACHE", setting)
    Tokenizer(_checkpoint(tmp_path / "m", _train("bpe")))
    written = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*.json"))
    assert written == ([] if setting else [Path("xdg/psd-engine/tokenizers") / _kept_files(
        tmp_path / "xdg/psd-engine/tokenizers")[0].name])


def test_bench_tokenizer_load_times_a_synthetic_model_sentencepiece_reads_alike(tmp_path, capsys):
    from bench.tokenizer_load import main, synthetic_model

    model = synthetic_model(3000, seed=1)
    sp = spm.SentencePieceProcessor(model_proto=model)
    tok = Tokenizer(_checkpoint(tmp_path / "m", model))
    assert sp.get_piece_size() == tok.size == 3000
    assert [tok.encode(t, special=False) for t in _texts()] == [sp.encode(t) for t in _texts()]
    assert main(["--pieces", "3000", "--rounds", "1"]) == 0
    rows = [line.split("|")[1].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows == ["store", "store off", "empty store", "kept"]
    assert main(["--pieces", "10"]) == 2


def test_no_home_directory_keeps_nothing_and_is_no_error(tmp_path, monkeypatch):
    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("PSD_TOKENIZER_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    model = _train("bpe")
    sp = spm.SentencePieceProcessor(model_proto=model)
    assert Tokenizer(_checkpoint(tmp_path / "m", model)).encode("the fox", special=False) == sp.encode("the fox")


def test_decode_takes_integer_ids_only(tmp_path):
    """Ids are ints, numpy or torch integers, or an iterator of them; a float (int() made 1.5 token 1:
    another text, silently) or a bool is a TypeError; ids outside the vocabulary are left out."""
    import numpy as np
    import torch

    model = _train("bpe")
    sp = spm.SentencePieceProcessor(model_proto=model)
    tok = Tokenizer(_checkpoint(tmp_path / "m", model))
    ids = sp.encode("the quick fox")
    for given in (ids, np.array(ids), torch.tensor(ids), iter(ids), ids + [10 ** 9, -3]):
        assert tok.decode(given) == sp.decode(ids)
    for bad in ([1.5], [True], "abc", None):
        with pytest.raises(TypeError, match="decode takes a list of integer token ids"):
            tok.decode(bad)
    for bad in (None, b"abc", ids, 5):          # tokenizers said only "TextInputSequence must be str"
        for encode in (tok.encode, tok.encode_with_offsets):
            with pytest.raises(TypeError, match=f"encode takes a str, got {type(bad).__name__}"):
                encode(bad)
