"""engine/results.py: a sequence's result is built from the batch's per-token record (`engine.state.Commits`)
field by field without naming the fields, so a new per-token output reaches `SequenceResult`, its
`as_dict` and the CLI's JSON with no line in engine/results.py (docs/loop.md)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from engine import DecodeConfig, Decoder
from engine import results
from engine.state import Commits
from models import ModelConfig, init_random


@pytest.fixture(scope="module")
def decoded():
    """A decoded two-sequence batch (psd, --top-logprobs 2: every field of the record kept) and its decoder."""
    cfg = ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62)
    dec = Decoder(init_random(cfg, seed=1, std=0.5), DecodeConfig(method="psd", gen_length=16, block_length=8,
                                                                    top_logprobs=2))
    state = dec.start([[5, 6, 7], [9, 10, 11, 12, 13]])
    while dec.step(state).called or not state.done:
        pass
    return dec, state


def test_every_record_field_is_a_result_field():
    names = {f.name for f in dataclasses.fields(results.SequenceResult)}
    assert {f"commit_{f.name}" for f in dataclasses.fields(Commits)} <= names


def test_result_fields_are_the_records_columns(decoded):
    dec, state = decoded
    b = state.batch
    for row, res in enumerate(dec.results(state)):
        span = slice(int(b.gen_start[row]), int(b.gen_start[row]) + res.tokens)
        assert res.commit_call == b.commits.call[row, span].tolist() and min(res.commit_call) >= 1
        assert res.commit_prob == b.commits.prob[row, span].tolist()
        assert [[t for t, _ in alts] for alts in res.commit_top] == b.commits.top[row, span, :, 0].long().tolist()
        assert all(isinstance(t, int) for alts in res.commit_top for t, _ in alts)
        d = json.loads(json.dumps(res.as_dict()))
        assert d["commit_top"] == [[list(a) for a in alts] for alts in res.commit_top]
        assert d["commit_source"] == res.commit_source and d["token_ids"] == res.token_ids


def test_a_new_record_field_reaches_the_result_without_a_line_in_results(decoded, monkeypatch):
    """Stand in for a per-token output added to the record: `Commits` with one more field. Built
    from the record by `collect_results`, the result has it, and `as_dict` reports it."""
    dec, state = decoded
    extra = dataclasses.make_dataclass("WithRank", [("rank", torch.Tensor, None)], bases=(Commits,))
    rec = state.batch.commits
    rank = torch.arange(rec.call.numel()).view_as(rec.call)
    state.batch.commits = extra(**{f.name: getattr(rec, f.name) for f in dataclasses.fields(Commits)}, rank=rank)
    monkeypatch.setattr(results, "Commits", extra)
    namespace = {k: v for k, v in vars(results.SequenceResult).items()      # its methods, not the dataclass's
                 if not k.startswith("__") or k in ("__doc__", "__module__")}
    namespace["__annotations__"] = {f.name: f.type for f in dataclasses.fields(results.SequenceResult)}
    for f in dataclasses.fields(results.SequenceResult):      # (the dataclass's own defaults, as declared)
        namespace.pop(f.name, None)
        if f.default is not dataclasses.MISSING:
            namespace[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            namespace[f.name] = dataclasses.field(default_factory=f.default_factory)
    monkeypatch.setattr(results, "SequenceResult",
                        dataclasses.dataclass(results._commit_fields(type("SequenceResult", (), namespace))))
    try:
        for row, res in enumerate(dec.results(state)):
            start = int(state.batch.gen_start[row])
            assert res.commit_rank == rank[row, start:start + res.tokens].tolist()
            assert res.as_dict()["commit_rank"] == res.commit_rank
    finally:
        state.batch.commits = rec


@pytest.mark.parametrize("opts", [dict(method="psd", top_logprobs=2), dict(method="confidence", cache="dual"),
                                  dict(method="psd", cross_block=True)], ids=str)
def test_streamed_records_concatenate_to_the_results_record(opts):
    """Every field of the record streams (`commits`), in `Decoder.stream` and in a `LiveBatch` with a
    join: the pieces' records of a sequence concatenate to its result's `per_token()`."""
    from engine.live import LiveBatch
    cfg = ModelConfig.tiny("llada", vocab_size=64, mask_token_id=63, eos_token_id=62)
    dec = Decoder(init_random(cfg, seed=2, std=0.5), DecodeConfig(gen_length=16, block_length=8, **opts))
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    updates = list(dec.stream(prompts))
    for b, res in enumerate(updates[-1].results):
        want = res.per_token()
        assert set(want) >= {"call", "step", "source", "prob"} and ("top" in want) == ("top_logprobs" in opts)
        assert {k: [v for u in updates for v in u.commits[b][k]] for k in want} == want
        assert [p for u in updates for p in u.probs[b]] == res.commit_prob
    live = LiveBatch(dec)
    got, done, handles = {}, {}, [live.add(prompts[0])]
    while (u := live.step()) is not None:
        if len(handles) == 1:
            handles.append(live.add(prompts[1]))             # joins a running batch
        for h, rec in u.commits.items():
            for k, v in rec.items():
                got.setdefault(h, {}).setdefault(k, []).extend(v)
        done.update(u.done)
    assert sorted(done) == sorted(handles)
    for h in handles:
        assert got[h] == done[h].per_token()
