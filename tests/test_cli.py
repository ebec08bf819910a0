"""`python -m engine.generate`: output formats, and one-line errors with exit status 2 for every
kind of bad input (never a traceback)."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import ModelConfig
from models.random_checkpoint import make_checkpoint
from engine.cli import main

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("cli") / "llada", "llada", seed=1, eos_bias=8.0,
                              tokenizer_size=60)      # tokenizer smaller than the embedding, as real LLaDA
    return path


def run(argv, capsys):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_output(ckpt, capsys):
    code, out, err = run(["t5 t6 t7", "--model", ckpt, "--method", "confidence", "--threshold", "0.3",
                          "--gen-length", "16", "--block-length", "8", "--json"], capsys)
    assert code == 0 and err == ""
    obj = json.loads(out)
    for key in ("text", "token_ids", "calls", "tokens", "tpf", "seconds", "method"):
        assert key in obj
    assert obj["method"] == "confidence" and obj["tokens"] == len(obj["token_ids"]) <= 16
    assert obj["tpf"] == pytest.approx(obj["tokens"] / obj["calls"])


def test_plain_output_and_undecodable_ids(ckpt, capsys):
    code, out, err = run(["t5 t6 t7", "--model", ckpt, "--gen-length", "16", "--block-length", "8"], capsys)
    assert code == 0
    lines = out.strip().splitlines()
    assert lines[-1].startswith("[greedy cache=none] tokens=")
    assert "calls=" in lines[-1] and "tpf=" in lines[-1]


@pytest.mark.parametrize("stream", [[], ["--stream"]], ids=["plain", "stream"])
def test_plain_output_prints_top_logprobs(ckpt, capsys, stream):
    """--top-logprobs K without --json: one line per generated token between the text and the summary
    line, the same ids (as their text, or <id N>) and probabilities as --json's commit_top."""
    argv = ["t5 t6 t7", "--model", ckpt, "--gen-length", "16", "--block-length", "8", "--top-logprobs", "3"]
    code, out, err = run(argv + ["--json"], capsys)
    assert code == 0, err
    obj = json.loads(out)
    code, out, err = run(argv + stream, capsys)
    assert code == 0, err
    lines = out.rstrip("\n").split("\n")
    start = lines.index("top 3 per generated token (position: token | alternatives and probabilities, "
                        "most likely first):")
    rows = lines[start + 1:-1]
    assert lines[-1].startswith("[greedy cache=none] tokens=") and len(rows) == obj["tokens"]
    for i, (row, t, top) in enumerate(zip(rows, obj["token_ids"], obj["commit_top"])):
        pos, rest = row.split(": ", 1)
        token, alts = rest.split(" | ")
        assert int(pos) == i and len(top) == 3 and token == _shown(t)
        for alt, (a, p) in zip(alts.split(", "), top):
            shown, prob = alt.rsplit(" ", 1)
            assert shown == _shown(a) and float(prob) == pytest.approx(p, rel=6e-3, abs=1e-12)
    assert "<id " in out or all(t < 60 for t in obj["token_ids"])
    code, out, err = run(argv[:-2] + stream, capsys)
    assert code == 0 and "top 3" not in out and "|" not in out          # without the flag: as before


def _shown(token_id: int) -> str:
    """How the plain output writes a token of the test checkpoint (its tokenizer names ids below 60 t<id>)."""
    return f"<id {token_id}>" if token_id >= 60 else repr(f"t{token_id}")


