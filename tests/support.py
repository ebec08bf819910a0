"""Helpers several test modules share: a command-line `main` run in-process, random model inputs,
a continuous batch fed on a schedule, the eager stand-in for CUDA-graph capture, a free port, and
`engine.serve` in a subprocess (the shipped model in fp32 on the CPU, one thread)."""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parent.parent
MODEL_DIR = REPO / "models" / "default"
NAME = "default"                     # the served model's name (its directory's)
START_TIMEOUT = 240


def interpreted() -> bool:
    """Whether the Triton kernels run under Triton's interpreter here (every CPU run: element by element
    in numpy), as psd_kernels reads it; False without triton."""
    if importlib.util.find_spec("triton") is None:
        return False
    from psd_kernels.ops._common import INTERPRET

    return INTERPRET


def compiled_only(value, covered_by: str):
    """A kernel test's parameter `value` that runs compiled (a GPU: bench/gpu_report.sh) but is skipped
    under the interpreter, where it costs seconds a case and `covered_by`, a smaller case, takes the same
    code path (e.g. the chunked loop of a long block)."""
    return pytest.param(value, marks=pytest.mark.skipif(
        interpreted(), reason=f"interpreter: {covered_by} takes the same path; runs compiled on a GPU"))


def run_main(main, argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of a command-line `main(argv)` that returns or exits."""
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def random_canvas(cfg, lengths: list[int], n_gen: int, seed: int = 0):
    """(ids [B, N], valid [B, N], P): random ids (never the last two of the vocabulary), rows
    left-padded to the longest prompt length P, then `n_gen` positions."""
    import torch

    g = torch.Generator().manual_seed(seed)
    P = max(lengths)
    N = P + n_gen
    ids = torch.randint(0, cfg.vocab_size - 2, (len(lengths), N), generator=g)
    valid = torch.zeros(len(lengths), N, dtype=torch.bool)
    for b, n in enumerate(lengths):
        valid[b, P - n:] = True
    return ids, valid, P


def run_live(dec, prompts, schedule, max_rows=None, cancel=None) -> SimpleNamespace:
    """Feed `schedule` [(prompt index, gen length or None, step)] into an `engine.live.LiveBatch`
    over decoder `dec` (each added before that step's model call; `cancel` = (prompt index, step))
    and step it until it is idle. Returns `done` (results by prompt index), `pieces` and `tops`
    (streamed, by prompt index), `order` (done order), `rows` (rows per call) and `live`."""
    from engine.live import LiveBatch

    live = LiveBatch(dec, max_rows=max_rows)
    out = SimpleNamespace(done={}, pieces={}, tops={}, order=[], rows=[], live=live)
    index_of = {}
    pending = sorted(schedule, key=lambda s: s[2])
    step = 0
    while True:
        while pending and pending[0][2] <= step:
            i, g, _ = pending.pop(0)
            index_of[live.add(prompts[i], gen_length=g)] = i
        if cancel is not None and step == cancel[1]:
            live.cancel(next(h for h, i in index_of.items() if i == cancel[0]))
        update = live.step()
        step += 1
        if update is None:
            if not pending:
                return out
            continue
        out.rows.append(update.rows)
        for h, p in update.pieces.items():
            out.pieces.setdefault(index_of[h], []).extend(p)
            out.tops.setdefault(index_of[h], []).extend(update.tops.get(h) or [])
        for h, r in update.done.items():
            out.done[index_of[h]] = r
            out.order.append(index_of[h])


class EagerBackend:
    """The stand-in for engine.graphs' capture/replay: `replay` runs the function on the static
    buffers, so the CPU tests run the whole bucketing and padding path of `--cuda-graphs` (and so
    can a GPU, to isolate what replay changes). Built as CUDAGraphBackend is, from a device."""

    def __init__(self, device=None):
        pass

    def capture(self, fn, inputs: tuple):
        from engine.graphs import Captured

        return Captured(lambda: fn(*inputs))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m engine.serve` on a free port with `flags`; its output goes to a log file in `tmp`.
    With `key`, the server takes it from PSD_API_KEY (never inherited from the caller's environment)."""

    def __init__(self, tmp: Path, *flags: str, host: str = "127.0.0.1", key: str | None = None):
        self.port, self.key = free_port(), key
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"server-{self.port}.log"
        self.early = []            # (what, status, body) seen before the model was ready
        cmd = [sys.executable, "-m", "engine.serve", "--model", str(MODEL_DIR), "--host", host,
               "--port", str(self.port), "--device", "cpu", "--threads", "1", *flags]
        env = {k: v for k, v in os.environ.items() if k != "PSD_API_KEY"}
        if key:
            env["PSD_API_KEY"] = key
        env["PYTHONPATH"] = str(REPO)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=open(self.log, "w"), stderr=subprocess.STDOUT)

    def _auth(self, key: str | None = None) -> dict:
        key = key or self.key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def wait_ready(self) -> None:
        """Until GET /health answers 200 (it needs no key); what /health and a completion answered
        while the model loaded is kept in `early`."""
        import httpx

        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.log.read_text()[-2000:]}")
            try:
                r = httpx.get(self.url + "/health", timeout=5)
            except httpx.TransportError:
                time.sleep(0.1)
                continue
            if r.status_code == 200:
                return
            if not self.early:     # still loading: a completion is refused with 503 too
                c = httpx.post(self.url + "/v1/completions", json={"model": NAME, "prompt": "x"},
                               headers=self._auth(), timeout=60)
                self.early = [("health", r.status_code, r.json()), ("completion", c.status_code, c.json())]
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {START_TIMEOUT} s: {self.log.read_text()[-2000:]}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)

    def health(self) -> dict:
        import httpx

        return httpx.get(self.url + "/health", timeout=10).json()

    def wait_running(self, rows: int = 1, timeout: float = 120) -> None:
        """Until /health says at least `rows` sequences are decoding (a request sent is under way)."""
        deadline = time.monotonic() + timeout
        while self.health()["running"] < rows:
            assert time.monotonic() < deadline, f"fewer than {rows} sequences started decoding in {timeout} s"
            time.sleep(0.01)

    def get(self, path: str, key: str | None = None):
        import httpx

        return httpx.get(self.url + path, headers=self._auth(key), timeout=30)

    def client(self, key: str | None = None):
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=key or self.key or "unused", max_retries=0,
                             timeout=300)


