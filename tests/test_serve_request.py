"""engine/serve/request.py without a server: `parse_request(body, chat, limits)` turns a request's
JSON into one Spec per choice or one ApiError with a one-line message. The shipped checkpoint's
config and tokenizer only (no weights are loaded)."""
from __future__ import annotations

import pytest

from models import ModelConfig, Tokenizer

from engine.serve.protocol import ApiError
from engine.serve.request import MEASURE_CHARS, Limits, parse_request

MODEL = "models/default"
QA = ("{% for m in messages %}{% if m['role'] == 'user' %}Question: {{ m['content'] }}\n{% endif %}{% endfor %}"
      "{% if add_generation_prompt %}Answer: {% endif %}")


@pytest.fixture(scope="module")
def parts():
    return ModelConfig.from_dir(MODEL), Tokenizer(MODEL)


def limits(parts, **kw) -> Limits:
    mc, tok = parts
    given = {"defaults": {"method": "greedy", "gen_length": 64, "block_length": 32}, "max_choices": 8,
             "max_queue": 16, **kw}
    return Limits("default", mc, tok, **given)


def refused(body, lim, chat=False) -> ApiError:
    with pytest.raises(ApiError) as e:
        parse_request(body, chat, lim)
    assert "\n" not in e.value.message
    return e.value


def test_prompts_times_n_fan_out_in_openai_order(parts):
    lim = limits(parts, draw_seed=lambda: 41)
    specs = parse_request({"model": "default", "prompt": ["Question: 1 + 1 = ?\nAnswer: ", [5, 6, 7]], "n": 3,
                           "max_tokens": 5, "temperature": 0.5, "stream": True, "echo": True}, False, lim)
    assert [s.index for s in specs] == list(range(6))
    assert [s.sample for s in specs] == [0, 1, 2] * 2
    assert [s.config.seed for s in specs] == [41, 42, 43] * 2       # unseeded: one draw, then seed + j
    assert specs[3].prompt_ids == [5, 6, 7] and specs[0].prompt_ids == parts[1].encode("Question: 1 + 1 = ?\nAnswer: ")
    assert {s.max_tokens for s in specs} == {5} and {s.config.gen_length for s in specs} == {32}   # a whole block
    assert specs[0].echo == "Question: 1 + 1 = ?\nAnswer: " and specs[3].echo == parts[1].decode([5, 6, 7])
    assert all(s.stream and not s.include_usage and not s.chat for s in specs)


def test_temperature_zero_keeps_the_seed_and_defaults_fill_in(parts):
    lim = limits(parts, draw_seed=lambda: pytest.fail("nothing is drawn at temperature 0"))
    (spec,) = parse_request({"model": "default", "prompt": "Question: 2 + 2 = ?\nAnswer: "}, False, lim)
    assert spec.max_tokens == 64 and spec.config.gen_length == 64 and spec.config.method == "greedy"
    assert spec.stop == [] and spec.logprobs is False and spec.echo == ""


def test_the_model_is_checked_first(parts):
    lim = limits(parts)
    e = refused({"prompt": "x", "n": "many"}, lim)
    assert (e.status, e.param) == (400, "model")
    e = refused({"model": "other", "prompt": "x"}, lim)
    assert (e.status, e.code) == (404, "model_not_found") and "'other'" in e.message


def test_choices_are_bounded_naming_the_flag(parts):
    e = refused({"model": "default", "prompt": ["a", "b", "c"], "n": 3}, limits(parts))
    assert "3 prompts times n 3 is 9 choices" in e.message and "(8, --max-choices)" in e.message
    e = refused({"model": "default", "messages": [{"role": "user", "content": "x"}], "n": 9},
                limits(parts, max_choices=8, max_queue=8), chat=True)
    assert e.param == "n" and "--max-queue" in e.message


def test_unknown_fields_are_ignored_or_refused_when_strict(parts):
    body = {"model": "default", "prompt": "Question: 3?\nAnswer: ", "frobnicate": 1}
    (spec,) = parse_request(body, False, limits(parts))
    assert spec.ignored == ("frobnicate",)
    e = refused(body, limits(parts, strict=True))
    assert (e.code, e.param) == ("unknown_field", "frobnicate")


