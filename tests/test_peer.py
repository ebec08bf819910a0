"""bench.peer's pure parts: nothing is downloaded, built or converted here (the build runs only by hand:
`python -m bench.peer build --dir DIR`). tests/data/peer_cli_output.txt is llama-diffusion-cli's real
output (llama-cpp-python 0.3.36's llama.cpp, bench.peer's 100M checkpoint, seed 0, 8 tokens, -fa off): the
engine's `left` decode of the same prompt ids gave the same 8 ids."""
import json
from pathlib import Path

import pytest

from bench import peer

SAMPLE = Path(__file__).parent / "data" / "peer_cli_output.txt"


@pytest.mark.parametrize("argv, msg", [
    ([], "required"),
    (["run", "--peer", "x", "--size", "7B"], "--size"),
    (["run", "--peer", "x", "--threads", "0"], "--threads"),
    (["run"], "--peer"),
    (["build"], "--dir"),
    (["run", "--peer", "x", "--bogus"], "unrecognized"),
])
def test_bad_arguments_are_one_error_line(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        peer.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and msg in err[0]


def test_missing_peer_build_is_one_error_line(capsys, tmp_path):
    assert peer.main(["run", "--peer", str(tmp_path), "--size", "100M"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no ") and "bench.peer build" in err[0]


def test_sizes_are_what_they_say():
    assert 95e6 < peer.n_params(peer.SIZES["100M"]) < 105e6
    assert 290e6 < peer.n_params(peer.SIZES["300M"]) < 310e6


def test_converter_tokenizer(tmp_path):
    from tokenizers import Tokenizer

    layout = peer.write_peer_tokenizer(tmp_path, 64, eos=0, mask=63, bos=1)
    assert layout["specials"] == {0: "<|eos|>", 63: "<|mask|>", 1: "<|bos|>"}
    assert layout["plain"] == {2: "a", 3: "b", 4: "ab"}
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    assert tj["model"]["type"] == "BPE" and tj["model"]["merges"] == [["a", "b"]]   # llama.cpp needs a merge
    assert sorted(tj["model"]["vocab"].values()) == list(range(64))
    added = {t["id"]: t for t in tj["added_tokens"]}
    assert set(added) == set(range(64)) - {2, 3, 4}                     # every id but the plain ones
    assert {i for i, t in added.items() if t["special"]} == {0, 1, 63}
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"], cfg["mask_token"]) == ("<|bos|>", "<|eos|>", "<|mask|>")
    # the CLI applies the chat template unconditionally: this one is the identity
    from jinja2 import Template
    assert Template(cfg["chat_template"]).render(messages=[{"role": "user", "content": "<t9><t5>"}]) == "<t9><t5>"

    ids = [9, 5, 62, 17, 5]
    text = peer.prompt_text(ids, layout)
    assert text == "<t9><t5><t62><t17><t5>"
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(text).ids == ids   # HF side: same ids
    assert peer.parse_pieces(text + "ab<t7>a<|eos|>b", layout) == ids + [4, 7, 2, 0, 3]
    with pytest.raises(ValueError, match="not added tokens"):
        peer.prompt_text([9, 2], layout)
    with pytest.raises(ValueError, match="unparsable"):
        peer.parse_pieces("<t9>zz", layout)
    with pytest.raises(ValueError, match="distinct"):
        peer.token_ids(64, 0, 0, 1)


def test_parse_captured_cli_output():
    r = peer.parse_cli_output(SAMPLE.read_text())
    assert r["total_ms"] > 0 and r["step_ms"] > 0 and 0 <= r["sampling_ms"] < r["step_ms"]
    assert r["call_ms"] == pytest.approx(r["step_ms"] - r["sampling_ms"])
    assert (r["total_ms"], r["step_ms"], r["sampling_ms"]) == (11975.63, 1496.95, 0.13)
    layout = peer.token_ids(32000, eos=0, mask=31999, bos=1)
    assert peer.parse_pieces(r["text"], layout) == [17126, 2509, 31297, 11554, 9263, 28996, 669, 8070]
    with pytest.raises(ValueError, match="total time"):
        peer.parse_cli_output("llama_model_load: error loading model\n")


def test_peer_command_is_left_to_right_one_token_a_step():
    cmd = peer.peer_command(Path("/p"), Path("m.gguf"), "<t5>", 160, 128, 2)
    joined = " ".join(cmd)
    for part in ("--top-k 1", "--temp 0", "--diffusion-steps 128", "--diffusion-block-length 160",
                 "-ub 160", "-c 160", "-t 2", "-tb 2", "--diffusion-algorithm 4", "-ctk f32 -ctv f32", "-fa off"):
        assert part in joined
    assert cmd[0].endswith("build/bin/llama-diffusion-cli")


def test_a_run_that_lost_its_timing_line_is_repeated(tmp_path):
    """The CLI's log thread can drop its last lines at exit (status 0): run_peer runs it again."""
    sample = SAMPLE.read_text()
    cut = sample[:sample.index("total time")]
    (tmp_path / "full.txt").write_text(sample)
    (tmp_path / "cut.txt").write_text(cut)
    fake = tmp_path / "cli"
    fake.write_text(f"#!/bin/sh\nif [ -e {tmp_path}/ran ]; then cat {tmp_path}/full.txt; "
                    f"else touch {tmp_path}/ran; cat {tmp_path}/cut.txt; fi\n")
    fake.chmod(0o755)
    layout = peer.token_ids(32000, eos=0, mask=31999, bos=1)
    r = peer.run_peer([str(fake)], layout)
    assert r["retries"] == 1 and r["step_ms"] == 1496.95 and len(r["ids"]) == 8
    (tmp_path / "ran").unlink()
    fake.write_text(f"#!/bin/sh\ncat {tmp_path}/cut.txt\n")
    with pytest.raises(ValueError, match="total time"):
        peer.run_peer([str(fake)], layout, tries=2)


# ---------------------------------------------------------------------------------------------- answers

def test_answers_tokenizer_prints_eos_and_answers_end_there(tmp_path):
    from bench import peer_answers as pa

    layout = pa.write_answer_tokenizer(tmp_path, 64, eos=0, mask=1, bos=2)
    tj = json.loads((tmp_path / "tokenizer.json").read_text())
    eos = [a for a in tj["added_tokens"] if a["id"] == 0]
    assert eos == [dict(eos[0], content=pa.EOS_PIECE, special=False)]      # printed by the CLI
    assert tj["model"]["vocab"][pa.EOS_PIECE] == 0 and "<|eos|>" not in tj["model"]["vocab"]
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["eos_token"] == pa.EOS_PIECE
    assert 0 not in layout["specials"] and layout["eos"] == 0
    text = pa.peer_text([7, 0, 9], layout)
    assert text == "<t7><e><t9>"
    a, b, ab = sorted(layout["plain"])
    assert pa.peer_answer_ids(f"<t12>ab<t7>a<e><t9><e><e>", layout) == [12, ab, 7, a]
    assert pa.peer_answer_ids("<e><t5>", layout) == []
    with pytest.raises(peer.PeerError, match="no added token"):
        pa.peer_text([7, a], layout)


def test_answers_command_uses_the_timestep_schedule_and_no_bos(tmp_path):
    from bench import peer_answers as pa

    cmd = pa.peer_cmd(tmp_path, tmp_path / "m.gguf", "<t7>", 10, 64, 16, 1)
    assert "--diffusion-block-length" not in cmd and cmd[cmd.index("--diffusion-eps") + 1] == "0.001"
    assert cmd[cmd.index("--diffusion-steps") + 1] == "16" and cmd[cmd.index("-c") + 1] == "74"
    assert cmd[-2:] == ["--override-kv", "tokenizer.ggml.add_bos_token=bool:false"]


def test_answers_without_a_peer_build_is_one_error_line(capsys, tmp_path):
    from bench import peer_answers as pa

    assert pa.main(["--peer", str(tmp_path), "--limit", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no ") and "bench.peer build" in err[0]


def test_answers_block_schedule_rounds_the_canvas_up_and_counts_steps_per_block(tmp_path):
    from bench import peer_answers as pa

    cmd = pa.peer_cmd(tmp_path, tmp_path / "m.gguf", "<t7>", 36, 64, 16, 1, block=32)
    assert cmd[cmd.index("-c") + 1] == "128" and cmd[cmd.index("--diffusion-block-length") + 1] == "32"
    assert cmd[cmd.index("--diffusion-steps") + 1] == "64" and "--diffusion-eps" not in cmd   # 16 x 128 / 32
