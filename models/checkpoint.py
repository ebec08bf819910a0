"""Load and save Hugging Face-format checkpoint directories in each family's real layout.

A directory holds `config.json`, `model.safetensors` or a sharded `model.safetensors.index.json`,
and `tokenizer.json`. Loading builds the model on the meta device and materialises one tensor at
a time straight from the safetensors files, so a 7B checkpoint never needs twice its size in memory.

Every problem with the directory is a `CheckpointError` of one line naming the file, shard or
tensor: a malformed index, a missing, unreadable, truncated or foreign shard, a missing,
unexpected or misshapen tensor (a tied model's stored head is skipped if it is the embedding,
refused if not), a non-float tensor, and a tensor holding NaN or Inf (checked
as each tensor is loaded with one reduction, 0.03-0.1 s per GiB on a 2-core CPU; docs/models.md).
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path

import torch

from .config import LFS_POINTER, ModelConfig, _Fields, check_regular, lfs_message, read_json
from .errors import CheckpointError
from .parallel import TensorParallel, check_divisible, parameter_count_per_rank
from .transformer import Transformer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64, "float16": torch.float16}
# the stored dtypes a weight may have (fp8 needs scales this loader does not apply; ints are not weights)
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INDEX = "model.safetensors.index.json"
_COUNT_CHUNK = 1 << 22      # elements per chunk when NaN/Inf values are counted (bounds the bool temporary)

# internal name suffix -> checkpoint name suffix, per family ("{i}" is the layer index)
_LAYER_NAMES = {
    "llada": {
        "attn_norm.weight": "attn_norm.weight", "attn.wq": "q_proj", "attn.wk": "k_proj", "attn.wv": "v_proj",
        "attn.wo": "attn_out", "ffn_norm.weight": "ff_norm.weight", "mlp.w_gate": "ff_proj",
        "mlp.w_up": "up_proj", "mlp.w_down": "ff_out",
    },
    "qwen": {
        "attn_norm.weight": "input_layernorm.weight", "attn.wq": "self_attn.q_proj", "attn.wk": "self_attn.k_proj",
        "attn.wv": "self_attn.v_proj", "attn.wo": "self_attn.o_proj", "ffn_norm.weight": "post_attention_layernorm.weight",
        "mlp.w_gate": "mlp.gate_proj", "mlp.w_up": "mlp.up_proj", "mlp.w_down": "mlp.down_proj",
    },
}
_TOP_NAMES = {
    "llada": {"tok_embeddings.weight": "model.transformer.wte.weight", "norm.weight": "model.transformer.ln_f.weight",
              "output.weight": "model.transformer.ff_out.weight"},
    "qwen": {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"},
}
_TOP_NAMES["llada2"] = {"tok_embeddings.weight": "model.word_embeddings.weight", "norm.weight": "model.norm.weight",
                        "output.weight": "lm_head.weight"}
_LAYER_PREFIX = {"llada": "model.transformer.blocks.{i}.", "qwen": "model.layers.{i}.", "llada2": "model.layers.{i}.",
                 "diffusion_gemma": ""}
# buffers some exporters write that carry no weights
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# the router's parameters stay float32 whatever the load dtype (as SGLang holds them): a sigmoid
# score rounded to bf16 moves by up to 2^-9, enough to swap two experts' ranks
_FP32_SUFFIXES = ("mlp.router.weight", "mlp.expert_bias")
_SWIGLU = {"w_gate": "gate_proj", "w_up": "up_proj", "w_down": "down_proj"}


def _llada2_layer_names(config: ModelConfig, i: int) -> dict[str, str]:
    """LLaDA2 (BailingMoeV2 names) key -> checkpoint name suffix for layer i. Two kinds of key name
    no parameter: `attn.wqkv.*` (q, k and v in one tensor, heads in that order) and
    `mlp.experts.{e}.*` (one tensor per expert); `_unpack` makes parameters of them, `_pack` the
    reverse."""
    names = {"attn_norm.weight": "input_layernorm.weight", "attn.wqkv.weight": "attention.query_key_value.weight",
             "attn.wo.weight": "attention.dense.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
    if config.qkv_bias:
        names["attn.wqkv.bias"] = "attention.query_key_value.bias"
    if config.qk_norm:
        names.update({"attn.q_norm.weight": "attention.query_layernorm.weight",
                      "attn.k_norm.weight": "attention.key_layernorm.weight"})
    if not config.is_moe_layer(i):
        names.update({f"mlp.{k}.weight": f"mlp.{v}.weight" for k, v in _SWIGLU.items()})
        return names
    names["mlp.router.weight"] = "mlp.gate.weight"
    if config.expert_bias:
        names["mlp.expert_bias"] = "mlp.gate.expert_bias"
    if config.shared_intermediate_size:
        names.update({f"mlp.shared.{k}.weight": f"mlp.shared_experts.{v}.weight" for k, v in _SWIGLU.items()})
    for e in range(config.num_experts):
        names.update({f"mlp.experts.{e}.{k}": f"mlp.experts.{e}.{v}.weight" for k, v in _SWIGLU.items()})
    return names


# DiffusionGemma (DiffusionGemmaForBlockDiffusion): the decoder holds the text weights, which the encoder
# shares (transformers saves them once); only the per-layer output scale is stored for both modes
_DG = "model.decoder."
_TOP_NAMES["diffusion_gemma"] = {
    "tok_embeddings.weight": _DG + "embed_tokens.weight", "norm.weight": _DG + "norm.weight",
    "self_cond.norm.weight": _DG + "self_conditioning.pre_norm.weight",
    **{f"self_cond.mlp.{k}.weight": f"{_DG}self_conditioning.{v}.weight" for k, v in _SWIGLU.items()}}
# the vision tower (and its projection into the text model) of a DiffusionGemma checkpoint: never loaded
_SKIPPED_PREFIXES = {"diffusion_gemma": ("model.encoder.vision_tower.", "model.encoder.embed_vision.")}


def _dg_layer_names(config: ModelConfig, i: int) -> dict[str, str]:
    """DiffusionGemma key -> full checkpoint name for layer i. `moe.w_gate_up` names no parameter:
    the checkpoint's experts.gate_up_proj [E, 2I, H] (gate rows, then up), which `_unpack` splits."""
    pre = f"{_DG}layers.{i}."
    names = {"attn_norm.weight": "input_layernorm.weight", "post_attn_norm.weight": "post_attention_layernorm.weight",
             "ffn_norm.weight": "pre_feedforward_layernorm.weight",
             "post_ffn_norm.weight": "post_feedforward_layernorm.weight",
             "mlp_norm.weight": "post_feedforward_layernorm_1.weight",
             "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight",
             "moe.in_norm.weight": "pre_feedforward_layernorm_2.weight",
             "moe.out_norm.weight": "post_feedforward_layernorm_2.weight",
             "moe.router.weight": "router.proj.weight", "moe.router_scale": "router.scale",
             "moe.expert_scale": "router.per_expert_scale", "moe.w_gate_up": "experts.gate_up_proj",
             "moe.w_down": "experts.down_proj", "dec_scalar": "layer_scalar",
             **{f"mlp.{k}.weight": f"mlp.{v}.weight" for k, v in _SWIGLU.items()}}
    projections = ("q", "k", "o") if config.layer(i).k_is_v else ("q", "k", "v", "o")
    for w in projections:
        names[f"attn.w{w}.weight"] = f"self_attn.{w}_proj.weight"
        if config.qkv_bias:
            names[f"attn.w{w}.bias"] = f"self_attn.{w}_proj.bias"
    out = {k: pre + v for k, v in names.items()}
    out["enc_scalar"] = f"model.encoder.language_model.layers.{i}.layer_scalar"
    return out


