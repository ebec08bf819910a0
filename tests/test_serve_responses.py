"""engine/serve/responses.py and metrics.py without a server: SSE chunks, the completion object,
usage, the psd object, logprobs, and the /metrics text, from hand-made jobs and results."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest

from engine.config import DecodeConfig
from engine.serve.metrics import Metrics
from engine.serve.protocol import Spec
from engine.serve.responses import (chunk, completion, event, logprob_entries, psd, token_logprobs, usage,
                                    usage_chunk)

PIECES = {1: "a", 2: "bc", 3: "a", 4: "é"}


class Tok:
    def decode(self, ids):
        return "".join(PIECES[i] for i in ids)

    continuation = decode

    def token_bytes(self, i):
        return PIECES[i].encode()


def job(index=0, sample=0, prompt=(9, 9, 9), chat=False, echo="", logprobs=False, top=None, temperature=0.0,
        seed=0, ignored=(), batch_size=2, started=1.5):
    dc = DecodeConfig(gen_length=32, block_length=32, temperature=temperature, seed=seed, top_logprobs=top)
    spec = Spec(list(prompt), dc, 20, [], False, False, chat, index=index, sample=sample, echo=echo,
                logprobs=logprobs, ignored=ignored)
    return SimpleNamespace(spec=spec, batch_size=batch_size, submitted=1.0, started=started)


def result(calls=4, tokens=8, seconds=0.25, ids=(1, 2, 3), probs=(0.5, 1.0, 0.0), top=None):
    return SimpleNamespace(calls=calls, tokens=tokens, seconds=seconds, tpf=tokens / calls, token_ids=list(ids),
                           commit_prob=list(probs), commit_top=top)


def answer(shown="abc", finish="stop", completion_tokens=3):
    return SimpleNamespace(shown=shown, finish_reason=finish, completion_tokens=completion_tokens)


def data(sse: str) -> dict:
    assert sse.startswith("data: ") and sse.endswith("\n\n")
    return json.loads(sse[6:])


def test_chunks_in_openai_shape():
    assert event("[DONE]") == "data: [DONE]\n\n"
    c = data(chunk("m", "chatcmpl-1", True, role=True, index=2))
    assert (c["id"], c["object"], c["model"]) == ("chatcmpl-1", "chat.completion.chunk", "m")
    assert c["choices"] == [{"index": 2, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]
    assert data(chunk("m", "r", True, "hi"))["choices"][0]["delta"] == {"content": "hi"}
    assert data(chunk("m", "r", True, None, "stop"))["choices"][0]["delta"] == {}
    c = data(chunk("m", "cmpl-1", False, None, "length", index=1))
    assert c["object"] == "text_completion"
    assert c["choices"] == [{"index": 1, "text": "", "logprobs": None, "finish_reason": "length"}]
    assert "é" in chunk("m", "r", False, "é")            # UTF-8 as is, not \u escapes
    u = data(usage_chunk("m", "r", False, {"total_tokens": 3}, {"calls": 1}))
    assert u["choices"] == [] and u["usage"] == {"total_tokens": 3} and u["psd"] == {"calls": 1}


def test_usage_counts_each_prompt_once_and_sums_the_choices():
    jobs = [job(0, 0, prompt=(1, 2, 3), batch_size=2), job(1, 1, prompt=(1, 2, 3), batch_size=5, started=None),
            job(2, 0, prompt=(4,), batch_size=1, started=3.0)]
    answers = [answer(completion_tokens=3), answer(completion_tokens=1), answer(completion_tokens=2)]
    results = [result(calls=4, tokens=8), result(calls=2, tokens=3, seconds=0.5), result(calls=1, tokens=1)]
    u = usage(jobs, answers, results)
    assert u == {"prompt_tokens": 4, "completion_tokens": 6, "total_tokens": 10, "calls": 7,
                 "tpf": round(12 / 7, 4), "decoded_tokens": 12, "batch_size": 5, "queue_seconds": 2.0,
                 "decode_seconds": 0.5}


def test_psd_reports_seeds_only_when_sampling_and_the_ignored_fields_cut():
    p = psd([job(0)], [result()])
    assert p["seed"] is None and p["choices"][0]["seed"] is None and "ignored_fields" not in p
    names = tuple(f"f{i}" * 40 for i in range(20))
    jobs = [job(0, temperature=0.7, seed=11, ignored=names), job(1, 1, temperature=0.7, seed=12, ignored=names)]
    p = psd(jobs, [result(), result(calls=2, tokens=2)])
    assert p["seed"] == 11 and [c["seed"] for c in p["choices"]] == [11, 12]
    assert (p["calls"], p["tpf"], p["gen_length"], p["max_tokens"]) == (6, round(10 / 6, 4), 32, 20)
    assert len(p["ignored_fields"]) == 16 and p["ignored_count"] == 20
    assert all(len(n) <= 64 for n in p["ignored_fields"])


def test_completion_objects():
    jobs = [job(0, echo="Q: ", logprobs=True), job(1)]
    body = completion("m", "cmpl-9", Tok(), jobs, [answer("abc"), answer("x", "length", 1)], [result(), result()])
    assert (body["id"], body["object"], body["model"]) == ("cmpl-9", "text_completion", "m")
    first, second = body["choices"]
    assert first["text"] == "Q: abc" and first["finish_reason"] == "stop"
    assert first["logprobs"]["text_offset"] == [3, 4, 6]                 # after the echoed prompt
    assert second == {"index": 1, "text": "x", "logprobs": None, "finish_reason": "length"}
    assert body["usage"]["completion_tokens"] == 4 and body["psd"]["calls"] == 8
    chat = completion("m", "chatcmpl-9", Tok(), [job(0, chat=True)], [answer("hi")], [result()])
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"] == {"role": "assistant", "content": "hi"}


def test_completion_logprobs_offsets_and_alternatives_by_text():
    spec = job(top=2, logprobs=True).spec
    out, end = logprob_entries(Tok(), spec, [1, 2, 4], [0.5, 1.0, 0.0], [[(1, 0.5), (3, 0.25), (2, 0.2)], None,
                                                                          [(4, 0.0)]], 10)
    assert out["tokens"] == ["a", "bc", "é"] and out["text_offset"] == [10, 11, 13] and end == 14
    assert out["token_logprobs"] == [pytest.approx(math.log(0.5)), 0.0, -9999.0]
    # 1 and 3 decode alike: the likelier one's log-prob stays; the count is the request's (2)
    assert out["top_logprobs"] == [{"a": pytest.approx(math.log(0.5))}, {}, {"é": -9999.0}]
    plain, _ = logprob_entries(Tok(), job(top=None, logprobs=True).spec, [1], [0.5], [None], 0)
    assert plain["top_logprobs"] is None


def test_chat_logprobs_carry_bytes_and_the_answers_tokens_only():
    spec = job(chat=True, top=1, logprobs=True).spec
    out = token_logprobs(Tok(), spec, answer(completion_tokens=2), result(ids=(4, 2, 3), probs=(0.25, 0.5, 0.5),
                                                                          top=[[(4, 0.25), (1, 0.2)], [(2, 0.5)],
                                                                               [(3, 0.5)]]))
    assert [c["token"] for c in out["content"]] == ["é", "bc"]           # cut at completion_tokens
    assert out["content"][0]["bytes"] == [0xC3, 0xA9]
    assert out["content"][0]["top_logprobs"] == [{"token": "é", "logprob": pytest.approx(math.log(0.25)),
                                                  "bytes": [0xC3, 0xA9]}]


def test_metrics_text():
    m = Metrics()
    m.request("/v1/completions", 200, 0.03)
    m.request("/nope", 401)
    m.first_token(0.02)
    m.answered(5, [result(calls=4, tokens=8)], [answer(completion_tokens=3)], [job(batch_size=3)])
    sch = SimpleNamespace(stats={"calls": 17}, running=2, queued=lambda: 4)
    text = m.render(sch)
    lines = text.splitlines()
    assert text.endswith("\n") and "# TYPE psd_requests_total counter" in lines
    assert 'psd_requests_total{endpoint="/v1/completions",status="200"} 1' in lines
    assert 'psd_requests_total{endpoint="other",status="401"} 1' in lines
    for line in ("psd_model_calls_total 17", "psd_sequence_calls_total 4", "psd_tokens_per_forward 2.000000",
                 "psd_queue_length 4", "psd_running_batch_size 2", "psd_prompt_tokens_total 5",
                 "psd_completion_tokens_total 3", "psd_generated_tokens_total 8", "psd_choices_total 1",
                 'psd_batch_size_bucket{le="2"} 0', 'psd_batch_size_bucket{le="4"} 1',
                 'psd_request_latency_seconds_bucket{le="0.025"} 0', 'psd_request_latency_seconds_bucket{le="0.05"} 1',
                 "psd_request_latency_seconds_count 1", 'psd_time_to_first_token_seconds_bucket{le="+Inf"} 1'):
        assert line in lines, line


def _pieces(answer, ids, sizes) -> list[str]:
    out, i = [], 0
    for n in sizes:
        out.append(answer.add(ids[i:i + n]))
        i += n
    return out + [answer.finish()]


def test_overlapping_stops_cut_at_the_earliest_however_the_tokens_arrive():
    """Of overlapping stop sequences, the one that begins first cuts the answer, whether the decoder
    commits its tokens one per call or all at once (a later-beginning one may complete first)."""
    from engine.serve.answer import Answer
    from models import Tokenizer

    tok = Tokenizer("models/default")
    ids = tok.encode("Hello world")
    for sizes in ([1] * len(ids), [len(ids)]):
        answer = Answer(tok, 100, ["worl", "or"], [])
        pieces = _pieces(answer, ids, sizes)
        assert ("".join(pieces), answer.shown, answer.finish_reason) == ("Hello ", "Hello ", "stop"), sizes
        n = answer.completion_tokens                       # up to the token that completes "worl"
        assert "worl" in tok.decode(ids[:n]) and "worl" not in tok.decode(ids[:n - 1])


def test_streamed_text_is_never_undone_by_later_bytes(tmp_path):
    """A byte-fallback decoder shows a run of byte tokens as U+FFFDs wherever it is not valid UTF-8: "é"
    then a lone lead byte and "a" is "���a". What streams waits for the run to end, so the pieces
    concatenate to the tokenizer's text of the answer."""
    from engine.serve.answer import Answer
    from support import byte_fallback_tokenizer

    tok = byte_fallback_tokenizer(tmp_path)
    ids = [tok.token_id(t) for t in ("<0xC3>", "<0xA9>", "<0xE2>", "a")]
    answer = Answer(tok, 100, [], [])
    pieces = _pieces(answer, ids, [1] * len(ids))
    assert "".join(pieces) == answer.shown == tok.decode(ids) == "\ufffd" * 3 + "a"
    ids = tok.encode("é€ab", special=False)                # valid: each character as soon as its bytes are in
    answer = Answer(tok, 100, ["b"], [])
    assert _pieces(answer, ids, [1] * len(ids)) == ["", "", "", "", "", "", "é€a", "", ""]


