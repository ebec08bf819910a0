"""engine/serve/protocol.py without a server: which request fields are read, refused or ignored
(issue 33 item 3), and how a field's name is echoed (item 2). The end-to-end checks are in
tests/test_serve_api.py (the header, the log line, the openai client) and
tests/test_hostile_server.py (names that would split a header or forge a log line)."""
from __future__ import annotations

import pytest

from engine.serve.protocol import (CHAT_FIELDS, COMPLETION_FIELDS, MAX_NAME, MAX_UNKNOWN, NEUTRAL, ApiError,
                                   request_options, shown)

COMPLETIONS, CHAT = COMPLETION_FIELDS, CHAT_FIELDS


def options(body: dict, fields=COMPLETIONS, strict=False) -> tuple[dict, list]:
    """(the decoding options, the ignored field names) of a request body, or the ApiError raised."""
    ignored = None if strict else []
    return request_options(body, fields, 256, ignored), ignored


def refusal(body: dict, fields=COMPLETIONS, strict=False) -> ApiError:
    with pytest.raises(ApiError) as e:
        options(body, fields, strict)
    assert e.value.status == 400 and "\n" not in e.value.message
    return e.value


# field -> (a value that changes the answer, the neutral one or None when only null/absent is)
CHANGING = {
    # OpenAI
    "presence_penalty": (0.5, 0), "frequency_penalty": (-1, 0.0), "logit_bias": ({"5": 100}, {}),
    "best_of": (2, 1), "suffix": ("end", ""), "tools": ([{"type": "function"}], []), "functions": ([{}], []),
    "tool_choice": ("auto", "none"), "function_call": ("auto", "none"),
    "response_format": ({"type": "json_object"}, {"type": "text"}), "modalities": (["text", "audio"], ["text"]),
    "audio": ({"voice": "alloy"}, None), "reasoning_effort": ("high", None), "verbosity": ("low", "medium"),
    "web_search_options": ({}, None),
    # vLLM
    "use_beam_search": (True, False), "length_penalty": (0.5, 1), "repetition_penalty": (1.2, 1.0),
    "min_p": (0.1, 0), "stop_token_ids": ([2], []), "include_stop_str_in_output": (True, False),
    "bad_words": (["x"], []), "allowed_token_ids": ([1, 2], None), "logits_processors": (["p"], []),
    "prompt_logprobs": (0, None), "truncate_prompt_tokens": (8, None), "skip_special_tokens": (False, True),
    "add_special_tokens": (False, True), "add_generation_prompt": (False, True),
    "continue_final_message": (True, False), "chat_template": ("{{ x }}", None),
    "chat_template_kwargs": ({"enable_thinking": True}, {}), "documents": ([{"text": "d"}], []),
    "structured_outputs": ({"json": {}}, None), "structural_tag": ("{}", None),
    "guided_json": ({"type": "object"}, None), "guided_regex": ("a+", None), "guided_choice": (["a", "b"], None),
    "guided_grammar": ("root ::= 'a'", None), "guided_decoding_backend": ("xgrammar", None),
    # SGLang, TGI, Hugging Face
    "regex": ("a+", None), "ebnf": ("root ::= 'a'", None), "json_schema": ("{}", None), "grammar": ({}, None),
    "typical_p": (0.9, 1), "num_beams": (4, 1), "no_repeat_ngram_size": (3, 0),
}


def test_the_table_is_tested_field_by_field():
    assert set(NEUTRAL) <= set(CHANGING)


@pytest.mark.parametrize("fields", [COMPLETIONS, CHAT], ids=["completions", "chat"])
@pytest.mark.parametrize("field", sorted(CHANGING))
def test_a_field_that_changes_decoding_elsewhere_is_a_400_naming_it(field, fields):
    """Ignored, it would answer a different question silently: refused on both endpoints (a
    penalty, a grammar, beam search, a schema); at its neutral value it asks for nothing and is
    accepted with no header."""
    changing, neutral = CHANGING[field]
    err = refusal({field: changing}, fields)
    assert err.param == field and err.code == "unsupported" and err.message.startswith(f"{field} is not supported")
    assert options({field: None}, fields) == ({}, [])            # null: absent
    if neutral is not None:
        assert options({field: neutral}, fields) == ({}, [])
        assert "(no effect) is accepted" in err.message           # the message says which value is


