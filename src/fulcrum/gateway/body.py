"""OpenAI-style request bodies -> the request's KV length estimate (pure).

``/v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids or a
list of such lists. ``/v1/chat/completions``: ``messages[*].content`` is a string or a
list of parts whose ``text`` counts. Output length: ``max_tokens`` (or the newer
``max_completion_tokens``), else the configured default.

The prompt length in tokens is ``ceil(characters / chars_per_token)`` unless a token
counter is given (a tokenizer); token-id prompts count exactly. A body that is not JSON,
or not an object, still gets an estimate from its byte length, so that any request the
gateway forwards can be placed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import orjson

#: ``count(text) -> tokens``: a tokenizer's token count of a text.
TokenCounter = Callable[[str], int]

#: Deepest JSON nesting of a body (arrays and objects); deeper: :class:`BodyTooDeep`.
MAX_JSON_DEPTH = 128
#: Bytes scanned at once by :func:`json_depth`.
_SCAN_CHUNK = 1 << 20

class BodyTooDeep(ValueError):
    """A body nested deeper than :data:`MAX_JSON_DEPTH` (answered 400)."""


def json_depth(body: bytes, limit: int = MAX_JSON_DEPTH) -> int:
    """The nesting depth of a JSON text, or 0 when it cannot exceed ``limit`` (fewer
    brackets than that). Linear and vectorised: escaped backslashes and quotes are dropped
    (``bytes.replace``), quotes toggle "inside a string", the depth is a running sum of the
    brackets outside strings (numpy)."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return 0
    text = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    deepest = depth = quotes = 0
    for at in range(0, len(text), _SCAN_CHUNK):  # bounded scratch memory
        codes = np.frombuffer(text, dtype=np.uint8, count=min(_SCAN_CHUNK, len(text) - at),
                              offset=at)
        q = np.cumsum(codes == 0x22, dtype=np.int32) + quotes
        step = ((codes == 0x5B) | (codes == 0x7B)).astype(np.int32)
        step -= (codes == 0x5D) | (codes == 0x7D)
        step[(q & 1) == 1] = 0
        run = np.cumsum(step) + depth
        deepest = max(deepest, int(run.max()))
        depth, quotes = int(run[-1]), int(q[-1])
    return deepest


class RequestShape(NamedTuple):
    """What the picker reads from a body: prompt tokens (estimated), output tokens, and
    whether the body was a parsed OpenAI request (a NamedTuple: one per request)."""

    prompt_tokens: int
    max_tokens: int
    parsed: bool
    model: str = ""
    #: The prompt as text for the prefix index (chat: each message's role and content;
    #: completions: the prompt; token ids as decimal text); "" unless asked for.
    text: str = ""
    #: ``"stream": true``: the response is streamed (its first chunk is the first token).
    stream: bool = False

    @property
    def kv_tokens(self) -> int:
        """KV length the request reaches at its end: prompt + output, tokens (>= 1)."""
        return max(1, self.prompt_tokens + self.max_tokens)


def _text_tokens(text: str, chars_per_token: float, counter: TokenCounter | None) -> int:
    if counter is not None:
        return int(counter(text))
    return math.ceil(len(text) / chars_per_token)


def _prompt_tokens(prompt: Any, cpt: float, counter: TokenCounter | None) -> int:
    if isinstance(prompt, str):
        return _text_tokens(prompt, cpt, counter)
    if isinstance(prompt, list):
        if all(isinstance(x, int) for x in prompt):
            return len(prompt)  # token ids
        return sum(_prompt_tokens(x, cpt, counter) for x in prompt)
    return 0


def _chat_tokens(messages: Any, cpt: float, counter: TokenCounter | None) -> int:
    if not isinstance(messages, list):
        return 0
    chars: list[str] = []
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        content = msg.get("content")
        if isinstance(content, str):
            chars.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    chars.append(part["text"])
    # One text, so that the character estimate rounds once (and a tokenizer sees it whole).
    return _text_tokens("\n".join(chars), cpt, counter)


