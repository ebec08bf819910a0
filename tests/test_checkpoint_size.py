"""Checkpoints at the sizes users bring (issue #29 item 1).

Real LLaDA-8B / Dream-7B shards are 3-5 GB, so a safetensors shard is trusted as far as its header
describes it (header length inside the file, every tensor's offsets inside the data area, no
overlap, offsets spanning shape x element size) instead of being refused above a fixed byte cap.
The size test writes one checkpoint whose single shard is over 256 MiB (the old cap), the same
weights with an index over a few large shards, and again in many small shards: all three load to
the same weights and decode the same tokens. The hostile cases each give one `error:` line.
"""
from __future__ import annotations

import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import generate
from models import CheckpointError, ModelConfig, load_model
from models.checkpoint import check_safetensors, init_random, save_checkpoint
from models.config import MAX_FILE_BYTES
from models.random_checkpoint import make_checkpoint

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """One model of ~77M parameters (a 100k vocabulary: the embeddings carry the size, the layers
    stay cheap to run) written three ways: one shard over 256 MiB, an index over shards of up to 96 MiB
    and an index over shards of up to 256 KiB (a tensor larger than a shard fills one alone)."""
    base = tmp_path_factory.mktemp("big")
    cfg = ModelConfig.tiny("llada", vocab_size=100_000, hidden_size=384, head_dim=96, intermediate_size=128, num_layers=2)
    model = init_random(cfg, seed=3, std=0.3)
    dirs = {"single": save_checkpoint(model, base / "single"),
            "index": save_checkpoint(model, base / "index", shard_bytes=96 << 20),
            "small": save_checkpoint(model, base / "small", shard_bytes=256 << 10)}
    return model, dirs


def test_a_shard_over_the_old_cap_and_an_index_load_and_decode_like_small_shards(big):
    model, dirs = big
    single = dirs["single"] / "model.safetensors"
    assert single.stat().st_size > MAX_FILE_BYTES                    # the old cap refused this file
    n_index = len(list(dirs["index"].glob("model-*.safetensors")))
    assert 2 <= n_index < len(list(dirs["small"].glob("model-*.safetensors")))
    prompt = [[5, 17, 933, 41_000, 99_001, 7]]
    want = generate(model, prompt, method="confidence", threshold=0.5, gen_length=16, block_length=8)[0]
    expected = model.state_dict()
    for kind, d in dirs.items():
        loaded = load_model(d)
        for name, t in loaded.state_dict().items():
            assert torch.equal(t, expected[name]), (kind, name)
        got = generate(loaded, prompt, method="confidence", threshold=0.5, gen_length=16, block_length=8)[0]
        assert got.token_ids == want.token_ids and len(want.token_ids) > 0, kind
        assert got.calls == want.calls
        del loaded