def test_prompt_from_file_and_stdin(ckpt, capsys, tmp_path, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("t5 t6 t7")
    base = ["--model", ckpt, "--gen-length", "8", "--block-length", "8", "--json"]
    a = json.loads(run(["--prompt-file", f, *base], capsys)[1])
    monkeypatch.setattr(sys, "stdin", io.StringIO("t5 t6 t7"))
    b = json.loads(run(["-", *base], capsys)[1])
    c = json.loads(run(["t5 t6 t7", *base], capsys)[1])
    assert a["token_ids"] == b["token_ids"] == c["token_ids"]


def test_threads_set_torch_before_decoding(ckpt, capsys, monkeypatch):
    import torch

    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    base = ["t5 t6 t7", "--model", ckpt, "--gen-length", "8", "--block-length", "8", "--json"]
    assert run(base, capsys)[0] == 0 and seen == []          # default: torch's own, as engine.serve
    assert run([*base, "--threads", "1"], capsys)[0] == 0 and seen == [1]


def test_chat_template(ckpt, capsys):
    code, out, _ = run(["t5", "--chat", "--model", ckpt, "--gen-length", "8", "--block-length", "8", "--json"], capsys)
    assert code == 0 and json.loads(out)["tokens"] >= 1


def _broken(ckpt, tmp_path, edit):
    import shutil

    d = tmp_path / "broken"
    shutil.copytree(ckpt, d)
    edit(d)
    return d


def _edit_config(**kv):
    def f(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(kv)
        (d / "config.json").write_text(json.dumps(cfg))
    return f


def _drop_tensor(d):
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    del sd["model.transformer.blocks.0.up_proj.weight"]
    save_file(sd, str(d / "model.safetensors"))


def _bad_shape(d):
    import torch
    from safetensors.torch import load_file, save_file

    sd = load_file(str(d / "model.safetensors"))
    sd["model.transformer.ln_f.weight"] = torch.ones(3)
    save_file(sd, str(d / "model.safetensors"))


def _tokenless(d):
    """A byte-level BPE tokenizer with no unknown token that knows only `a`, `b`, `ab` (bench.peer's):
    most text is no token at all."""
    from bench.peer import write_peer_tokenizer

    mc = ModelConfig.from_dir(d)
    bos = min({2, 3, 4} - {mc.eos_token_id, mc.mask_token_id})
    write_peer_tokenizer(d, mc.vocab_size, mc.eos_token_id, mc.mask_token_id, bos)


BAD = [
    ("missing model dir", lambda c, t: ["t5", "--model", t / "nope"], "does not exist"),
    ("model path is a file", lambda c, t: ["t5", "--model", c / "config.json"], "not a directory"),
    ("unreadable config", lambda c, t: ["t5", "--model", _broken(c, t, lambda d: (d / "config.json").write_text("{oops"))], "cannot read"),
    ("unknown model_type", lambda c, t: ["t5", "--model", _broken(c, t, _edit_config(model_type="gpt2"))], "unknown model_type 'gpt2'"),
    ("missing tensor", lambda c, t: ["t5", "--model", _broken(c, t, _drop_tensor)], "missing tensor model.transformer.blocks.0.up_proj.weight"),
    ("shape mismatch", lambda c, t: ["t5", "--model", _broken(c, t, _bad_shape)], "tensor model.transformer.ln_f.weight has shape [3], the config implies [64]"),
    ("empty prompt", lambda c, t: ["", "--model", c], "prompt is empty"),
    ("prompt of no token", lambda c, t: ["hello", "--model", _broken(c, t, _tokenless)],
     "the prompt (5 characters) encodes to no token with this model's tokenizer"),
    ("too long", lambda c, t: ["t5 t6 t7", "--model", _broken(c, t, _edit_config(max_sequence_length=40)), "--gen-length", "64"], "exceeds the model's maximum length 40"),
    ("gen not multiple", lambda c, t: ["t5", "--model", c, "--gen-length", "20", "--block-length", "8"], "not a multiple of the block length"),
    ("threshold zero", lambda c, t: ["t5", "--model", c, "--method", "confidence", "--threshold", "0"], "outside (0, 1]"),
    ("threshold big", lambda c, t: ["t5", "--model", c, "--method", "confidence", "--threshold", "1.01"], "outside (0, 1]"),
    ("unknown method", lambda c, t: ["t5", "--model", c, "--method", "beam"], "invalid choice: 'beam'"),
    ("unknown cache", lambda c, t: ["t5", "--model", c, "--cache", "triple"], "invalid choice: 'triple'"),
    ("mask token in prompt", lambda c, t: ["t5 <|mask|> t6", "--model", c], "contains the mask token"),
    ("no prompt", lambda c, t: ["--model", c], "no prompt given"),
    ("missing prompt file", lambda c, t: ["--prompt-file", t / "nope.txt", "--model", c], "cannot read prompt file"),
    ("no model", lambda c, t: ["t5"], "--model"),
]


@pytest.mark.parametrize("name,argv,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_input_one_line_exit_2(ckpt, tmp_path, capsys, name, argv, msg):
    if name == "no model" and (ROOT / "models" / "default" / "config.json").is_file():
        pytest.skip("a default model is shipped")
    with pytest.raises(SystemExit) if "invalid choice" in msg else _nullcontext() as exc:
        code = main([str(a) for a in argv(ckpt, tmp_path)])
    if exc is not None and hasattr(exc, "value"):
        code = exc.value.code
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ")
    assert msg in lines[0]


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("argv,msg", [
    (["t5", "--model", "/nonexistent/model"], "does not exist"),
    (["t5", "--model", "{ckpt}", "--method", "beam"], "invalid choice"),
    (["", "--model", "{ckpt}"], "prompt is empty"),
])
def test_subprocess_exit_status_and_no_traceback(ckpt, argv, msg):
    argv = [a.replace("{ckpt}", str(ckpt)) for a in argv]
    p = subprocess.run([sys.executable, "-m", "engine.generate", *argv], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and p.stdout == ""
    assert len(p.stderr.strip().splitlines()) == 1 and msg in p.stderr


@pytest.mark.skipif(not (ROOT / "models" / "default" / "config.json").is_file(), reason="no shipped model")
@pytest.mark.slow
def test_no_arguments_answers_a_suite_question_with_the_shipped_model():
    """`python -m engine.generate` alone: the shipped model, its sample question, its canvas size."""
    p = subprocess.run([sys.executable, "-m", "engine.generate", "--json"], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=300)
    assert p.returncode == 0, p.stderr
    obj = json.loads(p.stdout)
    assert "sample question" in p.stderr and "Question:" in p.stderr
    assert obj["model"].endswith("default") and 1 <= obj["tokens"] <= 64
    assert obj["text"].strip()


def test_start_up_loads_no_compiler_and_no_tooling():
    """`python -m engine.generate` to its answer imports neither torch's compiler stack (torch._dynamo
    brings triton and sympy: 1.2-1.9 s of start-up on the 2-core machine, which building the model
    on the meta device used to cost through nn.Embedding's normal_) nor the tooling (bench, the
    server's extras, transformers)."""
    code = ("import sys\nfrom engine.cli import main\n"
            "rc = main(['--gen-length', '32', '--threads', '1'])\n"
            "print('imported', rc, sorted(m for m in ('torch._dynamo', 'torch._inductor', 'triton', 'sympy', "
            "'transformers', 'bench', 'fastapi', 'uvicorn', 'engine.serve') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert res.stdout.strip().splitlines()[-1] == "imported 0 []", res.stdout[-2000:] + res.stderr[-2000:]


def test_calibration_prompts_the_tokenizer_makes_no_token_of_are_named(tmp_path):
    """engine.calibrate's prompts file: a line the tokenizer makes no token of is an error naming the
    file and the prompt, not an empty prompt further on."""
    from engine.calibrate import _read_prompts
    from engine.errors import InputError

    class Tok:
        def encode(self, text):
            return [3] if text == "ab" else []

    f = tmp_path / "p.txt"
    f.write_text("ab\nab\n")
    assert _read_prompts(str(f), Tok()) == [[3], [3]]
    f.write_text("ab\nzzz\n")
    with pytest.raises(InputError, match=r"p\.txt: prompt 1: the prompt \(3 characters\) encodes to no token"):
        _read_prompts(str(f), Tok())


def test_random_checkpoint_never_replaces_what_a_directory_holds(tmp_path, capsys):
    """`python -m models.random_checkpoint DIR`: a directory that holds anything (a real checkpoint)
    is refused unless --overwrite; a file in the way or an unwritable place is one error line."""
    from models.random_checkpoint import main as random_checkpoint

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("{\"model_type\": \"llada\"}")
    assert random_checkpoint([str(mine)]) == 2
    assert (mine / "config.json").read_text() == "{\"model_type\": \"llada\"}" and len(list(mine.iterdir())) == 1
    assert "is not empty" in capsys.readouterr().err
    assert random_checkpoint([str(mine), "--overwrite"]) == 0 and (mine / "model.safetensors").is_file()
    (tmp_path / "afile").write_text("x")
    assert random_checkpoint([str(tmp_path / "afile")]) == 2
    assert random_checkpoint([str(tmp_path / "afile" / "sub")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err), err


def test_random_checkpoint_overwrite_leaves_nothing_stale_and_bad_flags_are_one_line(tmp_path, capsys):
    """--overwrite replaces a checkpoint whole: a generation_config.json it does not write would have
    changed the new one's EOS (tokens [56, 5] instead of 29 of them); other files stay. A seed beyond
    the generator's, a non-finite EOS bias (it wrote an unloadable checkpoint) and a bad family are one
    `error:` line, not a traceback or argparse's usage block."""
    from models import load_model
    from models.random_checkpoint import main as random_checkpoint
    from support import run_main

    old = tmp_path / "old"
    old.mkdir()
    (old / "generation_config.json").write_text('{"eos_token_id": 5}')
    (old / "chat_template.jinja").write_text("{{ messages }}")
    (old / "model-00001-of-00002.safetensors").write_bytes(b"stale")
    (old / "notes.txt").write_text("mine")
    assert random_checkpoint([str(old), "--overwrite"]) == 0
    assert sorted(p.name for p in old.iterdir()) == ["config.json", "model.safetensors", "notes.txt",
                                                      "tokenizer.json", "tokenizer_config.json"]
    assert random_checkpoint([str(tmp_path / "fresh")]) == 0
    assert load_model(old).config.eos_token_id == load_model(tmp_path / "fresh").config.eos_token_id
    capsys.readouterr()
    for flags, words in ((["--seed", str(10 ** 23)], "--seed must be in"), (["--eos-bias", "nan"], "must be finite"),
                         (["--family", "gpt2"], "invalid choice")):
        rc, _, err = run_main(random_checkpoint, [str(tmp_path / "new"), *flags], capsys)
        assert rc == 2 and err.startswith("error: ") and words in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / "new").exists()


def test_stream_text_waits_for_a_run_of_byte_tokens(tmp_path):
    """--stream prints a byte-fallback run's text only once it ends (a later byte can turn an "é" shown
    into U+FFFDs): the printed pieces are the text of the answer."""
    from types import SimpleNamespace

    from engine.cli import _stream_text
    from support import byte_fallback_tokenizer

    tok = byte_fallback_tokenizer(tmp_path)
    ids = [tok.token_id(t) for t in ("<0xC3>", "<0xA9>", "<0xE2>", "a")]

    class Decoder:
        def stream(self, prompts):
            yield from (SimpleNamespace(pieces=[[t]], results=None) for t in ids)
            yield SimpleNamespace(pieces=[[]], results=[SimpleNamespace(token_ids=ids)])

    pieces = []
    _stream_text(Decoder(), tok, [1], pieces.append)
    assert "".join(pieces) == tok.decode(ids) == "\ufffd" * 3 + "a"


@pytest.mark.parametrize("command", [False, True])
def test_ctrl_c_while_the_packages_load_is_one_line(command):
    """Ctrl-C in the seconds `import torch` takes ended `python -m engine.generate` with a traceback from inside
    the import (models/_torch.py: quiet_start); once the command runs, SIGINT is KeyboardInterrupt again
    (engine.frontend.guarded), and a program that imports the packages keeps Python's own handling."""
    code = ("import os, signal, sys, time\n"
            f"sys.argv = {['-m'] if command else ['prog.py']!r}\n"
            "import engine\n"                       # loads torch via models/_torch.py
            "os.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(30)\n")
    import signal

    def sigint_default():          # a job started in the background (CI under nohup) inherits SIGINT ignored
        signal.signal(signal.SIGINT, signal.SIG_DFL)

    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, preexec_fn=sigint_default)
    if command:
        assert (res.returncode, res.stderr) == (130, "interrupted\n"), res.stderr[-2000:]
    else:
        assert res.returncode != 130 and res.stderr.rstrip().endswith("KeyboardInterrupt"), res.stderr[-2000:]
    after = ("import os, signal, sys\nsys.argv = ['-m']\nimport engine\nfrom engine.frontend import guarded\n"
             "def run():\n    os.kill(os.getpid(), signal.SIGINT)\n    return 0\n"
             "sys.exit(guarded(run))\n")
    res = subprocess.run([sys.executable, "-c", after], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         capture_output=True, text=True, timeout=120, preexec_fn=sigint_default)
    assert (res.returncode, res.stderr) == (130, "interrupted\n"), res.stderr[-2000:]
