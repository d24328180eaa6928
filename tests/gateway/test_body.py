"""OpenAI bodies -> KV length estimate."""

from __future__ import annotations

import json
from types import SimpleNamespace
from unittest import mock

from hypothesis import given
from hypothesis import strategies as st

from fulcrum.gateway.body import parse_body


def shape(obj: object, path: str = "/v1/completions", cpt: float = 4.0, default: int = 256):
    return parse_body(json.dumps(obj).encode(), path, cpt, default)


def test_completion_prompt_chars_over_four_plus_max_tokens() -> None:
    s = shape({"model": "m", "prompt": "a" * 401, "max_tokens": 7})
    assert (s.prompt_tokens, s.max_tokens, s.parsed, s.model) == (101, 7, True, "m")
    assert s.kv_tokens == 108


def test_completion_prompt_forms() -> None:
    assert shape({"prompt": ["aaaa", "bbbbbbbb"]}).prompt_tokens == 1 + 2
    assert shape({"prompt": [1, 2, 3, 4, 5]}).prompt_tokens == 5  # token ids count exactly
    assert shape({"prompt": [[1, 2], [3]]}).prompt_tokens == 3


def test_chat_messages_strings_and_parts() -> None:
    obj = {
        "messages": [
            {"role": "system", "content": "s" * 100},
            {
                "role": "user",
                "content": [{"type": "text", "text": "u" * 99}, {"type": "image_url"}],
            },
        ],
        "max_completion_tokens": 9,
    }
    s = shape(obj, "/v1/chat/completions")
    assert s.prompt_tokens == 50  # (100 + 1 + 99) / 4
    assert s.max_tokens == 9


def test_default_max_tokens_and_bad_values() -> None:
    assert shape({"prompt": "x", "max_tokens": 0}, default=33).max_tokens == 33
    assert shape({"prompt": "x", "max_tokens": True}, default=33).max_tokens == 33
    assert shape({"prompt": "x", "max_tokens": "12"}, default=33).max_tokens == 33


def test_not_json_or_not_openai_is_estimated_from_its_length() -> None:
    s = parse_body(b"\xff" * 40, "/x", 4.0, 10)
    assert (s.prompt_tokens, s.max_tokens, s.parsed) == (10, 10, False)
    s = parse_body(b"[1,2]", "/x", 4.0, 10)
    assert not s.parsed and s.prompt_tokens == 2
    s = parse_body(b"", "/x", 4.0, 10)
    assert s.kv_tokens == 10


def test_token_counter_is_used_when_given() -> None:
    s = parse_body(b'{"prompt": "a b c d e"}', "/v1/completions", 4.0, 1, lambda t: len(t.split()))
    assert s.prompt_tokens == 5


@given(st.binary(max_size=2000), st.floats(min_value=0.5, max_value=64))
def test_any_body_gets_a_positive_estimate(body: bytes, cpt: float) -> None:
    s = parse_body(body, "/v1/completions", cpt, 16)
    assert s.kv_tokens >= 1


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=50),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=10), c, max_size=4),
        max_leaves=20,
    )
)
def test_any_json_gets_a_positive_estimate(obj: object) -> None:
    for wrap in (obj, {"prompt": obj}, {"messages": obj, "max_tokens": obj}):
        assert shape(wrap).kv_tokens >= 1


def test_bodies_parse_as_the_standard_library_parses_them() -> None:
    # orjson first, json for what orjson reads otherwise: an output length past 64
    # bits stays an int (the KV bound refuses it), NaN and lone surrogates parse.
    huge = 123456789012345678901234567890
    shape = parse_body(b'{"prompt":"hi","max_tokens":%d}' % huge, "/v1/completions", 4.0, 256)
    assert shape.max_tokens == huge and isinstance(shape.max_tokens, int)
    odd = parse_body(b'{"prompt":"\\ud800 hi","max_tokens":7,"x":NaN}', "/v1/completions",
                     4.0, 256)
    assert odd.parsed and odd.max_tokens == 7 and odd.prompt_tokens == 1


#: JSON values with 64-bit integers: a token id past 64 bits in a prompt list is the one
#: documented difference (``body._loads``); an output length past 64 bits is not one.
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(1 << 63), (1 << 63) - 1)
    | st.floats(allow_nan=False) | st.text(),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=12,
)


@given(
    extra=st.dictionaries(st.sampled_from(["prompt", "messages", "model", "stream", "x"]),
                          _JSON, max_size=4),
    max_tokens=st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=3)),
)
def test_the_fast_parse_gives_what_json_alone_gives(
    extra: dict[str, object], max_tokens: object
) -> None:
    import orjson

    from fulcrum.gateway import body as body_mod

    def refuse(_: bytes) -> object:
        raise orjson.JSONDecodeError("forced", "", 0)

    raw = json.dumps({**extra, "max_tokens": max_tokens}).encode()
    fast = parse_body(raw, "/v1/completions", 4.0, 256, with_text=True)
    with mock.patch.object(body_mod, "orjson",
                           SimpleNamespace(loads=refuse, JSONDecodeError=orjson.JSONDecodeError)):
        slow = parse_body(raw, "/v1/completions", 4.0, 256, with_text=True)
    assert fast == slow