def _layout(config: ModelConfig) -> str:
    return config.family if config.family in ("llada", "llada2", "diffusion_gemma") else "qwen"


def checkpoint_names(config: ModelConfig) -> dict[str, str]:
    """{internal parameter name: checkpoint tensor name} for every parameter of the model (for
    LLaDA2, fused q/k/v and per-expert keys stand for some parameters: `_llada2_layer_names`)."""
    lay = _layout(config)
    names = {}
    for k, v in _TOP_NAMES[lay].items():
        if k == "output.weight" and config.tie_embeddings:
            continue
        names[k] = v
    for i in range(config.num_layers):
        pre = _LAYER_PREFIX[lay].format(i=i)
        if lay == "llada2":
            names.update({f"layers.{i}.{k}": pre + v for k, v in _llada2_layer_names(config, i).items()})
            continue
        if lay == "diffusion_gemma":
            names.update({f"layers.{i}.{k}": v for k, v in _dg_layer_names(config, i).items()})
            continue
        for k, v in _LAYER_NAMES[lay].items():
            if k.endswith(".weight"):
                names[f"layers.{i}.{k}"] = pre + v
                continue
            names[f"layers.{i}.{k}.weight"] = pre + v + ".weight"
            has_bias = config.o_bias if k == "attn.wo" else (config.qkv_bias and k in ("attn.wq", "attn.wk", "attn.wv"))
            if has_bias:
                names[f"layers.{i}.{k}.bias"] = pre + v + ".bias"
    return names


