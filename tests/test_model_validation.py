"""Bad checkpoints give one clear error, never a traceback or silently wrong output (issue #14).

Each case breaks a tiny real-layout checkpoint the way a user's download or hand edit would:
wrongly typed or inconsistent config.json / generation_config.json fields, broken tokenizer
configs and chat templates, broken sharded checkpoints, and non-finite or non-float weights.
A representative subset runs `python -m engine.generate` as a user would and checks exit status
2, exactly one `error:` line on stderr and no traceback; the rest call the loaders directly and
check the exception type and that the message names the file, the field, tensor or shard.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from models import CheckpointError, ModelConfig, Tokenizer, load_model
from models.random_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One tiny checkpoint per (family, sharded) pair, copied before each edit."""
    base = tmp_path_factory.mktemp("pristine")
    out = {}
    for family in ("llada", "dream", "pangu"):
        out[family] = make_checkpoint(base / family, family, seed=1)[0]
    out["sharded"] = make_checkpoint(base / "sharded", "dream", seed=1, shard_bytes=20_000)[0]
    return out


def _copy(pristine, tmp_path, which="llada") -> Path:
    d = tmp_path / "m"
    shutil.copytree(pristine[which], d)
    return d


def _edit_json(d: Path, name: str, fn) -> None:
    f = d / name
    obj = json.loads(f.read_text()) if f.is_file() else {}
    new = fn(obj)
    f.write_text(json.dumps(obj if new is None else new))


def _set(**kv):
    return lambda o: o.update(kv)


def _drop(*keys):
    def fn(o):
        for k in keys:
            o.pop(k, None)
    return fn


def _cli(d: Path, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "engine.generate", "hi", "--model", str(d), "--gen-length", "32",
                           "--block-length", "32", *extra], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)


def _assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> str:
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert p.returncode == 2, (p.returncode, p.stderr[-3000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), p.stderr
    assert p.stdout == ""
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _rewrite_tensors(f: Path, fn) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(f))
    fn(sd)
    save_file(sd, str(f), metadata={"format": "pt"})


def _poison(name: str, value=float("nan"), dtype=None):
    def fn(sd):
        t = sd[name].clone() if dtype is None else sd[name].to(dtype)
        t.view(-1)[3] = value
        sd[name] = t
    return fn


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("model-*.safetensors"))


