"""The engine under torchrun: rank 0 decodes, the other ranks run its model calls (docs/distributed.md).

The model is split over the ranks (models/parallel.py); the decoding loop is not, it runs on rank 0
alone. Every model call of the loop goes through the decoder's cache mode (engine/cache.py: `start`,
a block's first call, which returns the block's cache, and `call`, a later call over it; the probe
calls of `--draft-budget auto` and the calls of `--cross-block` included), so rank 0's cache mode is
wrapped by `Announced`, which sends each call to the other ranks before running it, and they run the
same call on their shard (`follow`); that is all they do. Whatever loop rank 0 runs is therefore
tensor parallel as it is: `generate`, streams, continuous batching (engine.live), and decisions made
from what only rank 0 has (sampling noise, measured call times).

    rank 0 (its cache mode: `Announced`)            every other rank (`follow`)
    start(x, valid, pos, win)          header + one tensor -->  mode.start(...), keeps the cache by id
                                                                (inside `appending(cache)`: so is it)
    call(x, valid, pos, win, cache, rows)          -->          mode.call(..., the cache of that id, rows)
    widen(cache, win, n, left, rows)               -->          mode.widen(...): rows joining an open block
    joined(a, b)                                   -->          mode.joined(...): their cache after the others'
    a cache or a decoder rank 0 dropped   (its id rides on the next message)  -->  dropped
    `stop_followers` / `release`               "exit"  -->  `follow` returns

What else must come from one place comes from rank 0:

    `from_leader(fn)`   a value only rank 0 may produce (the prompt read from stdin or a file):
                        rank 0 computes it and broadcasts it, or broadcasts its error, which every
                        rank then raises
    `leader_prints`     a command line on every rank: only rank 0 prints (output and `error:`
    `run_ranks`         lines); the process group is left cleanly at the end
    `decoder`           engine.generate's decoder on every rank: rank 0's decodes and hands its
                        results (or its error) to the others, whose `generate`/`stream` follow
    `decoder_class`     engine.serve: rank 0 builds `Leader`s, the other ranks `serve_follower`
    `serve_follower`    until rank 0 `release`s them
"""
from __future__ import annotations

import collections
import contextlib
import io
import itertools
import math
import os
import sys
import time
import weakref

import torch

from models import CheckpointError
from models.parallel import TensorParallel, check_divisible, current, init_tensor_parallel, launched, shutdown

from .errors import DecodingError, InputError
from .graphs import GraphedCall
from .loop import Decoder
from .results import StreamUpdate

_ERRORS = (InputError, CheckpointError, DecodingError)

__all__ = ["Announced", "Follower", "Leader", "decoder", "decoder_class", "follow", "from_leader", "is_leader",
           "launched", "lead", "leader_prints", "release", "run_ranks", "serve_follower", "setup", "stop_followers"]


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


FOLLOWER_GRACE_S = 10.0     # how long a failed follower waits for rank 0 to print the same error


def leader_prints(command, *args, **kwargs) -> int:
    """Run a command line `command(*args, **kwargs)` on this rank: rank 0 prints, the other ranks'
    stdout is discarded and their stderr held (every rank sees the same arguments and files, and
    what only rank 0 reads comes through `from_leader`, so their output and `error:` lines are
    rank 0's). A follower that fails waits `FOLLOWER_GRACE_S` before it exits: torchrun stops the
    launch when the first rank exits, and a follower that fails first would stop rank 0 before its
    `error:` line is out. Still running after that, the failure is the follower's own, and its held
    lines are printed as `error: rank N: ...`. An exception leaving the command is printed by every
    rank (a crash is never hidden)."""
    rank = int(os.environ.get("RANK", "0") or 0)
    if rank == 0:
        return command(*args, **kwargs)
    held = io.StringIO()
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink), contextlib.redirect_stderr(held):
        try:
            code = command(*args, **kwargs)
        except SystemExit as e:                     # argparse's usage error
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    if code not in (0, 130):                        # (130: interrupted, as every rank is)
        time.sleep(FOLLOWER_GRACE_S)                # torchrun stops this rank here when rank 0 fails too
        for line in held.getvalue().splitlines():
            print(f"error: rank {rank}: {line[7:]}" if line.startswith("error: ") else line, file=sys.stderr)
    return code