def _unpack(config: ModelConfig, state: dict) -> dict:
    """Tensors keyed as `checkpoint_names` keys them -> the model's parameters: a fused q/k/v is
    split into views (no copy), each layer's per-expert tensors are stacked into [E, ...] (one
    layer's copy at a time; the per-expert tensors are released as they are stacked). DiffusionGemma's
    fused expert gate/up is split into two views."""
    if config.family == "diffusion_gemma":
        for i in range(config.num_layers):
            fused = state.pop(f"layers.{i}.moe.w_gate_up")
            state[f"layers.{i}.moe.w_gate"], state[f"layers.{i}.moe.w_up"] = fused.chunk(2, dim=1)
        return state
    if config.family != "llada2":
        return state
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        pre = f"layers.{i}."
        for kind in ("weight", "bias"):
            fused = state.pop(f"{pre}attn.wqkv.{kind}", None)
            if fused is not None:
                for w, part in zip(("wq", "wk", "wv"), fused.split([q, kv, kv])):
                    state[f"{pre}attn.{w}.{kind}"] = part
        if config.is_moe_layer(i):
            for w in _SWIGLU:
                state[f"{pre}mlp.{w}"] = torch.stack(
                    [state.pop(f"{pre}mlp.experts.{e}.{w}") for e in range(config.num_experts)])
    return state


def _pack(config: ModelConfig, params: dict) -> dict:
    """The model's parameters -> tensors keyed as `checkpoint_names` keys them (`_unpack` undone;
    each expert's tensors are copies, as a safetensors file holds no shared storage)."""
    if config.family == "diffusion_gemma":
        out = dict(params)
        for i in range(config.num_layers):
            out[f"layers.{i}.moe.w_gate_up"] = torch.cat((out.pop(f"layers.{i}.moe.w_gate"),
                                                          out.pop(f"layers.{i}.moe.w_up")), dim=1)
        return out
    if config.family != "llada2":
        return params
    out = dict(params)
    for i in range(config.num_layers):
        pre = f"layers.{i}."
        for kind in ("weight", "bias"):
            if f"{pre}attn.wq.{kind}" in out:
                out[f"{pre}attn.wqkv.{kind}"] = torch.cat([out.pop(f"{pre}attn.{w}.{kind}")
                                                           for w in ("wq", "wk", "wv")])
        if config.is_moe_layer(i):
            for w in _SWIGLU:
                for e, t in enumerate(out.pop(f"{pre}mlp.{w}").unbind(0)):
                    out[f"{pre}mlp.experts.{e}.{w}"] = t.clone()
    return out


def _one_line(text) -> str:
    return " ".join(str(text).split())


def _regular(f: Path, what: str) -> None:
    if os.path.lexists(f) and not f.is_file():      # a directory, a FIFO (which would block a read), a socket
        raise CheckpointError(f"{what} {f} is not a regular file")