# ---------------------------------------------------------------------- config.json
# (family, edit, words the message must hold besides the file name)
CONFIG_CASES = {
    # fp8 tensors failed the file-size check first, blaming the config's sizes
    "quantized": ("dream", _set(quantization_config={"quant_method": "fp8"}),
                  ["quantized checkpoint", "quant_method 'fp8'", "not supported", "bf16 or fp32"]),
    "rope_scaling number": ("dream", _set(rope_scaling=5), ["rope_scaling", "object", "5"]),
    "rope_scaling unsupported": ("llada", _set(rope_scaling={"type": "linear", "factor": 2.0}),
                                 ["rope_scaling", "linear", "not supported"]),
    "hidden_size string": ("dream", _set(hidden_size="64"), ["hidden_size", "positive integer", "'64'"]),
    "d_model string": ("llada", _set(d_model="64"), ["d_model", "positive integer"]),
    "heads zero": ("llada", _set(n_heads=0), ["n_heads", "positive integer", "0"]),
    "heads negative": ("dream", _set(num_attention_heads=-4), ["num_attention_heads", "positive integer", "-4"]),
    "layers zero": ("pangu", _set(num_hidden_layers=0), ["num_hidden_layers", "positive integer"]),
    "intermediate negative": ("dream", _set(intermediate_size=-1), ["intermediate_size", "positive integer"]),
    "vocab zero": ("pangu", _set(vocab_size=0), ["vocab_size", "positive integer"]),
    "kv heads zero": ("llada", _set(n_kv_heads=0), ["n_kv_heads", "positive integer"]),
    "head_dim zero": ("dream", _set(head_dim=0), ["head_dim", "positive integer"]),
    "head_dim odd": ("dream", _set(head_dim=15), ["head_dim", "even"]),
    "max length zero": ("llada", _set(max_sequence_length=0), ["max_sequence_length", "positive integer"]),
    "hidden not divisible by heads": ("llada", _set(d_model=66), ["d_model 66", "n_heads 4", "divisible"]),
    "kv heads do not divide heads": ("dream", _set(num_key_value_heads=3),
                                     ["num_attention_heads 4", "num_key_value_heads 3", "multiple"]),
    "bool for int": ("llada", _set(n_layers=True), ["n_layers", "positive integer", "true"]),
    "float for int": ("dream", _set(num_hidden_layers=2.5), ["num_hidden_layers", "positive integer", "2.5"]),
    "string for bool": ("llada", _set(include_bias="false"), ["include_bias", "true or false", "'false'"]),
    "string for number": ("dream", _set(rms_norm_eps="1e-6"), ["rms_norm_eps", "positive number"]),
    "negative rope theta": ("pangu", _set(rope_theta=-1.0), ["rope_theta", "positive number"]),
    "list for token id": ("llada", _set(mask_token_id=[63]), ["mask_token_id", "non-negative integer"]),
    "float token id": ("llada", _set(mask_token_id=62.5), ["mask_token_id", "non-negative integer"]),
    "object for eos": ("dream", _set(eos_token_id={"id": 62}), ["eos_token_id", "integer or a list"]),
    "pad outside vocab": ("llada", _set(pad_token_id=999), ["pad_token_id 999", "outside the vocabulary"]),
    "model_type not a string": ("llada", _set(model_type=5), ["model_type", "string"]),
    "missing d_model": ("llada", _drop("d_model"), ["d_model", "llada"]),
    "missing num_hidden_layers": ("pangu", _drop("num_hidden_layers"), ["num_hidden_layers"]),
    "missing mask_token_id": ("dream", _drop("mask_token_id"), ["mask_token_id"]),
    "not an object": ("llada", lambda o: [o], ["JSON object", "list"]),
    # switches of the architecture this transformer does not implement: refused, never decoded wrong
    "llada gelu": ("llada", _set(activation_type="gelu"), ["activation_type 'gelu'", "not supported", "only 'silu'"]),
    "llada layer norm": ("llada", _set(layer_norm_type="default"), ["layer_norm_type 'default'", "only 'rms'"]),
    "llada block": ("llada", _set(block_type="sequential"), ["block_type 'sequential'", "only 'llama'"]),
    "llada scaled logits": ("llada", _set(scale_logits=True), ["scale_logits=true", "not supported"]),
    "llada embedding norm": ("llada", _set(input_emb_norm=True), ["input_emb_norm=true", "not supported"]),
    "llada qk norm": ("llada", _set(attention_layer_norm=True), ["attention_layer_norm=true", "not supported"]),
    "llada clipped qkv": ("llada", _set(clip_qkv=8.0), ["clip_qkv 8.0", "not supported", "(none)"]),
    "dream gelu": ("dream", _set(hidden_act="gelu"), ["hidden_act 'gelu'", "only 'silu'"]),
    "pangu relu": ("pangu", _set(hidden_act="relu"), ["hidden_act 'relu'", "only 'silu'"]),
}


@pytest.mark.parametrize("case", list(CONFIG_CASES))
def test_bad_config_field_names_file_and_field(pristine, tmp_path, case):
    family, edit, words = CONFIG_CASES[case]
    d = _copy(pristine, tmp_path, family)
    _edit_json(d, "config.json", edit)
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_dir(d)
    msg = str(e.value)
    assert "\n" not in msg
    assert str(d / "config.json") in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_config_invalid_utf8(pristine, tmp_path):
    d = _copy(pristine, tmp_path)
    (d / "config.json").write_bytes(b'{"model_type": "llada\xff\xfe"}')
    with pytest.raises(CheckpointError, match=re.escape(f"cannot read {d / 'config.json'}") + ".*UTF-8"):
        ModelConfig.from_dir(d)


def test_real_configs_with_null_optionals_still_load(tmp_path):
    """Exporters write null for optional fields; null means 'use the default', not an error."""
    from test_models import REAL_CONFIGS

    raw = dict(REAL_CONFIGS["dream"], rope_scaling=None, num_key_value_heads=None, head_dim=None,
               tie_word_embeddings=None, sliding_window=None)
    c = ModelConfig.from_hf(raw)
    assert c.num_kv_heads == c.num_heads == 28 and c.head_dim == 128 and c.tie_embeddings is False
    c = ModelConfig.from_hf(dict(REAL_CONFIGS["llada"], rope_scaling={"rope_type": "default"}, n_kv_heads=None))
    assert c.num_kv_heads == 32
    # the architecture switches as LLaDA-8B's config.json and Dream's give them
    c = ModelConfig.from_hf(dict(REAL_CONFIGS["llada"], activation_type="silu", block_type="llama",
                                 layer_norm_type="rms", attention_layer_norm=False, input_emb_norm=False,
                                 scale_logits=False, multi_query_attention=None, clip_qkv=None))
    assert c.hidden_size == 4096
    assert ModelConfig.from_hf(dict(REAL_CONFIGS["dream"], hidden_act="silu")).num_heads == 28


# ---------------------------------------------------------------------- generation_config.json
GEN_CASES = {
    "not an object": (lambda o: [1, 2], ["JSON object"]),
    "eos string": (_set(eos_token_id="62"), ["eos_token_id", "integer or a list"]),
    "eos outside vocab": (_set(eos_token_id=[62, 5000]), ["5000", "outside the vocabulary"]),
    "gen_length string": (_set(gen_length="64"), ["gen_length", "positive integer"]),
    "block_length zero": (_set(block_length=0), ["block_length", "positive integer"]),
}