def run_ranks(body, *args, guard) -> int:
    """Run a command's `body(*args)` under `guard` (engine.frontend.guarded) on this rank, then
    leave the process group: after success every rank together, after an error without
    waiting for the others (torchrun stops the launch when one rank fails)."""
    code = guard(body, *args)
    shutdown(wait=code == 0)
    return code


# ---------------------------------------------------------------------- rank 0's side of the calls
class _Channel:
    """Rank 0's end of the messages to the other ranks (one per process group): the ids under
    which the followers keep their twins of rank 0's cache modes and caches, and the ids of
    those rank 0 has dropped since the last message (a `weakref.finalize` queues them; any
    thread may run it, so a deque)."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp
        self.ids = itertools.count()
        self.keys: dict[int, int] = {}             # id(object) -> its id on the followers
        self.gone: collections.deque = collections.deque()
        self.sent: collections.Counter = collections.Counter()     # calls sent, by kind

    def register(self, obj, i: int | None = None) -> int:
        i = next(self.ids) if i is None else i
        self.keys[id(obj)] = i
        weakref.finalize(obj, self._drop, id(obj), i).atexit = False
        return i

    def _drop(self, key: int, i: int) -> None:
        if self.keys.get(key) == i:
            self.keys.pop(key, None)
        self.gone.append(i)

    def key(self, obj) -> int:
        return -1 if obj is None else self.keys[id(obj)]

    def say(self, kind: str, *payload, tensors=()) -> None:
        """One message: (kind, the ids dropped, *payload) as a pickled object, then `tensors`
        (integer tensors of any shape, or None) packed into one int64 tensor broadcast on the
        device, so rank 0 never waits for the device here."""
        if any(t.is_floating_point() or t.is_complex() for t in tensors if t is not None):
            raise TypeError("only integer tensors are sent to the followers (int64 packing)")
        frees = []
        while self.gone:                           # one consumer (this thread), so no race
            frees.append(self.gone.popleft())
        metas = [None if t is None else (tuple(t.shape), t.dtype) for t in tensors]
        self.tp.broadcast((kind, frees, *payload, metas) if tensors else (kind, frees, *payload))
        parts = [t.reshape(-1).long() for t in tensors if t is not None]
        if parts:
            import torch.distributed as dist

            dist.broadcast(torch.cat(parts), src=0, group=self.tp.group)
        self.sent[kind] += 1


_CHANNEL: _Channel | None = None


def _channel(tp: TensorParallel) -> _Channel:
    global _CHANNEL
    if _CHANNEL is None or _CHANNEL.tp is not tp:
        _CHANNEL = _Channel(tp)
    return _CHANNEL


def mode_spec(mode, model) -> tuple:
    """What another rank needs to build the twin of rank 0's cache mode `mode` on its shard: the
    mode's class, whether it runs the compiled model, and the CUDA-graph wrapper's settings (or
    None). The wrapper is inside `Announced`: each rank captures and replays its own graphs, in
    step, because every rank runs the same calls through a wrapper of the same settings."""
    graphs = None
    if isinstance(mode, GraphedCall):
        graphs = (type(mode.backend), mode.max_graphs, mode.sizes[-1])
        mode = mode.mode
    return type(mode), mode.model is not model, graphs


def build_mode(spec: tuple, model):
    cls, compiled, graphs = spec
    mode = cls(model.compiled() if compiled else model)
    if graphs is not None:
        backend, max_graphs, max_rows = graphs
        mode = GraphedCall(mode, backend(model.device), max_graphs, max_rows)
    return mode


class Announced:
    """Rank 0's cache mode under tensor parallelism: `start` and `call` send the call (its
    tensors, the Window, the id of the cache it reads, the rows) to the other ranks, then run
    it; everything else is the wrapped mode's. The followers build their twin of the mode at
    its first call and drop it when this object goes."""

    def __init__(self, mode, model, channel: _Channel):
        self.mode, self.channel = mode, channel
        self.name = mode.name
        self.spec = mode_spec(mode, model)
        self.told = False
        self.into = -1                         # inside `appending`: the cache a `start` writes after
        self.id = channel.register(self)

    def __getattr__(self, name):           # query_span, stats, ... of the wrapped mode
        mode = self.__dict__.get("mode")
        if mode is None:
            raise AttributeError(name)
        return getattr(mode, name)

    def _say(self, kind: str, cache_id: int, win, tensors=(), *args) -> None:
        self.channel.say(kind, self.id, None if self.told else self.spec, cache_id, win, *args, tensors=tensors)
        self.told = True

    def start(self, x, valid, pos, win):
        cache_id = next(self.channel.ids)
        self._say("start", cache_id, win, (x, valid, pos), self.into)
        try:
            logits, cache = self.mode.start(x, valid, pos, win)
        except BaseException:
            self.channel.gone.append(cache_id)    # the followers may hold a cache rank 0 never got
            raise
        if cache is not None:
            self.channel.register(cache, cache_id)
        return logits, cache

    def call(self, x, valid, pos, win, cache, rows):
        self._say("call", self.channel.key(cache), win, (x, valid, pos, rows), -1)
        return self.mode.call(x, valid, pos, win, cache, rows)

    # rows joining an open block (Decoder.join): its cache widened, theirs written after it, then one
    def widen(self, cache, win, n: int, left: int, rows: int = 0):
        return self._made("widen", cache, win, (n, left, rows), lambda: self.mode.widen(cache, win, n, left, rows))

    @contextlib.contextmanager
    def appending(self, cache):
        self.into = self.channel.key(cache)      # the next `start`s write after it, here and there
        try:
            with self.mode.appending(cache):
                yield
        finally:
            self.into = -1

    def joined(self, a, b):
        return self._made("joined", a, None, (self.channel.key(b),), lambda: self.mode.joined(a, b))

    def _made(self, kind: str, cache, win, args: tuple, here):
        """`here()`, a cache made from `cache` (widen, joined), and the same on the followers (`kind`
        with `args`), where it is kept by a new id; without a cache (`none`) nothing to tell."""
        if cache is None:
            return here()
        new_id = next(self.channel.ids)
        self._say(kind, self.channel.key(cache), win, (), new_id, *args)
        made = here()
        if made is not None:
            self.channel.register(made, new_id)
        return made


def lead(decoder: Decoder) -> Decoder:
    """Make a built `decoder` rank 0's under tensor parallelism (its cache mode `Announced`,
    outside a --cuda-graphs wrapper); alone, or on another rank, it is left as it is."""
    tp = current()
    if tp is not None and tp.rank == 0 and not isinstance(decoder.cache_mode, Announced):
        decoder.cache_mode = Announced(decoder.cache_mode, decoder.model, _channel(tp))
    return decoder


class Leader(Decoder):
    """Rank 0's `Decoder` under tensor parallelism (engine.serve): a `Decoder` made rank 0's by `lead`."""

    def __init__(self, model, config=None, **kw):
        super().__init__(model, config, **kw)
        lead(self)


def decoder_class() -> type[Decoder]:
    """The decoder rank 0 builds (engine.serve): `Leader` under tensor parallelism, else `Decoder`."""
    return Leader if current() is not None else Decoder


def stop_followers() -> None:
    """Rank 0 ends the other ranks' `follow` (they return None)."""
    tp = current()
    if tp is not None and tp.rank == 0:
        _channel(tp).say("exit")