def available_memory(device: str | torch.device = "cpu") -> int:
    """Bytes of memory on `device`: a CUDA device's total memory, else the machine's physical memory."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device.index or 0).total_memory
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):      # not a POSIX sysconf: no bound from memory
        return 1 << 62


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def check_fits(config: ModelConfig, dtype: torch.dtype, device, source: str = "the config",
               files_bytes: int | None = None, world: int = 1) -> int:
    """The bytes of the weights `config` implies at `dtype` (on one rank of `world` tensor-parallel
    ranks); a CheckpointError before anything is built when they exceed the memory of `device`,
    or when the checkpoint's tensor files (`files_bytes`) are too small to hold them even in a
    2-byte dtype (a config whose sizes are absurd, say n_layers 10^9 or a hidden size of 2^40,
    fails here, not in an allocation)."""
    n = config.parameter_count()
    need = parameter_count_per_rank(config, world) * torch.empty((), dtype=dtype).element_size()
    sizes = (f"{config.num_layers} layers, hidden size {config.hidden_size}, MLP size {config.intermediate_size}, "
             f"vocabulary {config.vocab_size}")
    if files_bytes is not None and 2 * n > files_bytes:
        raise CheckpointError(f"{source} implies {n:.4g} parameters ({sizes}), at least {_gib(2 * n)}, but the "
                              f"checkpoint's tensor files hold {_gib(files_bytes)}")
    have = available_memory(device)
    if need > have:
        where = "GPU" if torch.device(device).type == "cuda" else "machine"
        share = f" per rank of {world}" if world > 1 else ""
        raise CheckpointError(f"{source} implies {n:.4g} parameters ({sizes}): {_gib(need)}{share} in "
                              f"{_dtype_name(dtype)}, more than this {where}'s {_gib(have)} of memory")
    return need


def _open_error(f: Path, e: Exception) -> CheckpointError:
    if isinstance(e, OSError):
        return CheckpointError(f"cannot read {f}: {_one_line(e.strerror or e)}")
    return CheckpointError(f"{f} is not a valid safetensors file ({_one_line(e)})")


# bytes per element of each safetensors dtype (sub-byte float formats are not weights this loader reads)
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}
# the largest safetensors header read (the format's own readers refuse more than 100 MB)
MAX_HEADER_BYTES = 100_000_000


def _header_bytes(f: Path, size: int) -> bytes:
    """The JSON header of the safetensors file `f` of `size` bytes, its declared length checked
    against the file before anything else is read."""
    fd = os.open(f, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        head = os.pread(fd, 8, 0)
        if LFS_POINTER.startswith(head) and os.pread(fd, len(LFS_POINTER), 0) == LFS_POINTER:
            raise CheckpointError(lfs_message(str(f)))
        if len(head) < 8:
            raise CheckpointError(f"{f} is not a valid safetensors file (it is {size} bytes, shorter than "
                                  f"the 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n > MAX_HEADER_BYTES or 8 + n > size:
            raise CheckpointError(f"{f} is not a valid safetensors file (its header claims {n} bytes; "
                                  f"the file has {size - 8} after the length"
                                  + (f", and at most {MAX_HEADER_BYTES} are read)" if n > MAX_HEADER_BYTES else ")"))
        raw = os.pread(fd, n, 8)
        if len(raw) != n:
            raise CheckpointError(f"{f} is not a valid safetensors file (it shrank while its header was read)")
        return raw
    finally:
        os.close(fd)


def check_safetensors(f: Path) -> int:
    """The size of the safetensors file `f` once its header is consistent with it: the header
    length lies within the file, every tensor's dtype is known, its data offsets lie inside the
    data area, do not overlap, and span exactly its shape times its element size. This replaces a
    fixed byte cap on shards (real ones are 3-5 GB): a file is trusted as far as it describes
    itself, and nothing is read but its header. Any inconsistency is one CheckpointError line."""
    try:
        st = check_regular(f, "the shard", limit=sys.maxsize)
        raw = _header_bytes(f, st.st_size)
    except OSError as e:
        raise _open_error(f, e) from None
    bad = f"{f} is not a valid safetensors file"
    try:
        header = json.loads(raw.decode("utf-8").rstrip(" "))
    except (UnicodeDecodeError, ValueError) as e:
        raise CheckpointError(f"{bad} (its header is not JSON: {_one_line(e)})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{bad} (its header is not a JSON object)")
    data = st.st_size - 8 - len(raw)
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        spans.append((*_tensor_span(bad, name, entry, data), name))
    spans.sort()
    for (b0, e0, n0), (b1, _, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{bad} (tensors {n0} and {n1} overlap: bytes {b1}-{e0})")
    return st.st_size


def _naturals(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


def _tensor_span(bad: str, name: str, entry, data: int) -> tuple[int, int]:
    """(begin, end) of one header entry's data, checked against its dtype, shape and the data area."""
    if not isinstance(entry, dict):
        raise CheckpointError(f"{bad} (header entry {name!r} is not an object)")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in _ST_ITEMSIZE:
        raise CheckpointError(f"{bad} (tensor {name} has unknown dtype {_one_line(repr(dtype))[:40]})")
    if not _naturals(shape):
        raise CheckpointError(f"{bad} (tensor {name} has shape {_one_line(repr(shape))[:60]}, "
                              f"expected a list of non-negative integers)")
    if not _naturals(offsets) or len(offsets) != 2 or offsets[0] > offsets[1]:
        raise CheckpointError(f"{bad} (tensor {name} has data_offsets {_one_line(repr(offsets))[:60]})")
    begin, end = offsets
    if end > data:
        raise CheckpointError(f"{bad} (tensor {name} lies at bytes {begin}-{end} of the data, but the file holds "
                              f"{data} bytes of data: truncated, or a header that lies)")
    need = math.prod(shape) * _ST_ITEMSIZE[dtype]
    if end - begin != need:
        raise CheckpointError(f"{bad} (tensor {name} of shape {shape} in {dtype} needs {need} bytes, its "
                              f"data_offsets span {end - begin})")
    return begin, end