@pytest.mark.parametrize("kind", ["byte-level", "byte-fallback"])
def test_chat_logprob_bytes_of_a_token_that_holds_part_of_a_character(kind, tmp_path):
    """A token's `bytes` are its own where its text alone is U+FFFD (a byte-level BPE piece or a <0xNN>
    token of a multi-byte character): they concatenate to the answer's UTF-8 (were EF BF BD each)."""
    from models import Tokenizer
    from support import byte_fallback_tokenizer

    tok = Tokenizer("models/default") if kind == "byte-level" else byte_fallback_tokenizer(tmp_path)
    ids = tok.encode("€é日", special=False)
    assert tok.decode(ids) == "€é日" and all(tok.decode([i]) in ("", "\ufffd") for i in ids)
    spec = job(chat=True, top=1, logprobs=True).spec
    out = token_logprobs(tok, spec, answer(completion_tokens=len(ids)),
                         result(ids=ids, probs=[0.5] * len(ids), top=[[(i, 0.5)] for i in ids]))
    content = out["content"]
    assert bytes(b for c in content for b in c["bytes"]).decode() == "€é日"
    assert [c["top_logprobs"][0]["bytes"] for c in content] == [c["bytes"] for c in content]


def test_a_completion_keeps_the_space_a_sentencepiece_decoder_drops(tmp_path):
    """A SentencePiece-style decoder (Llama's: Strip of a leading space) decodes "▁c" alone as "c", so a
    completion of "x" that answers " c a" read "xc a" when echoed or joined to its prompt, and its logprob
    tokens lacked their spaces. A completion's text and token texts keep the space (as OpenAI's and vLLM's
    do); a chat message stands alone and starts without it."""
    from engine.serve.answer import Answer
    from support import byte_fallback_tokenizer

    tok = byte_fallback_tokenizer(tmp_path)
    prompt, whole = tok.encode("x", special=False), tok.encode("x c a", special=False)
    ids = whole[len(prompt):]
    assert tok.decode(ids) == "c a" and tok.continuation(ids) == " c a"
    assert tok.decode(prompt) + tok.continuation(ids) == tok.decode(whole)
    for after_text, want in ((True, " c a"), (False, "c a")):
        for sizes in ([1] * len(ids), [len(ids)]):
            answer = Answer(tok, 100, [], [], after_text=after_text)
            assert "".join(_pieces(answer, ids, sizes)) == want == answer.shown, (after_text, sizes)
    out, end = logprob_entries(tok, job(logprobs=True).spec, ids, [0.5] * len(ids), [None] * len(ids), 1)
    assert "".join(out["tokens"]) == " c a" and end == 1 + len(" c a")
    assert [" c a"[o - 1:] for o in out["text_offset"]] == [" c a"[len("".join(out["tokens"][:k])):]
                                                              for k in range(len(ids))]
    from models import Tokenizer

    default = Tokenizer("models/default")               # byte-level BPE: keeps its spaces already
    some = default.encode("Hello world, again", special=False)
    assert default.continuation(some) == default.decode(some)