def _int_field(obj: dict[str, Any], *names: str) -> int | None:
    for name in names:
        v = obj.get(name)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def prompt_text(obj: dict[str, Any]) -> str:
    """The prompt of a parsed body as one text, prefix-stable across the turns of a chat
    (``role`` then content per message); "" when it has none."""
    messages = obj.get("messages")
    if isinstance(messages, list):
        parts: list[str] = []
        for msg in messages:
            if not isinstance(msg, dict):
                continue
            role = msg.get("role")
            parts.append(f"<{role if isinstance(role, str) else ''}>")
            content = msg.get("content")
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(
                    p["text"]
                    for p in content
                    if isinstance(p, dict) and isinstance(p.get("text"), str)
                )
        return "\n".join(parts)
    return _prompt_str(obj.get("prompt"))


def _prompt_str(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        if prompt and all(isinstance(x, int) for x in prompt):
            return " ".join(map(str, prompt))
        return "\n".join(_prompt_str(x) for x in prompt)
    return ""


#: orjson reads an integer past 64 bits as a float; :func:`json.loads` keeps it an int.
_BIG = float(1 << 63)


def _loads(body: bytes) -> Any:
    """The body's JSON value (None when it is not JSON). orjson first; the standard
    library for what orjson refuses (NaN, lone surrogates, other encodings than UTF-8)
    and for a body whose output length orjson read as a float past 64 bits (json reads
    an int there, which the KV bound then refuses), so that the fields the pick reads
    come out as :func:`json.loads` gives them. (A token id past 64 bits in a prompt
    list, garbage for any tokenizer, still comes out a float: such a list is counted as
    text, with that id counted as nothing.)"""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    else:
        if not isinstance(obj, dict) or not any(
            isinstance(v, float) and abs(v) >= _BIG
            for v in (obj.get("max_tokens"), obj.get("max_completion_tokens"))
        ):
            return obj
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    except RecursionError:  # pragma: no cover - the depth scan comes first
        raise BodyTooDeep(f"request body: JSON nested deeper than {MAX_JSON_DEPTH}") from None


def parse_body(
    body: bytes,
    path: str,
    chars_per_token: float,
    default_max_tokens: int,
    counter: TokenCounter | None = None,
    with_text: bool = False,
) -> RequestShape:
    """Estimate a request's prompt and output lengths (tokens) from its body. Raises
    :class:`BodyTooDeep` for JSON nested deeper than :data:`MAX_JSON_DEPTH`.

    ``path`` is the HTTP ``:path`` (query string ignored): chat bodies are recognised by
    their ``messages`` key whatever the path, completion bodies by ``prompt``.
    """
    if not body:
        return RequestShape(0, default_max_tokens, parsed=False)
    if json_depth(body) > MAX_JSON_DEPTH:
        raise BodyTooDeep(f"request body: JSON nested deeper than {MAX_JSON_DEPTH}")
    obj = _loads(body)
    if not isinstance(obj, dict):
        return RequestShape(
            math.ceil(len(body) / chars_per_token), default_max_tokens, parsed=False
        )
    max_tokens = _int_field(obj, "max_tokens", "max_completion_tokens") or default_max_tokens
    model = obj.get("model")
    model = model if isinstance(model, str) else ""
    if "messages" in obj:
        prompt = _chat_tokens(obj["messages"], chars_per_token, counter)
    elif "prompt" in obj:
        prompt = _prompt_tokens(obj["prompt"], chars_per_token, counter)
    else:
        return RequestShape(
            math.ceil(len(body) / chars_per_token), max_tokens, parsed=False, model=model
        )
    text = prompt_text(obj) if with_text else ""
    stream = obj.get("stream") is True
    return RequestShape(prompt, max_tokens, parsed=True, model=model, text=text, stream=stream)


def load_tokenizer(path: str) -> TokenCounter:
    """A token counter from a ``tokenizer.json`` (Hugging Face ``tokenizers`` package)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as err:  # pragma: no cover - optional dependency
        raise RuntimeError(
            "gateway.tokenizer needs the `tokenizers` package (pip install tokenizers)"
        ) from err
    tok = Tokenizer.from_file(path)

    def count(text: str) -> int:
        return len(tok.encode(text, add_special_tokens=False).ids)

    return count