def _safe_open(f: Path):
    from safetensors import safe_open

    check_safetensors(f)
    try:
        return safe_open(str(f), framework="pt", device="cpu")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise _open_error(f, e) from None


def _tensor_files(path: Path) -> dict[str, Path]:
    """{checkpoint tensor name: file holding it}, from the single file, else the index (transformers'
    order: a stale index beside a current single file is not read)."""
    index = path / _INDEX
    single = path / "model.safetensors"
    _regular(single, "the weights file")
    _regular(index, "the index")                # a FIFO or device there is refused, never opened
    if single.is_file():
        with _safe_open(single) as f:
            return {name: single for name in f.keys()}
    if index.is_file():
        idx = _Fields(read_json(index), str(index))
        weight_map = idx.raw.get("weight_map")
        if weight_map is None:
            raise CheckpointError(f"{index} lacks the required field 'weight_map'")
        if not isinstance(weight_map, dict):
            idx.fail("weight_map", "an object mapping tensor names to shard file names", weight_map)
        if not weight_map:
            raise CheckpointError(f"{index}: weight_map is empty (it names no tensors)")
        files, checked = {}, {}
        for name, fname in weight_map.items():
            if not isinstance(fname, str) or not fname:
                idx.fail(f"weight_map[{name!r}]", "a shard file name", fname)
            if fname not in checked:
                rel = _inside(Path(fname), path)
                if rel.is_absolute() or ".." in rel.parts:
                    raise CheckpointError(f"{index}: weight_map names the shard {fname!r}, which is not inside {path}")
                f = path / rel
                if not f.exists():
                    raise CheckpointError(f"{_INDEX} names shard {fname}, which is missing from {path}")
                _regular(f, "the shard")
                checked[fname] = f
            files[name] = checked[fname]
        return files
    pickles = sorted(p.name for p in path.glob("pytorch_model*.bin*"))
    raise CheckpointError(f"{path} holds neither model.safetensors nor model.safetensors.index.json" + (
        f" ({', '.join(pickles[:2])}: PyTorch pickles are not loaded, since unpickling runs code; convert them "
        f"to safetensors with transformers' save_pretrained(..., safe_serialization=True))" if pickles else ""))