def start_servers(*servers: ServerProcess):
    """Wait until every server is ready (all at once: one still loading is seen loading, whichever
    is ready first), yield them, and stop them all (a fixture's body)."""
    from concurrent.futures import ThreadPoolExecutor

    try:
        with ThreadPoolExecutor(len(servers)) as pool:
            for f in [pool.submit(s.wait_ready) for s in servers]:
                f.result()
        yield servers
    finally:
        for s in servers:
            s.stop()


# LLaDA2.0-mini's config.json fields (as SGLang and the authors' configuration class read them) and
# the ids its generation config gives: tests/test_llada2.py maps them, bench's llada2-mini shape equals them
LLADA2_MINI_CONFIG = dict(
    model_type="llada2_moe", architectures=["LLaDA2MoeModelLM"], hidden_size=2048, intermediate_size=5120,
    num_hidden_layers=20, num_attention_heads=16, num_key_value_heads=4, head_dim=128, vocab_size=157184,
    max_position_embeddings=32768, rope_theta=600000, rms_norm_eps=1e-06, partial_rotary_factor=0.5, use_qk_norm=True,
    use_qkv_bias=False, use_bias=False, norm_head=False, tie_word_embeddings=False, hidden_act="silu", num_experts=256,
    num_experts_per_tok=8, num_shared_experts=1, moe_intermediate_size=512, first_k_dense_replace=1, n_group=8,
    topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, score_function="sigmoid",
    moe_router_enable_expert_bias=True, pad_token_id=156892, rope_scaling=None)
LLADA2_MINI_IDS = {"mask_token_id": 156895, "eos_token_id": 156892}


def byte_fallback_tokenizer(path: Path, pieces=("a", "b", "c", "x", "y")):
    """A Llama-style (SentencePiece, byte-fallback) `models.Tokenizer` in `path`: <unk> <s> </s>, the 256 byte
    tokens <0x00>..<0xFF>, then `pieces`; characters outside them are their UTF-8 bytes."""
    from tokenizers import Tokenizer as HF, decoders, models, normalizers

    from models import Tokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for p in ("▁", *pieces):
        vocab.setdefault(p, len(vocab))
    tok = HF(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    return Tokenizer(path)
