"""Tensor parallelism over torch.distributed (docs/distributed.md).

`init_tensor_parallel` joins the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK,
MASTER_ADDR/PORT): NCCL when the ranks run on CUDA (rank r on cuda:LOCAL_RANK), gloo on CPU.
A `TensorParallel` handed to `Transformer` / `load_model` splits every transformer block
Megatron-style across the ranks of the group:

    column-parallel  q/k/v projections (whole heads and kv-heads per rank, their biases too) and
                     the MLP's gate/up projections (a slice of the intermediate size)
    row-parallel     the attention output projection and the MLP's down projection: each rank
                     multiplies its slice, one all-reduce sums the partial outputs, then the bias
                     (o_bias) is added once
    replicated       embeddings, the LM head, every RMSNorm: every rank holds them whole, so after
                     the last all-reduce every rank computes the same full logits

Two all-reduces per block inside a model call. Under torchrun rank 0 alone runs the decoding loop
and broadcasts each model call's inputs; the other ranks run the same call on their shard
(engine/distributed.py). `shard_index` tells the loader which
slice of a checkpoint tensor a rank reads (safetensors `get_slice`), so a rank never reads the
other ranks' slices.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .errors import CheckpointError


class ParallelError(CheckpointError):
    """A model that cannot be split over the ranks, or a launch that cannot run tensor-parallel
    (one line, like every checkpoint error)."""


# internal parameter name (after "layers.{i}.") -> the dimension split across ranks:
# 0 = output features (column-parallel), 1 = input features (row-parallel); anything else is replicated
SPLIT_DIM = {
    "attn.wq.weight": 0, "attn.wq.bias": 0, "attn.wk.weight": 0, "attn.wk.bias": 0,
    "attn.wv.weight": 0, "attn.wv.bias": 0, "attn.wo.weight": 1,
    "mlp.w_gate.weight": 0, "mlp.w_up.weight": 0, "mlp.w_down.weight": 1,
}


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group: rank r of `world`, on `device`."""

    rank: int
    world: int
    device: str = "cpu"
    group: object = None             # the process group (None: the default group)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the ranks, in place (the row-parallel layers' partial outputs)."""
        import torch.distributed as dist

        dist.all_reduce(t, group=self.group)
        return t

    def broadcast(self, obj=None, src: int = 0):
        """Rank `src`'s `obj` on every rank (any picklable object)."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group, device=self._object_device())
        return box[0]

    def _object_device(self):
        # NCCL moves objects through a CUDA tensor; gloo through a CPU one
        return torch.device(self.device) if torch.device(self.device).type == "cuda" else None

    # ------------------------------------------------------------------ shapes
    def part(self, n: int) -> int:
        return n // self.world

    def shard_index(self, name: str, full_shape: tuple) -> tuple | None:
        """The slice (one `slice` per dimension) of the checkpoint tensor behind the internal
        parameter `name` that this rank holds; None for a replicated tensor."""
        dim = split_dim(name)
        if dim is None:
            return None
        n = full_shape[dim] // self.world
        index = [slice(None)] * len(full_shape)
        index[dim] = slice(self.rank * n, (self.rank + 1) * n)
        return tuple(index)


def split_dim(name: str) -> int | None:
    """The dimension of internal parameter `name` (e.g. "layers.3.attn.wq.weight") split across
    ranks, or None when every rank holds it whole."""
    if not name.startswith("layers."):
        return None
    return SPLIT_DIM.get(name.split(".", 2)[2])


def check_divisible(config, world: int) -> None:
    """A ParallelError of one line unless every split size of `config` divides by `world`."""
    if world <= 1:
        return
    if config.num_experts:
        raise ParallelError(f"tensor parallel is not implemented for mixture-of-experts models ({config.family}, "
                            f"{config.num_experts} experts): run it on one process")
    sizes = (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
             ("intermediate_size", config.intermediate_size))
    bad = [f"{name} {n}" for name, n in sizes if n % world]
    if bad:
        raise ParallelError(f"tensor parallel over {world} ranks needs num_heads, num_kv_heads and intermediate_size "
                            f"divisible by {world}; this model has {', '.join(bad)} (launch a number of ranks that "
                            f"divides them)")


def parameter_count_per_rank(config, world: int) -> int:
    """The parameters one rank of `world` holds (replicated tensors counted whole)."""
    if world <= 1:
        return config.parameter_count()
    d, q, kv, i = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    split = d * q + 2 * d * kv + q * d + (q + 2 * kv if config.qkv_bias else 0) + 3 * d * i
    whole = (d if config.o_bias else 0) + 2 * d
    block = split // world + whole
    return config.vocab_size * d * (1 if config.tie_embeddings else 2) + config.num_layers * block + d


def row_parallel(linear: torch.nn.Linear, x: torch.Tensor, tp: TensorParallel | None) -> torch.Tensor:
    """`linear(x)` for a row-parallel layer: this rank's partial product, summed over the ranks,
    then the (replicated) bias added once."""
    if tp is None:
        return linear(x)
    y = tp.all_reduce(torch.nn.functional.linear(x, linear.weight))
    return y if linear.bias is None else y + linear.bias


# ---------------------------------------------------------------------- the group torchrun describes
_CURRENT: TensorParallel | None = None


def launched() -> bool:
    """Whether this process is one of several ranks (torchrun sets WORLD_SIZE > 1)."""
    return _env_int("WORLD_SIZE", 1) > 1


def current() -> TensorParallel | None:
    """The group `init_tensor_parallel` set up in this process, or None (single process)."""
    return _CURRENT


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ParallelError(f"environment variable {name}={raw!r} is not an integer (launch with torchrun)") from None


def rank_device(device: str = "auto", local_rank: int = 0) -> str:
    """This rank's device from a --device value: auto/cuda mean cuda:LOCAL_RANK (CPU when CUDA
    is absent for auto); a fixed cuda:N would put every rank on one GPU and is refused."""
    if device == "cpu":
        return "cpu"
    if device not in ("auto", "cuda"):
        raise ParallelError(f"under torchrun every rank uses cuda:LOCAL_RANK; pass --device auto, cuda or cpu, "
                            f"not {device!r}")
    if not torch.cuda.is_available():
        if device == "cuda":
            raise ParallelError("device cuda requested but CUDA is not available")
        return "cpu"
    if local_rank >= torch.cuda.device_count():
        raise ParallelError(f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} CUDA device(s) on this "
                            f"machine: launch at most that many ranks per node")
    return f"cuda:{local_rank}"


def init_tensor_parallel(device: str = "auto") -> TensorParallel | None:
    """Join the process group torchrun describes and return this rank's `TensorParallel`; None
    when the process runs alone (WORLD_SIZE unset or 1). NCCL on CUDA, gloo on CPU; a group
    that is already initialised (bench.eval, a caller's own) is reused."""
    global _CURRENT
    world = _env_int("WORLD_SIZE", 1)
    if world <= 1:
        return None
    rank, local = _env_int("RANK", -1), _env_int("LOCAL_RANK", 0)
    if not 0 <= rank < world:
        raise ParallelError(f"WORLD_SIZE is {world} but RANK is {os.environ.get('RANK')!r}: launch with "
                            f"torchrun --nproc-per-node N")
    dev = rank_device(device, local)
    import torch.distributed as dist

    if not dist.is_available():
        raise ParallelError("this torch build has no torch.distributed")
    if not dist.is_initialized():
        if dev.startswith("cuda"):
            torch.cuda.set_device(torch.device(dev))
        dist.init_process_group("nccl" if dev.startswith("cuda") else "gloo")
    if dist.get_world_size() != world:
        raise ParallelError(f"the process group has {dist.get_world_size()} ranks but WORLD_SIZE is {world}")
    _CURRENT = TensorParallel(rank=dist.get_rank(), world=world, device=dev)
    return _CURRENT


def shutdown(wait: bool = True) -> None:
    """Wait for every rank (unless `wait` is False: after an error the others may never come),
    then leave the process group (a rank exiting with a live gloo group can abort the launch)."""
    global _CURRENT
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if wait:
            dist.barrier()
        dist.destroy_process_group()
    _CURRENT = None


def agree(value):
    """Rank 0's `value` on every rank of the current group (itself when there is none): for a
    decision made from something that differs between ranks, such as a measured time."""
    tp = _CURRENT
    if tp is None:
        return value
    return tp.broadcast(value)


__all__ = ["ParallelError", "TensorParallel", "agree", "check_divisible", "current", "init_tensor_parallel",
           "launched", "parameter_count_per_rank", "rank_device", "row_parallel", "shutdown", "split_dim"]