def _inside(p: Path, root: Path) -> Path:
    """An absolute shard path inside `root` as a relative one (else `p` as given)."""
    if p.is_absolute():
        with contextlib.suppress(ValueError):           # (not resolved: a shard may be a link to a blob)
            return Path(os.path.normpath(p)).relative_to(os.path.abspath(root))
    return p


def _nonfinite(t: torch.Tensor) -> int:
    """How many NaN/Inf values `t` holds.

    The sum of a tensor is finite if every value is (NaN and Inf propagate through any summation
    order), and a sum is a streaming reduction with no temporary: ~0.03-0.1 s/GiB on a 2-core CPU,
    where `isfinite(t).all()` builds a full boolean mask and takes 2-10 s/GiB. Only when the sum
    is not finite (a bad value, or a sum that overflowed) are values counted: each chunk is summed
    again and only the chunks whose sum is not finite are examined value by value."""
    if t.numel() == 0 or bool(torch.isfinite(t.sum())):
        return 0
    flat = t.reshape(-1)
    count = 0
    for i in range(0, flat.numel(), _COUNT_CHUNK):
        chunk = flat[i:i + _COUNT_CHUNK]
        if not bool(torch.isfinite(chunk.sum())):
            count += int((~torch.isfinite(chunk)).sum())
    return count


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Inside it, `normal_` (an nn.Embedding's initialisation) does nothing to a tensor on the meta
    device, which has no values to set. Its meta kernel imports torch._dynamo, and with it triton
    and sympy: 1.2-1.9 s of a 2-core CPU before the first token, for a model whose every parameter
    the checkpoint's tensors replace right after. Any other call runs as usual."""

    INITS = (torch.nn.init.normal_, torch.Tensor.normal_)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.INITS:
            t = args[0] if args else kwargs.get("tensor")
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def checked_device(name, error=CheckpointError) -> torch.device:
    """`name` (cpu, cuda, cuda:N, auto or a torch.device) as a device this process can load onto; else `error`
    in one line (torch raises assertion and parse errors of its own, or fails later on a meta tensor)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, TypeError):
        raise error(f"unknown device {name!r}; expected cpu, cuda, cuda:N or auto") from None
    if dev.type not in ("cpu", "cuda"):
        raise error(f"device {name!r} is not supported; expected cpu, cuda, cuda:N or auto")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise error(f"device {name} requested but CUDA is not available")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise error(f"device {name} requested but only {torch.cuda.device_count()} CUDA device(s) exist")
    return dev


def load_model(path: str | os.PathLike, dtype: str | torch.dtype = "float32", device: str | torch.device = "cpu",
               check_finite: bool = True, tp: TensorParallel | None = None) -> Transformer:
    """Load a checkpoint directory of any supported family into a `Transformer` (eval mode).

    With `check_finite` (the default) every tensor is checked for NaN/Inf after its conversion to
    `dtype`, one reduction per tensor (a fraction of the time the read itself takes; measured
    in docs/models.md); `check_finite=False` skips it for callers that have validated the files.
    With `tp` (models/parallel.py) the model is this rank's shard: each split tensor is read as
    this rank's slice only (safetensors `get_slice`), never whole."""
    if not isinstance(path, (str, os.PathLike)):
        raise CheckpointError(f"the model directory must be a str or a path, got {type(path).__name__}")
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"model directory {path} does not exist or is not a directory")
    if not os.access(path, os.R_OK | os.X_OK):
        raise CheckpointError(f"model directory {path} is not readable")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise CheckpointError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
        dtype = DTYPES[dtype]
    elif dtype not in DTYPES.values():
        raise CheckpointError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)} (or its torch dtype)")
    device = str(checked_device(device))
    config = ModelConfig.from_dir(path)
    tp = tp if tp is not None and tp.world > 1 else None
    world = tp.world if tp is not None else 1
    check_divisible(config, world)
    files = _tensor_files(path)
    skipped = [name for name in files if name.startswith(_SKIPPED_PREFIXES.get(config.family, ()))]
    if skipped:
        print(f"{path}: not loading the vision tower ({len(skipped)} tensors under "
              f"{' and '.join(_SKIPPED_PREFIXES[config.family])}): this engine runs the text model", file=sys.stderr)
    check_fits(config, dtype, device, str(path / "config.json"),
               sum(check_safetensors(f) for f in set(files.values())), world)
    check_tied_head(config, files)
    with torch.device("meta"), SkipMetaInit():
        full = Transformer(config)
        model = Transformer(config, tp) if tp is not None else full
    shapes = {k: tuple(p.shape) for k, p in _pack(config, dict(full.named_parameters())).items()}
    state = {}
    for fpath, names in _shards(config, path, files).items():          # one shard open at a time
        with _safe_open(fpath) as f:
            held = set(f.keys())
            for internal, name in names.items():
                if name not in held:
                    raise CheckpointError(f"{fpath} does not hold tensor {name}, which {_INDEX} places there")
                index = tp.shard_index(internal, shapes[internal]) if tp is not None else None
                want = torch.float32 if internal.endswith(_FP32_SUFFIXES) else dtype
                state[internal] = _read_tensor(f, fpath, name, shapes[internal], want, device, check_finite, index)
    model.load_state_dict(_unpack(config, state), strict=True, assign=True)
    model.requires_grad_(False)
    return model.eval()


