"""The engine under torchrun: tensor-parallel ranks that decode in lockstep (docs/distributed.md).

The model is split over the ranks (models/parallel.py); the decoding loop is not: every rank runs
the same `Decoder` on the same prompts and, since every rank computes the same full logits,
takes the same decisions and makes the same model calls. What must come from one place comes
from rank 0:

    `from_leader(fn)`   a value only rank 0 may produce (the prompt read from stdin or a file):
                        rank 0 computes it and broadcasts it, or broadcasts its error, which every
                        rank then raises
    `leader_prints`     a command line on every rank: only rank 0 prints (output and `error:`
    `run_ranks`         lines); the process group is left cleanly at the end
    `LeaderDecoder`     rank 0's decoder when rank 0 alone receives the work (engine.serve): each
    `follow`            decode, and each step of a stream, is announced to the other ranks,
                        which `follow` with the same calls, so a stream rank 0 closes early
                        (a client went away) is closed on every rank at the same call

`--draft-budget auto` measures call times, which differ between ranks; the nodes it verifies are
rank 0's choice on every rank (engine/budget.py calls `models.parallel.agree`).
"""
from __future__ import annotations

import contextlib
import os

from models import CheckpointError
from models.parallel import TensorParallel, check_divisible, current, init_tensor_parallel, launched, shutdown

from .errors import DecodingError, InputError
from .loop import Decoder

_ERRORS = (InputError, CheckpointError, DecodingError)

__all__ = ["LeaderDecoder", "decoder_class", "follow", "from_leader", "is_leader", "launched", "leader_prints",
           "release", "run_ranks", "serve_follower", "setup"]


def setup(device: str = "auto", config=None) -> TensorParallel | None:
    """This rank's `TensorParallel` under torchrun (the process group joined), None when alone.
    A model `config` whose sizes do not divide by the number of ranks is refused first, before
    any rank joins the group."""
    if config is not None and launched():
        check_divisible(config, int(os.environ["WORLD_SIZE"]))
    return current() or init_tensor_parallel(device)


def is_leader() -> bool:
    tp = current()
    return tp is None or tp.rank == 0


def from_leader(fn):
    """`fn()` computed on rank 0 only and handed to every rank; an error `fn` raises on rank 0
    (bad input) is raised on every rank, so no rank waits for a value that never comes."""
    tp = current()
    if tp is None:
        return fn()
    if tp.rank == 0:
        try:
            value = fn()
        except _ERRORS as e:
            tp.broadcast(("error", type(e), str(e)))
            raise
        tp.broadcast(("ok", value))
        return value
    kind, *payload = tp.broadcast()
    if kind == "error":
        raise payload[0](payload[1])
    return payload[0]


@contextlib.contextmanager
def leader_prints():
    """Inside: rank 0 prints, the other ranks' stdout and stderr are discarded (every rank sees
    the same arguments and files, and what only rank 0 reads comes through `from_leader`, so
    their output and `error:` lines are rank 0's). An exception leaving the block is printed
    by every rank (a crash is never hidden)."""
    if int(os.environ.get("RANK", "0") or 0) == 0:
        yield
        return
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        yield


def run_ranks(body, *args, guard) -> int:
    """Run a command's `body(*args)` under `guard` (engine.frontend.guarded) on this rank, then
    leave the process group: after success every rank together, after an error without
    waiting for the others (torchrun stops the launch when one rank fails)."""
    code = guard(body, *args)
    shutdown(wait=code == 0)
    return code


# ---------------------------------------------------------------------- rank 0 leads, the others follow
class LeaderDecoder(Decoder):
    """Rank 0's `Decoder` when only rank 0 receives requests (engine.serve): it announces its
    config, each `generate`, each `stream` and every step of a stream to the ranks in `follow`."""

    def __init__(self, model, config=None):
        self.tp = current()
        self._say("decoder", config)
        super().__init__(model, config)

    def _say(self, *command) -> None:
        if self.tp is not None:
            self.tp.broadcast(command)

    def generate(self, prompts):
        self._say("generate", prompts)
        return super().generate(prompts)

    def stream(self, prompts):
        self._say("stream", prompts)
        steps = super().stream(prompts)
        try:
            while True:
                self._say("next")
                try:
                    update = next(steps)
                except StopIteration:
                    return
                yield update
        finally:
            steps.close()
            self._say("close")


def decoder_class() -> type[Decoder]:
    """The decoder rank 0 builds for work only it receives: `LeaderDecoder` under tensor
    parallelism, else the plain `Decoder`."""
    return LeaderDecoder if current() is not None else Decoder


def follow(model) -> int:
    """The loop of every rank but 0: build, generate and step exactly what rank 0's
    `LeaderDecoder` announces, until `release`; returns the number of decodes followed. An error
    (bad request) is rank 0's too; it is dropped here and the next command awaited."""
    tp = current()
    decoder, steps, done = None, None, 0
    while True:
        kind, *payload = tp.broadcast()
        try:
            if kind == "exit":
                return done
            if kind == "decoder":
                decoder = None
                decoder = Decoder(model, payload[0])
            elif kind == "generate":
                done += 1
                decoder.generate(payload[0])
            elif kind == "stream":
                done += 1
                steps = decoder.stream(payload[0])
            elif kind == "next" and steps is not None:
                next(steps, None)
            elif kind == "close":
                if steps is not None:
                    steps.close()
                steps = None
        except _ERRORS:
            steps = None


def serve_follower(model_dir, dtype: str = "float32", device: str = "auto") -> int:
    """What an engine.serve rank other than 0 runs: join the group, load its shard of the
    checkpoint, follow rank 0's decodes until rank 0 `release`s; returns the exit status."""
    from models import load_model

    tp = setup(device)
    model = load_model(model_dir, dtype=dtype, device=tp.device, tp=tp)
    follow(model)
    shutdown()
    return 0


def release() -> None:
    """Rank 0 ends the followers' loop (engine.serve's shutdown), then leaves the process group."""
    tp = current()
    if tp is not None and tp.rank == 0:
        tp.broadcast(("exit",))
    shutdown()