def test_a_boolean_is_not_a_number():
    assert refusal({"presence_penalty": False}).param == "presence_penalty"
    assert refusal({"best_of": True}).param == "best_of"
    assert refusal({"use_beam_search": 0}).param == "use_beam_search"


@pytest.mark.parametrize("key, known", [("treshold", "threshold"), ("Threshold", "threshold"),
                                        ("block-length", "block_length"), ("temprature", "temperature"),
                                        ("max_token", "max_tokens"), ("max_new_tokens", "max_tokens"),
                                        ("top-k", "top_k"), ("repetition_penality", "repetition_penalty"),
                                        ("stop_token_id", "stop_token_ids"), ("gen_len", "gen_length")])
def test_a_misspelt_known_name_is_a_400_naming_the_known_one(key, known):
    for strict in (False, True):
        err = refusal({key: 0.5}, strict=strict)
        assert err.param == key and err.code == "unknown_field"
        assert f"unknown field {key!r}: did you mean {known!r}?" in err.message
    nested = refusal({"decoding": {key: 0.5}})
    if known in ("threshold", "block_length", "temperature", "top_k", "gen_length"):    # decoding options
        assert f"did you mean {known!r}?" in nested.message


@pytest.mark.parametrize("key, value, fields, hint", [
    ("messages", [{"role": "user", "content": "hi"}], COMPLETIONS, "completions take a prompt"),
    ("prompt", "hi", CHAT, "chat takes messages"),
    ("max_completion_tokens", 8, COMPLETIONS, "completions take max_tokens"),
    ("top_logprobs", 2, COMPLETIONS, "completions ask for K alternatives with logprobs: K"),
    ("echo", True, CHAT, "echo is a field of /v1/completions, not of /v1/chat/completions"),
])
def test_the_other_endpoints_field_is_a_400(key, value, fields, hint):
    err = refusal({key: value}, fields)
    assert err.param == key and hint in err.message
    if value is True:
        assert options({key: False}, fields) == ({}, [])          # a switch turned off asks for nothing


def test_top_logprobs_is_never_a_request_option():
    """It is set from the logprobs fields; as an option (nested, or at completions' top level) it
    was overridden silently."""
    assert "logprobs: K" in refusal({"decoding": {"top_logprobs": 3}}).message
    assert "top_logprobs: K" in refusal({"decoding": {"top_logprobs": 3}}, CHAT).message


def test_unrelated_unknown_fields_are_ignored_and_listed():
    opts, ignored = options({"frobnicate": [1], "threshold": 0.5, "user": "u", "store": True, "priority": 3,
                             "prediction": {"type": "content", "content": "x"}, "x_request_tag": "a"})
    assert opts == {"threshold": 0.5} and ignored == ["frobnicate", "x_request_tag"]   # IGNORED: silently
    err = refusal({"frobnicate": 1}, strict=True)
    assert err.code == "unknown_field" and "unknown field 'frobnicate'" in err.message


def test_the_number_of_unknown_fields_is_bounded():
    """Each unknown name is compared with every known one: a request may carry MAX_UNKNOWN."""
    assert len(options({f"f{i}": 0 for i in range(MAX_UNKNOWN)})[1]) == MAX_UNKNOWN
    err = refusal({f"f{i}": 0 for i in range(100_000)})
    assert f"more than {MAX_UNKNOWN} unknown fields" in err.message and len(err.message) < 600


def test_a_name_is_echoed_as_printable_ascii():
    """CR, LF and NUL would split a header or forge a log line, a character beyond Latin-1 cannot be
    a header at all, a comma would split the list: all percent-encoded, and the name cut."""
    assert shown("frobnicate") == "frobnicate"
    assert shown("a\r\nX-Evil: 1") == "a%0D%0AX-Evil:%201"
    assert shown("n\x00l,é名%") == "n%00l%2C%C3%A9%E5%90%8D%25"
    long = shown("x" * 10_000)
    assert long == "x" * MAX_NAME + "..."
    for name in ("a\r\nb", "\x00", "名前", "x" * 10_000, "a,b"):
        assert shown(name).isascii() and shown(name).isprintable() and "," not in shown(name)
    err = refusal({"y" * 100_000: 0.5}, strict=True)             # an error's param is cut too
    assert len(err.param) <= 2 * MAX_NAME