def _shards(config: ModelConfig, path: Path, files: dict[str, Path] | None = None) -> dict[Path, dict[str, str]]:
    """file -> {internal name: checkpoint name} of every tensor the config expects; an unexpected
    or missing tensor is an error naming it."""
    expected = checkpoint_names(config)
    files = _tensor_files(path) if files is None else files
    known = set(expected.values())
    skipped = _SKIPPED_PREFIXES.get(config.family, ())
    known |= {_tied_head(config)} - {None}    # stored anyway by some exporters: check_tied_head compares it
    for name in files:
        if name not in known and not name.endswith(_IGNORED_SUFFIXES) and not name.startswith(skipped):
            raise CheckpointError(f"unexpected tensor {name} in {path} for a {config.family} model")
    missing = [v for v in expected.values() if v not in files]
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]} in {path}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    by_file: dict[Path, dict[str, str]] = {}
    for internal, name in expected.items():
        by_file.setdefault(files[name], {})[internal] = name
    return by_file


def _tied_head(config: ModelConfig) -> str | None:
    """The checkpoint name of the LM head a tied model shares with its embedding, else None."""
    if not config.tie_embeddings:
        return None
    return _TOP_NAMES.get(_layout(config), {}).get("output.weight", "lm_head.weight")


def check_tied_head(config: ModelConfig, files: dict[str, Path]) -> None:
    """A tied model's head tensor, which exporters (DeepSpeed, FSDP) may store although it is the
    embedding, is accepted and skipped if it equals the embedding as stored (compared in the less
    precise of the two stored dtypes, chunk by chunk straight from the files: no extra copy of
    either); one that differs is one error line naming both (which one is the head is a guess)."""
    head = _tied_head(config)
    if head is None or head not in files:
        return
    emb = checkpoint_names(config)["tok_embeddings.weight"]
    tie = "weight_tying" if config.family == "llada" else "tie_word_embeddings"

    def differs(why: str) -> CheckpointError:
        return CheckpointError(f"{files[head]}: the config ties the head to the embedding ({tie}: true), but the "
                               f"stored head {head} differs from the embedding {emb} ({why}); a tied model with "
                               f"a different head is ambiguous")

    with _safe_open(files[emb]) as fe, _safe_open(files[head]) as fh:
        try:
            e, h = fe.get_slice(emb), fh.get_slice(head)
            shape = list(e.get_shape())
            if list(h.get_shape()) != shape:
                raise differs(f"shape {list(h.get_shape())}, the embedding's {shape}")
            step = max(1, _COUNT_CHUNK // max(1, math.prod(shape[1:])))
            for i in range(0, shape[0] if shape else 0, step):
                a, b = e[i:i + step], h[i:i + step]
                if b.dtype not in _FLOAT_DTYPES or a.dtype not in _FLOAT_DTYPES:
                    raise differs(f"dtype {_dtype_name(b.dtype)}, the embedding's {_dtype_name(a.dtype)}")
                common = max(a.dtype, b.dtype, key=lambda d: torch.finfo(d).eps)
                if not torch.equal(a.to(common), b.to(common)):
                    raise differs(f"first at row {i + int((a.to(common) != b.to(common)).any(-1).nonzero()[0])}")
        except CheckpointError:
            raise
        except Exception as ex:  # an I/O error or a header the data does not match
            raise CheckpointError(f"cannot compare the stored head {head} with the embedding {emb}: "
                                  f"{_one_line(ex)}") from None


def _read_tensor(f, fpath: Path, name: str, shape: tuple, dtype: torch.dtype, device, check_finite: bool,
                 index: tuple | None = None) -> torch.Tensor:
    """One tensor of an open shard, checked (shape, floating dtype, finite after conversion);
    with `index` (a slice per dimension) only that part of it is read."""
    where = f"weight {name} ({fpath.name})"
    try:
        part = f.get_slice(name)
        held = tuple(part.get_shape())
        if held != shape:
            raise CheckpointError(f"tensor {name} has shape {list(held)}, the config implies {list(shape)}")
        src = f.get_tensor(name) if index is None else part[index]
    except CheckpointError:
        raise
    except Exception as e:  # an I/O error or a header the data does not match
        raise CheckpointError(f"cannot read {where}: {_one_line(e)}") from None
    if src.dtype not in _FLOAT_DTYPES:
        raise CheckpointError(f"{where} has dtype {_dtype_name(src.dtype)}, expected a floating-point "
                              f"tensor ({', '.join(_dtype_name(d) for d in _FLOAT_DTYPES)})")
    t = src.to(device=device, dtype=dtype)
    if check_finite:
        bad = _nonfinite(t)
        if bad and t.dtype != src.dtype and not _nonfinite(src):
            big = src.abs().max().item()
            raise CheckpointError(f"{where} holds {bad} value(s) that overflow {_dtype_name(dtype)} "
                                  f"(largest magnitude {big:.3g}); load it as bfloat16 or float32")
        if bad:
            raise CheckpointError(f"{where} holds {bad} NaN/Inf value(s)")
    return t


def save_checkpoint(model: Transformer, path: str | os.PathLike, shard_bytes: int | None = None,
                    dtype: torch.dtype | None = None) -> Path:
    """Write `model` as a checkpoint directory in its family's real layout (config + safetensors).

    With `shard_bytes`, tensors are split over several files with a `model.safetensors.index.json`.
    """
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model.config
    names = checkpoint_names(config)
    sd = _pack(config, model.state_dict())
    tensors = {names[k]: (v.to(dtype) if dtype else v).detach().contiguous().cpu() for k, v in sd.items() if k in names}
    (path / "config.json").write_text(json.dumps(config.to_hf(), indent=2), encoding="utf-8")
    for stale in ("model.safetensors", "model.safetensors.index.json"):
        (path / stale).unlink(missing_ok=True)
    if shard_bytes is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += nbytes
    shards.append(cur)
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2), encoding="utf-8")
    return path


def init_random(config: ModelConfig, seed: int = 0, std: float = 0.02, dtype: torch.dtype = torch.float32) -> Transformer:
    """A model with seeded random weights (norm weights near 1, biases small), for tests."""
    g = torch.Generator().manual_seed(seed)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "scalar", "_scale")):      # scales near 1
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g) * (1.0 if p.dim() > 1 else 5.0))
    return model.to(dtype).eval().requires_grad_(False)
