"""Continuous batching in the server, through the real `openai` client: a short request sent after a
long one joins its running batch between two model calls (its first call made at once) and is answered first; with
`--batching static` the same short request waits for the long one's batch to end. (That answers
at temperature 0 equal each prompt decoded alone, under continuous batching, is
tests/test_serve.py::test_concurrent_load_is_batched_and_batch_invariant and tests/test_live.py.)"""
from __future__ import annotations

import threading

import pytest

from support import NAME, ServerProcess
from test_serve import PROMPTS

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

# greedy over heavy sampling noise, never stopping at EOS (ignore_eos): 128 calls, a long request
# (without ignore_eos its length is whatever the shared noise draws, which depends on when others join)
LONG = dict(model=NAME, prompt="Question: Hugo has 12 toys. He gives half of them to Dan.\nAnswer: ", max_tokens=128,
            temperature=50.0, seed=0, extra_body={"method": "greedy", "ignore_eos": True})
# the same options (a seeded generator serves a whole batch, so the seed is one of them): it may join LONG's batch
SHORT = dict(model=NAME, prompt=PROMPTS[3], max_tokens=8, temperature=50.0, seed=0,
             extra_body={"method": "greedy", "ignore_eos": True})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve_continuous")
    procs = {"continuous": ServerProcess(tmp, "--max-batch", "8"),
             "static": ServerProcess(tmp, "--max-batch", "8", "--batching", "static", "--batch-wait-ms", "0"),
             "by_length": ServerProcess(tmp, "--max-batch", "8", "--batch-by-length")}
    try:
        for p in procs.values():
            p.wait_ready()
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _race(server):
    """Send LONG, then SHORT once LONG is decoding; returns (finish order, responses)."""
    client = server.client()
    done, answers = [], {}

    def ask(name, body):
        answers[name] = client.completions.create(**body)
        done.append(name)

    t_long = threading.Thread(target=ask, args=("long", LONG))
    t_long.start()
    server.wait_running()                 # LONG is decoding
    t_short = threading.Thread(target=ask, args=("short", SHORT))
    t_short.start()
    t_long.join(300)
    t_short.join(300)
    return done, answers


def test_a_late_short_request_is_answered_before_an_earlier_long_one(servers):
    server = servers["continuous"]
    order, answers = _race(server)
    assert order == ["short", "long"]
    assert answers["short"].usage.batch_size == 2            # it decoded beside the long one
    assert answers["long"].usage.completion_tokens > 40      # long enough that the order means something
    assert answers["short"].usage.queue_seconds < answers["long"].usage.decode_seconds / 2


def test_batch_by_length_gives_each_length_its_own_running_batch(servers):
    """--batch-by-length: the short request (another length) does not join the long one's batch
    but gets its own, which takes turns with it, so it is still answered first, with the tokens it
    gets without the flag (each sequence decodes as it would alone)."""
    order, answers = _race(servers["by_length"])
    assert order == ["short", "long"]
    assert answers["short"].usage.batch_size == 1 and answers["long"].usage.batch_size == 1
    _, mixed = _race(servers["continuous"])
    assert [answers[k].choices[0].text for k in ("short", "long")] == [mixed[k].choices[0].text for k in ("short", "long")]


def test_an_answer_without_text_reports_its_batch(servers):
    """usage.batch_size counts the rows a request was decoded in, also when its answer is stop
    tokens only and no text piece was ever streamed (it read 0 there)."""
    r = servers["continuous"].client().completions.create(model=NAME, prompt="Hello", max_tokens=8,
                                                           extra_body={"method": "greedy"})
    assert r.choices[0].text == "" and r.usage.completion_tokens == 1       # the premise: one stop token
    assert r.usage.batch_size == 1


def test_static_batching_makes_the_short_request_wait(servers):
    order, answers = _race(servers["static"])
    assert order == ["long", "short"]
    assert answers["short"].usage.batch_size == 1
    assert answers["short"].usage.queue_seconds > answers["long"].usage.decode_seconds / 2     # it waited
