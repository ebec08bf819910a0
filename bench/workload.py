"""What the speed benchmarks decode: real model shapes with seeded random weights, and prompts
(a file, a task's held-out problems, or random tokens). bench.speed, its --simulate mode
(bench/simulate.py) and bench.profile_call share them from here."""
from __future__ import annotations

import json

import torch

from engine.errors import InputError, read_user_text
from models import ModelConfig, Tokenizer, Transformer
from models.checkpoint import SkipMetaInit

# Real shapes (docs/algorithms.md §7; docs/gpu.md gives the sources). Token ids are the real ones.
SHAPES: dict[str, dict] = {
    # LLaDA-8B (GSAI-ML/LLaDA-8B-Instruct config.json)
    "llada-8b": dict(family="llada", model_type="llada", vocab_size=126464, hidden_size=4096,
                     intermediate_size=12288, num_layers=32, num_heads=32, num_kv_heads=32, head_dim=128,
                     rope_theta=5e5, rms_eps=1e-5, max_length=4096, mask_token_id=126336,
                     eos_token_id=126081, stop_token_ids=(126348,)),
    # Dream-v0-7B = Qwen2.5-7B's shape (Dream-org/Dream-v0-Instruct-7B config.json)
    "dream-7b": dict(family="dream", model_type="Dream", vocab_size=152064, hidden_size=3584,
                     intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
                     rope_theta=1e6, rms_eps=1e-6, qkv_bias=True, logit_shift=1, position_mode="cumsum",
                     max_length=32768, mask_token_id=151666, eos_token_id=151643, stop_token_ids=(151645,)),
    # openPangu-7B-Diffusion (openpangu/openPangu-R-7B-Diffusion configuration_openpangu_dense.py
    # defaults = openPangu-Embedded-7B: 34 layers, 32/8 heads, MLP 12800, vocab 153376)
    "pangu-7b": dict(family="pangu", model_type="PanguEmbedded", vocab_size=153376, hidden_size=4096,
                     intermediate_size=12800, num_layers=34, num_heads=32, num_kv_heads=8, head_dim=128,
                     rope_theta=1.6e7, rms_eps=1e-6, qkv_bias=True, o_bias=True, logit_shift=1,
                     attention="context_causal", position_mode="cumsum", max_length=32768,
                     mask_token_id=45830, eos_token_id=2, stop_token_ids=(45892,)),
    # LLaDA2.0-mini (inclusionAI/LLaDA2.0-mini config.json; tests/test_llada2.py maps the real file to these):
    # 16.3B parameters, 20 layers (the first dense), 256 routed experts of 512, 8 a token, one shared expert
    "llada2-mini": dict(family="llada2", model_type="llada2_moe", vocab_size=157184, hidden_size=2048,
                        intermediate_size=5120, num_layers=20, num_heads=16, num_kv_heads=4, head_dim=128,
                        rope_theta=6e5, rms_eps=1e-6, attention="block_causal", attention_block=32,
                        max_length=32768, mask_token_id=156895, eos_token_id=156892, pad_token_id=156892,
                        position_mode="cumsum", qk_norm=True, rotary_dim=64, num_experts=256, num_experts_per_tok=8,
                        moe_intermediate_size=512, shared_intermediate_size=512, first_dense_layers=1, n_group=8,
                        topk_group=4, routed_scaling_factor=2.5, norm_topk_prob=True, expert_bias=True),
    # CPU-sized, LLaDA layout: 134M parameters (85M without the embeddings)
    "small": dict(family="llada", model_type="llada", vocab_size=32000, hidden_size=768,
                  intermediate_size=2048, num_layers=12, num_heads=12, num_kv_heads=12, head_dim=64,
                  rope_theta=5e5, rms_eps=1e-5, max_length=8192, mask_token_id=31999, eos_token_id=0),
    # tests and the report's dry run: seconds on a CPU
    "tiny": dict(family="llada", model_type="llada", vocab_size=1024, hidden_size=64, intermediate_size=128,
                 num_layers=2, num_heads=4, num_kv_heads=4, head_dim=16, rope_theta=5e5, rms_eps=1e-5,
                 max_length=8192, mask_token_id=1023, eos_token_id=0),
    "tiny-llada2": dict(family="llada2", model_type="llada2_moe", vocab_size=1024, hidden_size=64,
                        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        rope_theta=6e5, rms_eps=1e-6, attention="block_causal", attention_block=8, max_length=8192,
                        mask_token_id=1023, eos_token_id=0, position_mode="cumsum", qk_norm=True, rotary_dim=8,
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_intermediate_size=32,
                        first_dense_layers=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                        norm_topk_prob=True, expert_bias=True),
    "tiny-dream": dict(family="dream", model_type="Dream", vocab_size=1024, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6, rms_eps=1e-6,
                       qkv_bias=True, logit_shift=1, position_mode="cumsum", max_length=8192, mask_token_id=1023,
                       eos_token_id=0),
}