@pytest.mark.parametrize("case", list(GEN_CASES))
def test_bad_generation_config(pristine, tmp_path, case):
    edit, words = GEN_CASES[case]
    d = _copy(pristine, tmp_path)
    _edit_json(d, "generation_config.json", edit)
    with pytest.raises(CheckpointError) as e:
        ModelConfig.from_dir(d)
    msg = str(e.value)
    assert str(d / "generation_config.json") in msg or "outside the vocabulary" in msg, msg
    for w in words:
        assert w in msg, (w, msg)


def test_sizes_generation_config_suggests_are_named_when_they_fail(pristine, tmp_path, capsys):
    """gen_length 30 and block_length 8 from generation_config.json: the error said only 'not a
    multiple', though no flag was given; it names the file. A flag that fails is not blamed on it."""
    from engine.cli import main

    d = _copy(pristine, tmp_path)
    _edit_json(d, "generation_config.json", _set(gen_length=30, block_length=8))
    assert main(["t5", "--model", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not a multiple" in err and \
        f"--gen-length 30 and --block-length 8 from {d / 'generation_config.json'}" in err, err
    assert main(["t5", "--model", str(d), "--gen-length", "12"]) == 2        # 12 is no multiple of 8 either
    err = capsys.readouterr().err
    assert f"--block-length 8 from {d / 'generation_config.json'}" in err and "--gen-length 30" not in err, err
    assert main(["t5", "--model", str(d), "--gen-length", "16", "--threshold", "2"]) == 2
    assert "generation_config.json" not in capsys.readouterr().err       # the flag's own error, not the file's


# ---------------------------------------------------------------------- tokenizer / chat template
TEMPLATE_AT_LOAD = {
    "chat_template not a string": (5, ["chat_template", "string"]),
    "chat_template syntax error": ("{% for m in messages %}{{ m['content'] }}", ["chat_template", "line 1"]),
    "chat_template list without default": ([{"name": "tool_use", "template": "x"}], ["chat_template", "default"]),
}


@pytest.mark.parametrize("case", list(TEMPLATE_AT_LOAD))
def test_broken_chat_template_fails_when_the_tokenizer_is_built(pristine, tmp_path, case):
    value, words = TEMPLATE_AT_LOAD[case]
    d = _copy(pristine, tmp_path)
    _edit_json(d, "tokenizer_config.json", _set(chat_template=value))
    with pytest.raises(CheckpointError) as e:
        Tokenizer(d)
    msg = str(e.value)
    assert str(d / "tokenizer_config.json") in msg and "\n" not in msg, msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.parametrize("template,words", [
    ("{{ raise_exception('only system and user turns are supported') }}", ["only system and user turns"]),
    ("{{ messages[3]['content'] }}", ["chat_template", "render"]),
    ("{{ messages[0]['content'] / 2 }}", ["chat_template", "render"]),
])
def test_chat_template_that_fails_at_render_time(pristine, tmp_path, template, words):
    d = _copy(pristine, tmp_path)
    _edit_json(d, "tokenizer_config.json", _set(chat_template=template))
    tok = Tokenizer(d)                         # compiles fine
    with pytest.raises(CheckpointError) as e:
        tok.apply_chat_template("t5")
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_named_chat_templates_and_special_token_objects(pristine, tmp_path):
    """Hugging Face also stores chat_template as a list of named templates and bos/eos tokens as
    AddedToken objects; the default template is used and the token's content is substituted."""
    d = _copy(pristine, tmp_path)
    _edit_json(d, "tokenizer_config.json", _set(
        chat_template=[{"name": "tool_use", "template": "TOOLS"},
                       {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}],
        bos_token={"content": "<|bos|>", "__type": "AddedToken"}))
    assert Tokenizer(d).apply_chat_template("t5") == "<|bos|>t5"


def test_chat_template_jinja_file(pristine, tmp_path):
    """Newer exporters write the template to chat_template.jinja: it is used, and checked at load."""
    d = _copy(pristine, tmp_path)
    _edit_json(d, "tokenizer_config.json", _drop("chat_template"))
    (d / "chat_template.jinja").write_text("<|user|> {{ messages[0]['content'] }} <|assistant|>")
    assert Tokenizer(d).apply_chat_template("t5") == "<|user|> t5 <|assistant|>"
    (d / "chat_template.jinja").write_text("{% if messages %}unclosed")
    with pytest.raises(CheckpointError, match=re.escape(str(d / "chat_template.jinja")) + " does not compile"):
        Tokenizer(d)


def test_chat_template_jinja_file_comes_before_the_configs_entry(pristine, tmp_path):
    """Both present: the file, as transformers takes it (the config's entry was used: another prompt)."""
    d = _copy(pristine, tmp_path)
    _edit_json(d, "tokenizer_config.json", _set(chat_template="OLD {{ messages[0]['content'] }}"))
    (d / "chat_template.jinja").write_text("NEW {{ messages[0]['content'] }}")
    assert Tokenizer(d).apply_chat_template("t5") == "NEW t5"


def test_special_tokens_map_gives_the_templates_bos_as_transformers_does(pristine, tmp_path):
    """Older exports keep bos/eos only in special_tokens_map.json: a `{{ bos_token }}` template lost its
    BOS. The map is read where tokenizer_config.json has no added_tokens_decoder, and overrides it."""
    d = _copy(pristine, tmp_path)
    _edit_json(d, "tokenizer_config.json", _set(chat_template="{{ bos_token }}{{ messages[0]['content'] }}"))
    _edit_json(d, "tokenizer_config.json", _drop("bos_token"))
    _edit_json(d, "tokenizer_config.json", _drop("added_tokens_decoder"))
    (d / "special_tokens_map.json").write_text(json.dumps({"bos_token": {"content": "t1", "lstrip": False}}))
    assert Tokenizer(d).apply_chat_template("t5") == "t1t5"
    _edit_json(d, "tokenizer_config.json", _set(added_tokens_decoder={}))      # a modern config: the map is legacy
    assert Tokenizer(d).apply_chat_template("t5") == "t5"
    (d / "special_tokens_map.json").write_text(json.dumps({"bos_token": 3}))
    _edit_json(d, "tokenizer_config.json", _drop("added_tokens_decoder"))
    with pytest.raises(CheckpointError, match="special_tokens_map.json: field 'bos_token' must be a string"):
        Tokenizer(d)


def test_chat_template_renders_a_conversation_and_can_be_replaced(pristine, tmp_path):
    """A list of messages goes through the same template; set_chat_template compiles a new one at
    once (a broken one fails there, naming its source)."""
    d = _copy(pristine, tmp_path)
    _edit_json(d, "tokenizer_config.json", _set(
        chat_template="{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                      "{% if add_generation_prompt %}<assistant>{% endif %}"))
    tok = Tokenizer(d)
    conv = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "t5"}]
    assert tok.apply_chat_template(conv) == "<system>be brief<user>t5<assistant>"
    assert tok.apply_chat_template("t5") == "<user>t5<assistant>"
    tok.set_chat_template("[{{ messages[-1]['content'] }}]", "the test's template")
    assert tok.apply_chat_template(conv) == "[t5]"
    with pytest.raises(CheckpointError, match="the test's template does not compile"):
        tok.set_chat_template("{% if x %}unclosed", "the test's template")


def test_chat_template_runs_sandboxed(pristine, tmp_path):
    """A template is code from the checkpoint: it may not reach Python internals."""
    d = _copy(pristine, tmp_path)
    _edit_json(d, "tokenizer_config.json", _set(chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}"))
    with pytest.raises(CheckpointError, match="chat_template"):
        Tokenizer(d).apply_chat_template("t5")


@pytest.mark.parametrize("case", ["list", "special token not a string"])
def test_bad_tokenizer_config(pristine, tmp_path, case):
    d = _copy(pristine, tmp_path)
    if case == "list":
        (d / "tokenizer_config.json").write_text("[]")
        words = ["JSON object"]
    else:
        _edit_json(d, "tokenizer_config.json", _set(eos_token=7))
        words = ["eos_token", "string"]
    with pytest.raises(CheckpointError) as e:
        Tokenizer(d)
    assert str(d / "tokenizer_config.json") in str(e.value)
    for w in words:
        assert w in str(e.value)


# ---------------------------------------------------------------------- sharded checkpoints
INDEX = "model.safetensors.index.json"


def _index_edit(fn):
    return lambda d: _edit_json(d, INDEX, fn)


def _first_shard_to(value):
    def fn(o):
        k = next(iter(o["weight_map"]))
        o["weight_map"][k] = value
    return fn


def _truncate(d):
    f = _shards(d)[1]
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 100])


def _garbage(d):
    _shards(d)[0].write_bytes(b"this is not a safetensors file, it is an HTML error page\n" * 20)


def _directory(d):
    f = _shards(d)[0]
    f.unlink()
    f.mkdir()


def _tensor_moved(d):
    """The index says a tensor is in shard 1, but shard 1 does not hold it."""
    def fn(o):
        first = _shards(d)[0].name
        k = next(k for k, v in o["weight_map"].items() if v != first)
        o["weight_map"][k] = first
    _edit_json(d, INDEX, fn)


def _outside(d):
    shutil.copy(_shards(d)[0], d.parent / "elsewhere.safetensors")
    _edit_json(d, INDEX, lambda o: o["weight_map"].update(
        {k: "../elsewhere.safetensors" for k, v in o["weight_map"].items() if v == _shards(d)[0].name}))


SHARD_CASES = {
    "index not an object": (lambda d: (d / INDEX).write_text("[1, 2]"), [INDEX, "JSON object"]),
    "index invalid utf-8": (lambda d: (d / INDEX).write_bytes(b'{"weight_map": {"a": "\xff"}}'), [INDEX, "UTF-8"]),
    "weight_map a list": (_index_edit(lambda o: o.update(weight_map=[["a", "b"]])), [INDEX, "weight_map", "object"]),
    "weight_map value not a string": (_index_edit(_first_shard_to(5)), [INDEX, "weight_map", "file name"]),
    "weight_map empty": (_index_edit(lambda o: o.update(weight_map={})), [INDEX, "weight_map", "empty"]),
    "shard outside the directory": (_outside, [INDEX, "../elsewhere.safetensors", "inside"]),
    "shard truncated": (_truncate, ["model-00002-of-", "not a valid safetensors file"]),
    "shard not safetensors": (_garbage, ["model-00001-of-", "not a valid safetensors file"]),
    "shard is a directory": (_directory, ["model-00001-of-", "not a regular file"]),
    "index names a tensor its shard lacks": (_tensor_moved, ["model-00001-of-", "does not hold"]),
}


def test_single_file_comes_before_an_index_and_an_absolute_shard_path_inside_is_read(pristine, tmp_path):
    """transformers' order: a stale index beside model.safetensors is not read (its shards gave other
    weights, or a refusal where they were gone). An absolute shard path inside the directory is
    that shard (it was refused as 'not inside')."""
    def same(a, b):
        return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))

    sharded, both = _copy(pristine, tmp_path / "a", "sharded"), _copy(pristine, tmp_path / "b", "dream")
    shutil.copy(sharded / INDEX, both / INDEX)                   # names shards that are not there
    assert same(load_model(both), load_model(pristine["dream"]))
    _edit_json(sharded, INDEX, lambda o: o["weight_map"].update(
        {k: str(sharded / v) for k, v in o["weight_map"].items()}))
    assert same(load_model(sharded), load_model(pristine["sharded"]))