def release() -> None:
    """Rank 0 ends the followers' loop (engine.serve's shutdown), then leaves the process group."""
    stop_followers()
    shutdown()


# ---------------------------------------------------------------------- the other ranks
def _receive(tp: TensorParallel, metas) -> list:
    sizes = [math.prod(m[0]) for m in metas if m is not None]
    flat = torch.empty(sum(sizes), dtype=torch.long, device=tp.device)
    import torch.distributed as dist

    dist.broadcast(flat, src=0, group=tp.group)
    parts = iter(flat.split(sizes))
    return [None if m is None else next(parts).view(m[0]).to(m[1]) for m in metas]


def follow(model, stats: collections.Counter | None = None):
    """The loop of every rank but 0: run the calls rank 0's `Announced` cache modes send, on this
    rank's shard, keeping their twins and caches by rank 0's ids, until rank 0 ends it. Returns
    None at "exit" (`stop_followers`) and rank 0's results at "done" (`decoder`); raises the error
    rank 0 reports ("failed"). An error here is not caught: the rank exits and torchrun stops the
    launch (continuing would leave rank 0 waiting in a collective this rank skipped). `stats`
    (tests): the calls run by kind, the cache modes built by class, and `held`, the objects
    still kept when it returns."""
    tp = current()
    held: dict[int, object] = {}
    with torch.no_grad():
        while True:
            msg = tp.broadcast()
            if not isinstance(msg, tuple) or not msg or msg[0] not in _KINDS:
                continue            # a value rank 0 `agree`d (engine/budget.py): only rank 0 reads it now
            kind, frees, *rest = msg
            for i in frees:
                held.pop(i, None)
            if kind in ("start", "call", "widen", "joined"):
                _run(tp, model, held, stats, kind, *rest)
                if stats is not None:
                    stats[kind] += 1
                continue
            if stats is not None:
                stats["held"] = len(held)
            if kind == "exit":
                return None
            if kind == "done":
                return rest[0]
            cls, text = rest
            raise (cls if isinstance(cls, type) and issubclass(cls, _ERRORS) else RuntimeError)(text)


