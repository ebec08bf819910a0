"""`engine.serve --cache prefix` under continuous batching, through the real `openai` client: a
short request that joins a longer one's running batch (so its row is shorter than the canvas and
has padding on its right) answers exactly what it answers alone (issue #31 item 1: the padding was
visible to the prefix-cache call's own keys on bidirectional models, and the joined answer changed)."""
from __future__ import annotations

import threading

import pytest

from support import NAME, ServerProcess

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

OPTIONS = {"method": "greedy", "ignore_eos": True}          # greedy: one token per call, every call counts
LONG = dict(model=NAME, prompt="Question: Hugo has 12 toys. He gives half of them to Dan.\nAnswer: ", max_tokens=96,
            temperature=0, extra_body=OPTIONS)
SHORT = dict(model=NAME, prompt="Question: A box holds 6 pens. How many pens do 5 boxes hold?\nAnswer: ",
             max_tokens=24, temperature=0, extra_body=OPTIONS)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = ServerProcess(tmp_path_factory.mktemp("serve_prefix"), "--cache", "prefix", "--max-batch", "4")
    try:
        s.wait_ready()
        yield s
    finally:
        s.stop()


def test_a_short_request_joining_a_long_one_answers_as_alone(server):
    client = server.client()
    alone = {name: client.completions.create(**body) for name, body in (("short", SHORT), ("long", LONG))}
    answers = {}

    def ask(name, body):
        answers[name] = client.completions.create(**body)

    t_long = threading.Thread(target=ask, args=("long", LONG))
    t_long.start()
    server.wait_running()                 # LONG is decoding
    ask("short", SHORT)
    t_long.join(300)
    assert answers["short"].usage.batch_size == 2            # the premise: it decoded beside the long one
    for name in ("short", "long"):
        assert answers[name].choices[0].text == alone[name].choices[0].text, name
        assert answers[name].usage.completion_tokens == alone[name].usage.completion_tokens