@pytest.mark.parametrize("name", ["model.safetensors", "tokenizer.json", "config.json"])
def test_git_lfs_pointers_are_named_as_such(pristine, tmp_path, name):
    """A clone without git-lfs holds 130-byte pointer files: the shard's 'header claims 2e18 bytes' and
    the tokenizer's 'expected value at line 1' did not say so."""
    d = _copy(pristine, tmp_path)
    (d / name).write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 + "\nsize 5000000000\n")
    with pytest.raises(CheckpointError, match=re.escape(name) + " is a Git LFS pointer.*git lfs pull"):
        load_model(d)
        Tokenizer(d)


def test_a_mask_id_that_is_a_word_is_refused_or_warned(pristine, tmp_path, capsys):
    """config.json's mask_token_id naming an ordinary token (5 = "t5") decoded garbage at exit 0.
    Against tokenizer_config.json's mask_token: an error naming both; without one, a warning where a
    special token looks like the mask."""
    d = _copy(pristine, tmp_path, "dream")
    _edit_json(d, "config.json", _set(mask_token_id=5))
    Tokenizer(d)
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "mask_token_id 5 (token 't5' of the tokenizer) is an ordinary token" in err
    mask = next(t for t in json.loads((d / "tokenizer.json").read_text())["added_tokens"] if "mask" in t["content"])
    _edit_json(d, "tokenizer_config.json", _set(mask_token=mask["content"]))
    with pytest.raises(CheckpointError, match=f"mask_token_id 5 .* is not the tokenizer's mask token "
                                              f"'{re.escape(mask['content'])}', id {mask['id']}"):
        Tokenizer(d)
    _edit_json(d, "config.json", _set(mask_token_id=mask["id"]))
    Tokenizer(d)
    assert capsys.readouterr().err == ""


