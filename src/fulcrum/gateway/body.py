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
from dataclasses import dataclass
from typing import Any

#: ``count(text) -> tokens``: a tokenizer's token count of a text.
TokenCounter = Callable[[str], int]


@dataclass(frozen=True, slots=True)
class RequestShape:
    """What the picker reads from a body: prompt tokens (estimated), output tokens, and
    whether the body was a parsed OpenAI request."""

    prompt_tokens: int
    max_tokens: int
    parsed: bool
    model: str = ""
    #: The prompt as text for the prefix index (chat: each message's role and content;
    #: completions: the prompt; token ids as decimal text); "" unless asked for.
    text: str = ""

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


def parse_body(
    body: bytes,
    path: str,
    chars_per_token: float,
    default_max_tokens: int,
    counter: TokenCounter | None = None,
    with_text: bool = False,
) -> RequestShape:
    """Estimate a request's prompt and output lengths (tokens) from its body.

    ``path`` is the HTTP ``:path`` (query string ignored): chat bodies are recognised by
    their ``messages`` key whatever the path, completion bodies by ``prompt``.
    """
    if not body:
        return RequestShape(0, default_max_tokens, parsed=False)
    try:
        obj = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        obj = None
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
    return RequestShape(prompt, max_tokens, parsed=True, model=model, text=text)


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