def test_engine_generate_runs_the_big_single_shard(big, tmp_path):
    """The issue's reproduction: `engine.generate --model DIR` on a one-file checkpoint over 256 MiB."""
    _, dirs = big
    d = tmp_path / "m"
    d.mkdir()
    (d / "model.safetensors").symlink_to(dirs["single"] / "model.safetensors")
    (d / "config.json").write_text((dirs["single"] / "config.json").read_text())
    from models.random_checkpoint import make_tokenizer
    make_tokenizer(d, 100_000, {63: "<|mask|>", 62: "<|eos|>"})
    r = subprocess.run([sys.executable, "-m", "engine.generate", "t5 t17 t933", "--model", str(d), "--json",
                        "--gen-length", "8", "--block-length", "8", "--threads", "1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    if "unrecognized arguments: --threads" in r.stderr:                 # an engine without --threads
        r = subprocess.run([sys.executable, "-m", "engine.generate", "t5 t17 t933", "--model", str(d), "--json",
                            "--gen-length", "8", "--block-length", "8"],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["tokens"] > 0


# ---------------------------------------------------------------------- hostile shards
def _header(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write(f: Path, header: dict, data: bytes, length: int | None = None) -> None:
    h = json.dumps(header).encode()
    f.write_bytes(struct.pack("<Q", len(h) if length is None else length) + h + data)


def _first_tensor(header: dict) -> str:
    return next(k for k in header if k != "__metadata__")


def _truncate(f):
    f.write_bytes(f.read_bytes()[:-100])


def _offsets_past_the_end(f):
    h, data = _header(f)
    name = _first_tensor(h)
    b, e = h[name]["data_offsets"]
    h[name]["data_offsets"] = [b + len(data), e + len(data)]
    _write(f, h, data)


def _offsets_disagree_with_shape(f):
    h, data = _header(f)
    name = _first_tensor(h)
    h[name]["shape"] = [h[name]["shape"][0] * 2, *h[name]["shape"][1:]]
    _write(f, h, data)


def _overlapping(f):
    h, data = _header(f)
    names = [k for k in h if k != "__metadata__"]
    a, b = sorted(names, key=lambda k: h[k]["data_offsets"][0])[:2]
    h[b] = dict(h[a])                                                   # b claims a's bytes
    _write(f, h, data)


def _header_length_lies(f):
    h, data = _header(f)
    _write(f, h, data, length=1 << 40)


def _header_not_json(f):
    h, data = _header(f)
    raw = b"{" * len(json.dumps(h))
    f.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _unknown_dtype(f):
    h, data = _header(f)
    h[_first_tensor(h)]["dtype"] = "Q7"
    _write(f, h, data)


def _shorter_than_eight(f):
    f.write_bytes(b"\x01\x02")


HOSTILE = {
    "truncated": (_truncate, "truncated, or a header that lies"),
    "offsets past the end": (_offsets_past_the_end, "truncated, or a header that lies"),
    "offsets disagree with the shape": (_offsets_disagree_with_shape, "data_offsets span"),
    "overlapping tensors": (_overlapping, "overlap"),
    "header length past the file": (_header_length_lies, "its header claims 1099511627776 bytes"),
    "header not JSON": (_header_not_json, "its header is not JSON"),
    "unknown dtype": (_unknown_dtype, "unknown dtype 'Q7'"),
    "shorter than the length field": (_shorter_than_eight, "shorter than the 8-byte header length"),
}


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    base = tmp_path_factory.mktemp("small")
    return make_checkpoint(base / "one", "llada", seed=2)[0], make_checkpoint(base / "sharded", "llada", seed=2,
                                                                                shard_bytes=20_000)[0]


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_shard_is_one_error_naming_it(small, tmp_path, case):
    edit, message = HOSTILE[case]
    d = _copy(small[1], tmp_path / "m")
    shard = max(sorted(d.glob("model-*.safetensors")), key=lambda f: len(_header(f)[0]))   # >= 2 tensors
    edit(shard)
    with pytest.raises(CheckpointError) as e:
        check_safetensors(shard)
    assert message in str(e.value) and shard.name in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="not a valid safetensors file"):
        load_model(d)


@pytest.mark.parametrize("case", ["offsets past the end", "header length past the file"])
def test_the_cli_reports_a_hostile_single_file_in_one_line(small, tmp_path, case):
    d = _copy(small[0], tmp_path / "m")
    HOSTILE[case][0](d / "model.safetensors")
    r = subprocess.run([sys.executable, "-m", "engine.generate", "t1 t2", "--model", str(d)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and "model.safetensors" in lines[0], r.stderr
    assert "Traceback" not in r.stderr


def test_an_index_naming_a_missing_shard_is_one_error(small, tmp_path):
    d = _copy(small[1], tmp_path / "m")
    victim = sorted(d.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"names shard {victim.name}, which is missing"):
        load_model(d)


def test_json_files_keep_their_cap(small, tmp_path):
    """Only shards lost the byte cap: an oversized config.json (a sparse file) is still refused unread."""
    d = _copy(small[0], tmp_path / "m")
    with open(d / "config.json", "r+b") as f:
        f.truncate(MAX_FILE_BYTES + 1)
    with pytest.raises(CheckpointError, match="too large"):
        load_model(d)


@pytest.mark.slow
def test_bench_load_memory_measures_a_load(small):
    """docs/models.md's memory table comes from this command: the child's peak covers the model."""
    r = subprocess.run([sys.executable, "-m", "bench.load_memory", "--model", str(small[1])],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["shards"] > 1 and out["model_bytes"] > 0
    assert out["peak_rss"] >= out["baseline_rss"] > 0
    bad = subprocess.run([sys.executable, "-m", "bench.load_memory", "--model", str(small[1] / "nope")],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and "Traceback" not in bad.stderr