def test_pytorch_pickles_are_named_with_what_to_do(pristine, tmp_path):
    d = _copy(pristine, tmp_path)
    (d / "model.safetensors").rename(d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin: PyTorch pickles are not loaded.*safe_serialization"):
        load_model(d)


@pytest.mark.parametrize("case", list(SHARD_CASES))
def test_broken_sharded_checkpoint_names_the_shard(pristine, tmp_path, case):
    edit, words = SHARD_CASES[case]
    d = _copy(pristine, tmp_path, "sharded")
    edit(d)
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    msg = str(e.value)
    assert "\n" not in msg
    for w in words:
        assert w in msg, (w, msg)


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_shard(pristine, tmp_path):
    d = _copy(pristine, tmp_path, "sharded")
    f = _shards(d)[0]
    f.chmod(0)
    try:
        with pytest.raises(CheckpointError, match=re.escape(f.name)):
            load_model(d)
    finally:
        f.chmod(0o644)


def test_single_file_truncated(pristine, tmp_path):
    d = _copy(pristine, tmp_path, "pangu")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(CheckpointError, match="model.safetensors is not a valid safetensors file"):
        load_model(d)


# ---------------------------------------------------------------------- weights: finite, floating point
def test_one_nan_weight_is_named(pristine, tmp_path):
    d = _copy(pristine, tmp_path, "dream")
    _rewrite_tensors(d / "model.safetensors", _poison("model.layers.0.self_attn.q_proj.weight"))
    with pytest.raises(CheckpointError, match=re.escape(
            "weight model.layers.0.self_attn.q_proj.weight (model.safetensors) holds 1 NaN/Inf value(s)")):
        load_model(d)
    assert load_model(d, check_finite=False).config.family == "dream"     # the opt-out


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_inf_weight_in_a_bf16_shard_is_named(pristine, tmp_path, value):
    d = _copy(pristine, tmp_path, "sharded")
    f = _shards(d)[-1]
    from safetensors import safe_open

    with safe_open(str(f), "pt") as h:
        name = sorted(h.keys())[0]
    _rewrite_tensors(f, _poison(name, value, dtype=torch.bfloat16))
    with pytest.raises(CheckpointError, match=re.escape(f"weight {name} ({f.name}) holds 1 NaN/Inf value(s)")):
        load_model(d, dtype="bfloat16")


def test_overflow_when_converting_to_float16_is_named(pristine, tmp_path):
    d = _copy(pristine, tmp_path, "llada")
    name = "model.transformer.blocks.1.ff_out.weight"
    _rewrite_tensors(d / "model.safetensors", _poison(name, 1e6))
    load_model(d)                                                        # fine in float32
    with pytest.raises(CheckpointError, match=re.escape(f"weight {name}") + ".*overflow.*float16"):
        load_model(d, dtype="float16")


@pytest.mark.parametrize("dtype,shown", [(torch.int64, "int64"), (torch.bool, "bool"), (torch.uint8, "uint8")])
def test_non_float_weight_is_named(pristine, tmp_path, dtype, shown):
    d = _copy(pristine, tmp_path, "pangu")
    name = "model.layers.1.self_attn.o_proj.bias"
    _rewrite_tensors(d / "model.safetensors", lambda sd: sd.update({name: sd[name].to(dtype)}))
    with pytest.raises(CheckpointError, match=re.escape(
            f"weight {name} (model.safetensors) has dtype {shown}, expected a floating-point tensor")):
        load_model(d)


def test_large_finite_weights_are_not_flagged(pristine, tmp_path):
    """A sum that overflows (float16 rows of 60000s) is not a NaN: the values are then counted."""
    d = _copy(pristine, tmp_path, "llada")
    name = "model.transformer.blocks.0.ff_out.weight"
    _rewrite_tensors(d / "model.safetensors", lambda sd: sd[name].fill_(60000.0))
    assert torch.all(load_model(d, dtype="float16").layers[0].mlp.w_down.weight == 60000)


def test_finite_check_is_a_reduction_not_a_mask(monkeypatch, pristine):
    """The finiteness check must not build a full-size boolean mask per tensor on the normal path
    (that costs ~2 s/GiB on CPU; a sum costs ~0.03 s/GiB and is non-finite iff a value is)."""
    calls = []
    real = torch.isfinite

    def spy(t):
        calls.append(t.numel())
        return real(t)

    monkeypatch.setattr(torch, "isfinite", spy)
    load_model(pristine["llada"])
    assert calls and max(calls) == 1


# ---------------------------------------------------------------------- tied embeddings with a stored head
TIED = {"llada": ("model.transformer.wte.weight", "model.transformer.ff_out.weight"),
        "dream": ("model.embed_tokens.weight", "lm_head.weight"),
        "llada2": ("model.word_embeddings.weight", "lm_head.weight"),
        "diffusion_gemma": ("model.decoder.embed_tokens.weight", "lm_head.weight")}


def _tied(tmp_path, family: str, head_of=lambda emb: emb.clone(), **kw) -> tuple[Path, Path, str, str]:
    """A tied checkpoint of `family` plus its stored head (`head_of(embedding)`), as DeepSpeed or FSDP
    exports write it; (directory, the same checkpoint without the head, embedding name, head name)."""
    emb, head = TIED[family]
    plain = make_checkpoint(tmp_path / "plain", family, seed=1, tie_embeddings=True, **kw)[0]
    d = tmp_path / "m"
    shutil.copytree(plain, d)
    if (d / "model.safetensors").is_file():
        _rewrite_tensors(d / "model.safetensors", lambda sd: sd.update({head: head_of(sd[emb])}))
        return d, plain, emb, head
    from safetensors.torch import load_file, save_file

    index = json.loads((d / "model.safetensors.index.json").read_text())
    embedding = load_file(str(d / index["weight_map"][emb]))[emb]
    save_file({head: head_of(embedding)}, str(d / "head.safetensors"), metadata={"format": "pt"})
    index["weight_map"][head] = "head.safetensors"       # the head in a shard of its own
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d, plain, emb, head


@pytest.mark.parametrize("family,kw", [("llada", {}), ("dream", {}), ("llada2", {}), ("diffusion_gemma", {}),
                                       ("dream", {"shard_bytes": 20_000})], ids=["llada", "dream", "llada2", "dg",
                                                                                 "dream-sharded"])
def test_tied_checkpoint_with_a_stored_equal_head_loads(tmp_path, family, kw):
    """transformers loads a tied checkpoint that stores its head too: so does this loader, skipping
    the head once it equals the embedding; the model is the one without the stored head."""
    d, plain, _, _ = _tied(tmp_path, family, **kw)
    got, want = load_model(d), load_model(plain)
    assert got.output is None and got.config.tie_embeddings
    w = dict(want.named_parameters())
    assert all(torch.equal(p, w[k]) for k, p in got.named_parameters())


def test_tied_head_stored_in_a_narrower_dtype_is_the_embedding(tmp_path):
    """A bfloat16 head of a float32 embedding is equal where bfloat16 can tell (the less precise dtype)."""
    d, _, _, _ = _tied(tmp_path, "dream", lambda emb: emb.to(torch.bfloat16))
    assert load_model(d).output is None


@pytest.mark.parametrize("how", ["value", "shape", "dtype"])
def test_tied_checkpoint_with_a_different_head_is_one_line(tmp_path, monkeypatch, how):
    """A tied model whose stored head is not its embedding is ambiguous: one line naming both tensors
    (the first differing row found through small chunks: the head is compared a chunk at a time)."""
    import models.checkpoint as ckpt

    def edit(emb):
        if how == "shape":
            return emb[:-1].clone()
        if how == "dtype":
            return emb.to(torch.int32)
        t = emb.clone()
        t[37, 5] += 1e-3
        return t

    d, _, emb, head = _tied(tmp_path, "llada", edit)
    monkeypatch.setattr(ckpt, "_COUNT_CHUNK", 64 * 4)          # 4 rows of the tiny model a chunk
    why = {"value": "first at row 37", "shape": "shape [", "dtype": "dtype int32"}[how]
    with pytest.raises(CheckpointError, match=re.escape(f"stored head {head} differs from the embedding {emb} "
                                                        f"({why}")) as e:
        load_model(d)
    assert "weight_tying: true" in str(e.value) and "\n" not in str(e.value)


def test_tied_head_that_differs_is_one_cli_line(tmp_path):
    d, _, emb, head = _tied(tmp_path, "dream", lambda emb: emb * 2)
    _assert_one_line_error(_cli(d), f"stored head {head} differs from the embedding {emb}", "tie_word_embeddings")


def test_untied_checkpoint_still_needs_its_head_and_refuses_strangers(pristine, tmp_path):
    d = _copy(pristine, tmp_path, "dream")
    _rewrite_tensors(d / "model.safetensors", lambda sd: sd.pop("lm_head.weight"))
    with pytest.raises(CheckpointError, match="missing tensor lm_head.weight"):
        load_model(d)
    d = _copy(pristine, tmp_path / "x", "llada")
    _rewrite_tensors(d / "model.safetensors", lambda sd: sd.update({"lm_head.weight": torch.zeros(1)}))
    with pytest.raises(CheckpointError, match="unexpected tensor lm_head.weight"):
        load_model(d)


# ---------------------------------------------------------------------- as a user hits them
def _nan_in_layer0(d):
    _rewrite_tensors(d / "model.safetensors", _poison("model.transformer.blocks.0.q_proj.weight"))


def _int_weight(d):
    name = "model.transformer.blocks.0.attn_norm.weight"
    _rewrite_tensors(d / "model.safetensors", lambda sd: sd.update({name: sd[name].to(torch.int64)}))


CLI_CASES = {
    "rope_scaling number": ("dream", lambda d: _edit_json(d, "config.json", _set(rope_scaling=5)), [],
                            ["config.json", "rope_scaling"]),
    "hidden_size string": ("pangu", lambda d: _edit_json(d, "config.json", _set(hidden_size="64")), [],
                           ["config.json", "hidden_size", "positive integer"]),
    "config.json a list": ("llada", lambda d: (d / "config.json").write_text("[]"), [], ["config.json", "JSON object"]),
    "config.json invalid utf-8": ("llada", lambda d: (d / "config.json").write_bytes(b"{\"a\": \"\xff\"}"), [],
                                  ["config.json", "UTF-8"]),
    "kv heads zero": ("dream", lambda d: _edit_json(d, "config.json", _set(num_key_value_heads=0)), [],
                      ["num_key_value_heads", "positive integer"]),
    "chat template syntax error": ("llada", lambda d: _edit_json(d, "tokenizer_config.json",
                                                                 _set(chat_template="{% if %}")), ["--chat"],
                                   ["tokenizer_config.json", "chat_template"]),
    "chat template raises": ("llada", lambda d: _edit_json(d, "tokenizer_config.json",
                                                           _set(chat_template="{{ raise_exception('no chat') }}")),
                             ["--chat"], ["chat_template", "no chat"]),
    "tokenizer_config a list": ("llada", lambda d: (d / "tokenizer_config.json").write_text("[]"), [],
                                ["tokenizer_config.json", "JSON object"]),
    "index a list": ("sharded", lambda d: (d / INDEX).write_text("[]"), [], [INDEX, "JSON object"]),
    "truncated shard": ("sharded", _truncate, [], ["model-00002-of-", "not a valid safetensors file"]),
    "nan weight": ("llada", _nan_in_layer0, [],
                   ["weight model.transformer.blocks.0.q_proj.weight", "holds 1 NaN/Inf value(s)"]),
    "int weight": ("llada", _int_weight, [], ["model.transformer.blocks.0.attn_norm.weight", "has dtype int64"]),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
@pytest.mark.slow
def test_cli_one_line_error_exit_2(pristine, tmp_path, case):
    which, edit, extra, words = CLI_CASES[case]
    d = _copy(pristine, tmp_path, which)
    edit(d)
    _assert_one_line_error(_cli(d, *extra), *words)


def test_a_chat_template_that_writes_bos_gives_one_bos(tmp_path):
    """A tokenizer that adds BOS (Gemma's, Llama 3's) and a template that writes `{{ bos_token }}`:
    the rendered chat is encoded without the tokenizer's special tokens, as transformers'
    `apply_chat_template(tokenize=True)` does, so the prompt starts with one BOS (it had two) — in
    the text API, engine.generate --chat, the server's chat endpoint and the lm-eval adapter alike."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models as tm, pre_tokenizers, processors

    from engine.config import text_ids
    from engine.serve.request import Limits, parse_request
    from models import Tokenizer
    from models.random_checkpoint import make_checkpoint

    d, _ = make_checkpoint(tmp_path / "m", "llada", seed=0)
    specials = {2: "<bos>", 3: "<turn>", 62: "<|eos|>", 63: "<|mask|>"}
    vocab = {f"t{i}": i for i in range(64) if i not in specials} | {v: k for k, v in specials.items()}
    hf = HFTokenizer(tm.WordLevel(vocab, unk_token="t5"))
    hf.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf.add_special_tokens(list(specials.values()))
    hf.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    hf.save(str(d / "tokenizer.json"))
    template = "{{ bos_token }}{% for m in messages %}<turn> {{ m['content'] }} {% endfor %}<turn>"
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<bos>", "eos_token": "<|eos|>",
                                                         "chat_template": template}))
    tok = Tokenizer(d)
    assert tok.encode("t10 t11") == [2, 10, 11]                   # a plain prompt keeps the tokenizer's BOS
    want = [2, 3, 10, 11, 3]
    assert text_ids(tok, tok.apply_chat_template("t10 t11"), chat=True) == want
    mc = ModelConfig.from_dir(d)
    lim = Limits("m", mc, tok, {"method": "greedy", "gen_length": 8, "block_length": 8}, 4, 4)
    (spec,) = parse_request({"model": "m", "messages": [{"role": "user", "content": "t10 t11"}], "max_tokens": 8},
                            True, lim)
    assert spec.prompt_ids == want
    pytest.importorskip("lm_eval")
    from bench.lm_eval import PsdLM

    lm = PsdLM(model=str(d))                 # lm-eval's --apply_chat_template: lm-eval renders, the adapter encodes
    assert lm.chat_template(True) == template
    rendered = lm.apply_chat_template([{"role": "user", "content": "t10 t11"}])
    assert lm._context_ids(rendered) == want and lm._encode_pair(rendered, " t12") == (want, [12])
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast(tokenizer_file=str(d / "tokenizer.json"), bos_token="<bos>")
    ref.chat_template = template
    assert ref.apply_chat_template([{"role": "user", "content": "t10 t11"}], add_generation_prompt=True,
                                   tokenize=True, return_dict=False) == want
