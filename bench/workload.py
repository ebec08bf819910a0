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
    # DiffusionGemma-26B-A4B-it's text model (google/diffusion-gemma-26b-a4b-it config.json text_config, and its
    # generation_config.json), read the way the engine reads a checkpoint (`ModelConfig.from_hf`): 30 layers, five
    # sliding-window (1024) layers then a full one whose keys are its values (head dim 512, 2 kv heads); a dense
    # GeGLU MLP of 2112 beside 128 experts of 704, 8 a token; canvases of 256; no mask token (uniform noise)
    "diffusiongemma-26b-a4b": dict(hf=dict(
        architectures=["DiffusionGemmaForBlockDiffusion"], model_type="diffusion_gemma", canvas_length=256,
        tie_word_embeddings=True, text_config=dict(
            model_type="diffusion_gemma_text", vocab_size=262144, hidden_size=2816, intermediate_size=2112,
            num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
            num_global_key_value_heads=2, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=262144,
            rms_norm_eps=1e-6, attention_bias=False, sliding_window=1024, final_logit_softcapping=30.0,
            layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 5, num_experts=128, top_k_experts=8,
            moe_intermediate_size=704, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                                "partial_rotary_factor": 0.25}})),
        generation=dict(max_denoising_steps=48, t_min=0.4, t_max=0.8, stability_threshold=1,
                        confidence_threshold=0.005, eos_token_id=[1, 106, 50], pad_token_id=0,
                        sampler_config={"entropy_bound": 0.1, "_cls_name": "EntropyBoundSamplerConfig"})),
    # the same layout at test size (canvases of 8; what `models.random_checkpoint --family diffusion_gemma` writes)
    "tiny-diffusiongemma": dict(hf=dict(
        architectures=["DiffusionGemmaForBlockDiffusion"], model_type="diffusion_gemma", canvas_length=8,
        tie_word_embeddings=True, text_config=dict(
            model_type="diffusion_gemma_text", vocab_size=1024, hidden_size=64, intermediate_size=96,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
            num_global_key_value_heads=1, max_position_embeddings=8192, sliding_window=4, num_experts=4,
            top_k_experts=2, moe_intermediate_size=32, pad_token_id=0, eos_token_id=1,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"])),
        generation=dict(max_denoising_steps=4, eos_token_id=[1], pad_token_id=0)),
    "tiny-dream": dict(family="dream", model_type="Dream", vocab_size=1024, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=1e6, rms_eps=1e-6,
                       qkv_bias=True, logit_shift=1, position_mode="cumsum", max_length=8192, mask_token_id=1023,
                       eos_token_id=0),
}


def shape_config(name: str) -> ModelConfig:
    """A shape's config: its fields, or (`hf`, `generation`) a config.json and generation_config.json
    read as the engine reads a checkpoint's."""
    shape = SHAPES[name]
    if "hf" in shape:
        return ModelConfig.from_hf(json.loads(json.dumps(shape["hf"])), shape.get("generation"),
                                   source=f"shape {name}", gen_source=f"shape {name} generation config")
    return ModelConfig(**shape)


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


class UniformCalls:
    """A uniform-noise model's calls (DiffusionGemma, docs/algorithms.md §9) in a cache mode's shape,
    made by the engine's own stages (engine/uniform.py): `start` is the encoder over the prefix (the
    KV that opening a block writes, `UniformNoise.encode`), `call` the decoder over canvases, over
    that KV, with a self-conditioning input (`UniformNoise.call`, a denoising step after the first).
    A canvas row reads its own cache row (the engine's call over that many sequences)."""

    def __init__(self, model):
        from engine import DecodeConfig
        from engine.uniform import UniformNoise, for_model

        mc = model.config
        self.model, self.uniform = model, UniformNoise(model, for_model(mc, DecodeConfig()).validate(), mc)

    def start(self, x, valid, pos, win):
        from types import SimpleNamespace

        batch = SimpleNamespace(x=x, valid=valid, pos=pos, memory=None)
        self.uniform.encode(batch, win.lo)
        return None, batch.memory[0]

    def rows(self, kv, seq_rows: torch.Tensor):
        """The encoder cache with one row per canvas (`seq_rows`: each canvas's sequence)."""
        from models import KVCache

        return KVCache([(k[seq_rows], v[seq_rows]) for k, v in kv.layers], kv.key_mask[seq_rows],
                       positions=kv.positions[seq_rows])

    def call(self, x, valid, pos, win, kv, self_cond):
        """The decoder over the canvases x[:, win.lo:] (every row denoising), logits [R, C, V]."""
        from types import SimpleNamespace

        from engine.uniform import Canvas

        R, dev = x.shape[0], x.device
        zeros = torch.zeros(R, dtype=torch.long, device=dev)
        st = Canvas(canvas=x[:, win.lo:], argmax=None, done=None, left=1, sc=self_cond)
        run = SimpleNamespace(noise=st, win=win, cache=kv, pos=pos, stop_at=zeros - 1, calls=zeros.clone(),
                              rows=zeros.clone(), step=zeros.clone())
        self.uniform.call(run, torch.arange(R, device=dev))
        return st.raw


def call_mode(model, cache: str):
    """What makes a benchmark's calls: the cache mode `cache` (engine.CACHE_MODES), or for a
    uniform-noise model (no mask token; its encoder's cache is the paradigm's) `UniformCalls`."""
    if model.config.mask_token_id is None:
        return UniformCalls(model)
    from engine import CACHE_MODES

    return CACHE_MODES[cache](model)


def cached_block(mode, mc: ModelConfig, batch: int, prefix: int, block_length: int, seed: int, device):
    """`batch` random prompts of `prefix` tokens, then one block of masks each, with the block's first
    call made by the cache mode `mode` (it builds the cache): (x, valid, pos, window, cache). A
    uniform-noise model's block is a canvas of random tokens and `mode` (`UniformCalls`) its encoder."""
    from engine.cache import Window
    from models import position_ids

    x = torch.tensor(random_prompts(mc, batch, prefix, seed), device=device)
    gen = torch.Generator().manual_seed(seed)
    block = torch.full((batch, block_length), mc.mask_token_id) if mc.mask_token_id is not None else \
        torch.randint(0, mc.vocab_size, (batch, block_length), generator=gen)
    x = torch.cat((x, block.to(device)), 1)
    valid = torch.ones_like(x, dtype=torch.bool)
    pos = position_ids(mc, valid)
    win = Window(prefix, block_length, prefix, block_length)
    with torch.no_grad():
        _, kv = mode.start(x, valid, pos, win)
    return x, valid, pos, win, kv


def verification_call(mode, mc: ModelConfig, block, seq_rows: torch.Tensor, gen: torch.Generator):
    """A function of no arguments running the call a PSD verification makes over `block`
    (`cached_block`'s result): one canvas per entry of `seq_rows` (its sequence's cache row), half
    of each block's positions drafted at random from `gen` (never the mask id). A uniform-noise
    model's (`UniformCalls`) is a denoising step's decoder call: one random canvas per entry, each
    over its sequence's encoder cache, with random logits as the self-conditioning input."""
    x, valid, pos, win, kv = block
    S, L = win.lo, win.block_length
    xr = x[seq_rows].clone()
    if isinstance(mode, UniformCalls):
        xr[:, S:] = torch.randint(0, mc.vocab_size, (len(seq_rows), L), generator=gen).to(x.device)
        sc = torch.randn(len(seq_rows), L, mc.vocab_size, generator=gen).to(x.device, mode.model.dtype)
        rows_kv, vr, pr = mode.rows(kv, seq_rows), valid[seq_rows], pos[seq_rows]

        def denoise():
            with torch.no_grad():
                return mode.call(xr, vr, pr, win, rows_kv, sc)

        return denoise
    drafted = torch.rand(len(seq_rows), L, generator=gen) < 0.5
    fill = torch.randint(0, mc.vocab_size, (len(seq_rows), L), generator=gen)
    fill = torch.where(fill == mc.mask_token_id, (fill + 1) % mc.vocab_size, fill)
    xr[:, S:] = torch.where(drafted, fill, torch.full_like(fill, mc.mask_token_id)).to(x.device)
    vr, pr = valid[seq_rows], pos[seq_rows]

    def call():
        with torch.no_grad():
            return mode.call(xr, vr, pr, win, kv, seq_rows)

    return call


def kv_width(mc: ModelConfig) -> int:
    """Cached elements per position, all layers together (keys and values of each layer's shape)."""
    kinds = {t: mc.layer_types.count(t) for t in mc.layer_types} if mc.layer_types else {None: mc.num_layers}
    first = {t: (mc.layer_types.index(t) if t is not None else 0) for t in kinds}
    return sum(n * 2 * mc.layer(first[t]).kv_heads * mc.layer(first[t]).head_dim for t, n in kinds.items())


def settle_run(args, mc: ModelConfig | None) -> None:
    """bench.speed's --block-length and --cache for the model `mc` (None: not known yet): when not
    given, 32 and none for a masked model; a uniform-noise model (no mask token) decodes canvases of
    its canvas length over its encoder's cache, so another block length or a --cache is one error
    line (its --cache becomes [None]: not given)."""
    if mc is None or mc.mask_token_id is not None:
        args.block_length = 32 if args.block_length is None else args.block_length
        args.cache = ["none"] if args.cache is None else args.cache
        return
    C = mc.generation_defaults.get("block_length")
    if args.block_length not in (None, C):
        raise InputError(f"a {mc.family} model decodes canvases of its canvas_length {C}; --block-length "
                         f"{args.block_length} differs")
    if args.cache is not None:
        raise InputError(f"--cache does not apply to a {mc.family} model (its encoder's cache is the paradigm's: "
                         f"docs/algorithms.md §9)")
    args.block_length, args.cache = C, [None]


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
    banned = torch.tensor([t for t in (mc.mask_token_id, *mc.stop_token_ids) if t is not None])
    safe = next(t for t in range(mc.vocab_size) if t not in banned.tolist())
    return torch.where(torch.isin(ids, banned), safe, ids).tolist()