def shape_config(name: str) -> ModelConfig:
    return ModelConfig(**SHAPES[name])


def build_random(config: ModelConfig, device, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> Transformer:
    """A Transformer with seeded random weights, allocated once on `device` in `dtype` (built on
    the meta device first: an 8B model never exists as a float32 copy, nor on the host)."""
    with torch.device("meta"), SkipMetaInit():
        model = Transformer(config)
    model = model.to(dtype=dtype).to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1, generator=gen)
            else:
                p.normal_(0.0, std if p.dim() > 1 else 5 * std, generator=gen)
    return model.eval().requires_grad_(False)


def cached_block(mode, mc: ModelConfig, batch: int, prefix: int, block_length: int, seed: int, device):
    """`batch` random prompts of `prefix` tokens, then one block of masks each, with the block's first
    call made by the cache mode `mode` (it builds the cache): (x, valid, pos, window, cache)."""
    from engine.cache import Window
    from models import position_ids

    x = torch.tensor(random_prompts(mc, batch, prefix, seed), device=device)
    x = torch.cat((x, torch.full((batch, block_length), mc.mask_token_id, device=device)), 1)
    valid = torch.ones_like(x, dtype=torch.bool)
    pos = position_ids(mc, valid)
    win = Window(prefix, block_length, prefix, block_length)
    with torch.no_grad():
        _, kv = mode.start(x, valid, pos, win)
    return x, valid, pos, win, kv


def verification_call(mode, mc: ModelConfig, block, seq_rows: torch.Tensor, gen: torch.Generator):
    """A function of no arguments running the call a PSD verification makes over `block`
    (`cached_block`'s result): one canvas per entry of `seq_rows` (its sequence's cache row), half
    of each block's positions drafted at random from `gen` (never the mask id)."""
    x, valid, pos, win, kv = block
    S, L = win.lo, win.block_length
    xr = x[seq_rows].clone()
    drafted = torch.rand(len(seq_rows), L, generator=gen) < 0.5
    fill = torch.randint(0, mc.vocab_size, (len(seq_rows), L), generator=gen)
    fill = torch.where(fill == mc.mask_token_id, (fill + 1) % mc.vocab_size, fill)
    xr[:, S:] = torch.where(drafted, fill, torch.full_like(fill, mc.mask_token_id)).to(x.device)
    vr, pr = valid[seq_rows], pos[seq_rows]

    def call():
        with torch.no_grad():
            return mode.call(xr, vr, pr, win, kv, seq_rows)

    return call


def param_count(model: Transformer) -> int:
    return sum(p.numel() for p in model.parameters())


def read_prompt_file(path: str) -> list[str]:
    """One prompt per line; a line holding a JSON object uses its "prompt" field (JSONL files)."""
    lines = read_user_text(path, "prompt file").splitlines()      # a regular file of sane size, checked first
    out = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if line.lstrip().startswith("{"):
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise InputError(f"{path}:{n}: a line starting with '{{' must be a JSON object with a "
                                 f"\"prompt\" field") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise InputError(f"{path}:{n}: a JSON line needs a string \"prompt\" field")
            out.append(obj["prompt"])
        else:
            out.append(line)
    if not out:
        raise InputError(f"prompt file {path} holds no prompt")
    return out


def checkpoint_prompts(args, tok: Tokenizer, n: int) -> tuple[list[list[int]], str]:
    """n prompts (token ids) from --prompts or the task's held-out file, cycled if fewer."""
    if args.prompts:
        texts, source = read_prompt_file(args.prompts), args.prompts
    else:
        from .tasks import get_task

        task = get_task(args.task)
        problems = task.load(None, limit=n)
        texts, source = [task.format_prompt(p) for p in problems], f"{args.task} held-out"
    ids = [tok.encode(t) for t in texts]
    return [ids[i % len(ids)] for i in range(n)], source


def fit_length(prompts: list[list[int]], length: int | None) -> list[list[int]]:
    """Every prompt exactly `length` tokens: its last tokens, preceded by the other prompts'
    tokens as context where it is shorter (None: unchanged)."""
    if length is None:
        return prompts
    pool = [t for p in prompts for t in p]
    out = []
    for p in prompts:
        ctx = pool * (length // max(len(pool), 1) + 1)
        out.append((ctx + p)[-length:] if len(p) < length else p[-length:])
    return out


def random_prompts(mc: ModelConfig, n: int, length: int, seed: int) -> list[list[int]]:
    """Random token ids, never the mask token or a stop token."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, mc.vocab_size, (n, length), generator=gen)
    banned = torch.tensor([mc.mask_token_id, *mc.stop_token_ids])
    safe = next(t for t in range(mc.vocab_size) if t not in banned.tolist())
    return torch.where(torch.isin(ids, banned), safe, ids).tolist()
