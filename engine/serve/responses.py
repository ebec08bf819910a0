"""Answers in OpenAI's shapes, apart from HTTP: the completion object, server-sent event chunks,
`usage`, the engine's `psd` object, per-token logprobs, and the /health and /version bodies.
Plain functions of a request's jobs (their `Spec`s, batch sizes, times), its `Answer`s and
`SequenceResult`s and the tokenizer: tests/test_serve_responses.py checks them without a server."""
from __future__ import annotations

import json
import math
import sys
import time

from .answer import Answer
from .protocol import MAX_ECHOED, MAX_NAME


# ------------------------------------------------------------------------------------------ streaming
def head(model: str, rid: str, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()), "model": model}


def event(obj: dict | str) -> str:
    """One server-sent event: `data: JSON` (or `data: [DONE]`) and a blank line."""
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)) + "\n\n"


def chunk(model, rid, chat, text=None, finish=None, role=False, index=0, logprobs=None) -> str:
    """One streamed choice's piece: chat's `delta` (the first one the assistant role), or
    completions' `text`."""
    if chat:
        delta = ({"role": "assistant", "content": ""} if role else {} if text is None else {"content": text})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    return event({**head(model, rid, chat), "choices": [choice]})


def usage_chunk(model, rid, chat, usage_body: dict, psd_body: dict) -> str:
    """The chunk of `stream_options: {"include_usage": true}`: usage and psd, no choices."""
    return event({**head(model, rid, chat), "choices": [], "usage": usage_body, "psd": psd_body})


# ------------------------------------------------------------------------------------------ the answer
def prompt_tokens(jobs) -> int:
    """Each prompt once (its n samples share it), as OpenAI counts."""
    return sum(len(job.spec.prompt_ids) for job in jobs if job.spec.sample == 0)


def usage(jobs, answers: list[Answer], results) -> dict:
    p = prompt_tokens(jobs)
    c = sum(a.completion_tokens for a in answers)
    calls = sum(r.calls for r in results)
    decoded = sum(r.tokens for r in results)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            # the engine's own figures: the whole decoded answers (gen length, up to a stop token)
            "calls": calls, "tpf": round(decoded / max(calls, 1), 4), "decoded_tokens": decoded,
            "batch_size": max(j.batch_size for j in jobs),
            "queue_seconds": round(max((j.started or j.submitted) - j.submitted for j in jobs), 4),
            "decode_seconds": round(max(r.seconds for r in results), 4)}


def psd(jobs, results) -> dict:
    """The engine's side of the answer: what was decoded for max_tokens, with which seed."""
    first = jobs[0].spec
    dc = first.config
    out = {"method": dc.method, "max_tokens": first.max_tokens, "gen_length": dc.gen_length,
           "block_length": dc.block_length, "temperature": dc.temperature,
           "seed": dc.seed if dc.temperature > 0 else None, "calls": sum(r.calls for r in results),
           "tpf": round(sum(r.tokens for r in results) / max(sum(r.calls for r in results), 1), 4)}
    out["choices"] = [{"index": j.spec.index, "seed": j.spec.config.seed if dc.temperature > 0 else None,
                       "max_tokens": j.spec.max_tokens, "gen_length": j.spec.config.gen_length,
                       "calls": r.calls, "tpf": round(r.tpf, 4), "decoded_tokens": r.tokens}
                      for j, r in zip(jobs, results)]
    if first.ignored:          # JSON carries any name as data; the first MAX_ECHOED, each cut
        out["ignored_fields"] = [k[:MAX_NAME] for k in first.ignored[:MAX_ECHOED]]
        out["ignored_count"] = len(first.ignored)
    return out


def completion(model: str, rid: str, tok, jobs, answers: list[Answer], results) -> dict:
    """The whole (non-streamed) answer: `chat.completion` or `text_completion`."""
    chat = jobs[0].spec.chat
    choices = []
    for job, answer, res in zip(jobs, answers, results):
        spec = job.spec
        logprobs = token_logprobs(tok, spec, answer, res) if spec.logprobs else None
        if spec.chat:
            choices.append({"index": spec.index, "message": {"role": "assistant", "content": answer.shown},
                            "logprobs": logprobs, "finish_reason": answer.finish_reason})
        else:
            choices.append({"index": spec.index, "text": spec.echo + answer.shown, "logprobs": logprobs,
                            "finish_reason": answer.finish_reason})
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": choices,
            "usage": usage(jobs, answers, results), "psd": psd(jobs, results)}


# ------------------------------------------------------------------------------------------ logprobs
def token_logprobs(tok, spec, answer: Answer, res) -> dict:
    """OpenAI's logprobs of one choice from the engine's probability of each committed token (the
    probability under the model output that committed it) and its alternatives in that output."""
    n = answer.completion_tokens
    tops = res.commit_top[:n] if res.commit_top is not None else [None] * n
    return logprob_entries(tok, spec, res.token_ids[:n], res.commit_prob[:n], tops, len(spec.echo))[0]


def _by_text(alt: list[tuple[str, float]]) -> dict[str, float]:
    """Completions key alternatives by their text, most likely first; where two decode alike, the
    more likely one's log-prob stays."""
    out: dict[str, float] = {}
    for text, lp in alt:
        out.setdefault(text, lp)
    return out


def _logprob(p: float) -> float:
    return math.log(p) if p > 0 else -9999.0


def logprob_entries(tok, spec, ids: list[int], probs: list[float], tops: list, offset: int) -> tuple[dict, int]:
    """The logprobs object of these tokens (chat's `content` list, or completions' parallel lists
    with text offsets from `offset`) and the offset after them. `tops`: per token its (id, prob)
    alternatives, most likely first, or None; the request's count of them is reported."""
    k = spec.config.top_logprobs
    text = tok.decode if spec.chat else tok.continuation     # a completion's token texts join to its text
    tokens = [text([t]) for t in ids]
    lps = [_logprob(p) for p in probs]
    alts = [[(text([i]), _logprob(p)) for i, p in (top or [])[:k]] for top in tops]
    if spec.chat:       # bytes: a token's own, also where it holds part of a character (its text is U+FFFD)
        return {"content": [{"token": t, "logprob": lp, "bytes": list(tok.token_bytes(i)),
                             "top_logprobs": [{"token": a, "logprob": alp, "bytes": list(tok.token_bytes(j))}
                                              for (a, alp), (j, _) in zip(alt, top or [])]}
                            for t, i, lp, alt, top in zip(tokens, ids, lps, alts, tops)]}, offset
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    top_logprobs = [_by_text(alt) for alt in alts] if k else None
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_logprobs, "text_offset": offsets}, offset


# ------------------------------------------------------------------------------------------ the server
def health_body(server) -> dict:
    sch = server.scheduler
    body = {"status": server.status, "model": server.name, "queue": sch.queued(), "queued_choices": len(sch.waiting),
            "running": sch.running,
            "max_queue": sch.max_queue, "max_batch": sch.max_batch, "stats": dict(sch.stats)}
    if server.error:
        body["error"] = server.error
    return body


def version_body(server) -> dict:
    from importlib import metadata

    import torch

    try:
        version = metadata.version("psd-engine")
    except metadata.PackageNotFoundError:
        version = None
    try:
        import triton
        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"version": version, "torch": torch.__version__, "triton": triton_version, "python": sys.version.split()[0],
            "model": server.name, "model_dir": str(server.model_dir), "family": server.mc.family,
            "max_model_len": server.mc.max_length}