_KINDS = ("start", "call", "widen", "joined", "exit", "done", "failed")


def _run(tp, model, held: dict, stats, kind: str, mode_id: int, spec, cache_id: int, win, *more) -> None:
    if spec is not None:
        held[mode_id] = build_mode(spec, model)
        if stats is not None:
            stats[f"built {type(held[mode_id]).__name__}"] += 1
    mode = held[mode_id]
    if kind in ("widen", "joined"):                    # rows joined an open block (no tensors sent)
        new_id, *args = more
        made = mode.widen(held[cache_id], win, *args) if kind == "widen" else \
            mode.joined(held[cache_id], held[args[0]])
        if made is not None:
            held[new_id] = made
        return
    into, metas = more
    tensors = _receive(tp, metas)
    if kind == "start":
        with mode.appending(held[into]) if into >= 0 else contextlib.nullcontext():
            _, cache = mode.start(*tensors, win)
        if cache is not None:
            held[cache_id] = cache
    else:
        x, valid, pos, rows = tensors
        mode.call(x, valid, pos, win, None if cache_id < 0 else held[cache_id], rows)


def serve_follower(model_dir, dtype: str = "float32", device: str = "auto") -> int:
    """What an engine.serve rank other than 0 runs: join the group, load its shard of the
    checkpoint, run rank 0's model calls until rank 0 `release`s it; returns the exit status."""
    from models import load_model

    tp = setup(device)
    model = load_model(model_dir, dtype=dtype, device=tp.device, tp=tp)
    follow(model)
    shutdown()
    return 0


# ---------------------------------------------------------------------- engine.generate: every rank runs the command
def _report(error: BaseException | None = None, results=None) -> None:
    """Rank 0 ends the other ranks' `Follower` decode: its results, or its error (raised there)."""
    channel = _channel(current())
    if error is None:
        channel.say("done", results)
    elif isinstance(error, _ERRORS):
        channel.say("failed", type(error), str(error))
    else:
        channel.say("failed", RuntimeError, f"rank 0 stopped decoding: {type(error).__name__}: {error}")


class _Reporting(Leader):
    """Rank 0's decoder of a command every rank runs: each decode ends with `_report`."""

    def generate(self, prompts):
        try:
            results = super().generate(prompts)
        except BaseException as e:
            _report(e)
            raise
        _report(results=results)
        return results

    def stream(self, prompts):
        update = None
        try:
            for update in super().stream(prompts):
                yield update
        except BaseException as e:          # GeneratorExit too: the caller closed the stream
            _report(e)
            raise
        _report(results=update.results)


class Follower:
    """`decoder` on every rank but 0: `generate` and `stream` run rank 0's calls (`follow`) and
    return its results (a stream: one update holding everything)."""

    def __init__(self, model):
        self.model = model

    def generate(self, prompts):
        return follow(self.model)

    def stream(self, prompts):
        results = follow(self.model)
        yield StreamUpdate([r.token_ids for r in results], results, [r.per_token() for r in results])


def decoder(model, config=None):
    """The decoder of a command every rank runs (engine.generate): a `Decoder` alone; under tensor
    parallelism rank 0's decodes and reports to the others' `Follower`. A config rank 0's decoder
    refuses is refused on every rank."""
    tp = current()
    if tp is None:
        return Decoder(model, config)
    if tp.rank != 0:
        return Follower(model)
    try:
        return _Reporting(model, config)
    except BaseException as e:
        _report(e)
        raise