def test_a_prompt_that_cannot_fit_is_refused_before_it_is_encoded(parts):
    mc = parts[0]
    e = refused({"model": "default", "prompt": list(range(1, mc.max_length + 1))}, limits(parts))
    assert f"leaves no room for an answer within the model's maximum length {mc.max_length}" in e.message
    e = refused({"model": "default", "prompt": "ab " * (MEASURE_CHARS // 3 + 10)}, limits(parts))
    assert "characters is longer than the model's maximum length" in e.message
    e = refused({"model": "default", "prompt": ["ok", ""]}, limits(parts))
    assert e.message == "prompt 1: the prompt is empty"



class _Tokenless:
    """A tokenizer that makes no token of any text (no unknown token, none of its characters)."""

    def encode(self, text):
        return []


def test_a_text_the_tokenizer_makes_no_token_of_is_refused_as_such(parts):
    e = refused({"model": "default", "prompt": [[5, 6], "zzz"]}, limits((parts[0], _Tokenless())))
    assert e.message == "prompt 1: the prompt (3 characters) encodes to no token with this model's tokenizer"
    assert e.code == "invalid_value"


def test_max_tokens_and_block_rounding_against_the_model_length(parts):
    mc = parts[0]
    e = refused({"model": "default", "prompt": [1] * (mc.max_length - 40), "max_tokens": 33}, limits(parts))
    assert "decoded as 64 tokens, a multiple of the block length 32" in e.message
    e = refused({"model": "default", "prompt": "x y", "max_tokens": 0}, limits(parts))
    assert e.param == "max_tokens" and e.message == "max_tokens must be >= 1, got 0"
    # no whole block fits: the error names what set the length, never a max_tokens the client did not send
    e = refused({"model": "default", "prompt": [1] * (mc.max_length - 26)}, limits(parts))
    assert "with no max_tokens (the server's gen length" in e.message and "no whole block fits in 26" in e.message
    e = refused({"model": "default", "prompt": [1] * (mc.max_length - 26), "gen_length": 32}, limits(parts))
    assert "tokens with gen_length 32 (decoded as 32" in e.message


def test_chat_needs_a_template_and_renders_through_it(parts):
    mc, _ = parts
    tok = Tokenizer(MODEL)
    body = {"model": "default", "messages": [{"role": "user", "content": "2 + 3?"}], "logprobs": True,
            "top_logprobs": 2, "stream_options": {"include_usage": True}}
    e = refused(body, Limits("default", mc, tok, {"method": "greedy"}, 8, 16), chat=True)
    assert "no chat template" in e.message
    tok.set_chat_template(QA, "a test template")
    (spec,) = parse_request(body, True, Limits("default", mc, tok, {"method": "greedy"}, 8, 16))
    assert spec.prompt_ids == tok.encode("Question: 2 + 3?\nAnswer: ")
    assert spec.chat and spec.logprobs and spec.config.top_logprobs == 2 and spec.include_usage
    e = refused({**body, "logprobs": False}, Limits("default", mc, tok, {"method": "greedy"}, 8, 16), chat=True)
    assert (e.param, e.message) == ("top_logprobs", "top_logprobs needs logprobs: true")
    e = refused({**body, "messages": [{"role": "tool", "content": "x"}]},
                Limits("default", mc, tok, {"method": "greedy"}, 8, 16), chat=True)
    assert "message 0 has the role 'tool'" in e.message


def test_options_are_merged_over_the_defaults_and_checked(parts):
    lim = limits(parts, defaults={"method": "confidence", "threshold": 0.9, "gen_length": 64, "block_length": 32})
    (spec,) = parse_request({"model": "default", "prompt": "q", "method": "greedy"}, False, lim)
    assert spec.config.method == "greedy"                # the default's threshold is dropped, not refused
    e = refused({"model": "default", "prompt": "q", "decoding": {"threshold": 2}}, lim)
    assert e.param == "threshold"
    e = refused({"model": "default", "prompt": "q", "min_tokens": 40, "max_tokens": 8}, lim)
    assert e.message == "min_tokens 40 exceeds max_tokens 8"
