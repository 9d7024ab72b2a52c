"""The OpenAI wire shapes of an answer: its chunks, whole completions, usage and server-sent
events, and the ``logprobs`` objects built from the agents' token events.

The agents put ``logprob`` and ``top_logprobs`` ([[token id, logprob], ...], most likely first)
on each token event when the plan's sampling asks (agents/PROTOCOL.md); the values are the raw
model distribution's (log-softmax of the logits, before temperature and top-p), as vLLM returns
by default. Here they become

- chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}, ...]}, ...]}`` with exactly ``top_logprobs`` alternatives per token;
- legacy completions: ``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``, where
  each ``top_logprobs`` entry maps the top ``logprobs`` tokens' text to their logprob and
  always includes the sampled token (so up to ``logprobs`` + 1 entries, as OpenAI documents);
  ``text_offset`` is each token's character offset in the completion text.

A stream carries the logprobs of the tokens whose text a chunk releases in that chunk (a token
whose text is held back, such as half a UTF-8 character or a possible stop string, goes with
the next chunk; any left at the end go with the final one).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pdd.events import TokenEvent
from pdd.tokenizer import ByteTokenizer, Tokenizer


@dataclass(slots=True)
class DeliveredToken:
    token_id: int
    logprob: float | None  # None only when an agent (an older build) sent none
    top: list[tuple[int, float]]
    text_offset: int  # characters of the completion text before this token


def token_bytes(tokenizer: Tokenizer, token_id: int) -> bytes:
    """The token's own bytes (a byte-level token may be part of a UTF-8 character)."""
    if isinstance(tokenizer, ByteTokenizer):
        return bytes([token_id]) if 0 <= token_id < 256 else b""
    return tokenizer.decode([token_id]).encode("utf-8")


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    return token_bytes(tokenizer, token_id).decode("utf-8", errors="replace")


def _parse(event: TokenEvent, text_offset: int) -> DeliveredToken:
    return DeliveredToken(
        event.token_id, event.logprob, list(event.top_logprobs or ()), text_offset
    )


@dataclass(slots=True)
class LogprobsCollector:
    """The delivered tokens' logprobs of one request, across retries and migrations."""

    kind: str  # "chat.completions" or "completions"
    tokenizer: Tokenizer
    tokens: list[DeliveredToken] = field(default_factory=list)
    taken: int = 0  # tokens already sent in a stream chunk

    def add(self, event: TokenEvent, text_offset: int) -> None:
        self.tokens.append(_parse(event, text_offset))

    def take(self) -> dict[str, Any] | None:
        """The logprobs object of the tokens since the last take (None when there are none)."""
        fresh = self.tokens[self.taken :]
        self.taken = len(self.tokens)
        return self.shape(fresh) if fresh else None

    def all(self) -> dict[str, Any]:
        return self.shape(self.tokens)

    def shape(self, tokens: list[DeliveredToken]) -> dict[str, Any]:
        if self.kind == "chat.completions":
            return chat_logprobs(self.tokenizer, tokens)
        return completion_logprobs(self.tokenizer, tokens)


def _entry(tokenizer: Tokenizer, token_id: int, logprob: float | None) -> dict[str, Any]:
    raw = token_bytes(tokenizer, token_id)
    return {
        "token": raw.decode("utf-8", errors="replace"),
        "logprob": logprob,
        "bytes": list(raw),
    }


def chat_logprobs(tokenizer: Tokenizer, tokens: list[DeliveredToken]) -> dict[str, Any]:
    return {
        "content": [
            _entry(tokenizer, t.token_id, t.logprob)
            | {"top_logprobs": [_entry(tokenizer, i, v) for i, v in t.top]}
            for t in tokens
        ],
        "refusal": None,
    }


def completion_logprobs(tokenizer: Tokenizer, tokens: list[DeliveredToken]) -> dict[str, Any]:
    top: list[dict[str, float | None]] = []
    for t in tokens:
        alternatives: dict[str, float | None] = {}
        for i, v in t.top:
            alternatives.setdefault(token_text(tokenizer, i), v)
        alternatives.setdefault(token_text(tokenizer, t.token_id), t.logprob)
        top.append(alternatives)
    return {
        "tokens": [token_text(tokenizer, t.token_id) for t in tokens],
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": top,
        "text_offset": [t.text_offset for t in tokens],
    }


# -- the answer's wire shapes ----------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chunk(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    text: str | None,
    finish: str | None,
    usage: dict[str, Any] | None = None,
    logprobs: dict | None = None,
) -> dict[str, Any]:
    """One streamed chunk: ``chat.completion.chunk`` or ``text_completion``; with `usage`, the
    final usage-only chunk (no choices)."""
    if kind == "chat.completions":
        delta = {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return _envelope(request_id, obj, created, model, [] if usage is not None else [choice], usage)


def role_chunk(request_id: str, model: str, created: int) -> dict[str, Any]:
    """A chat stream's first chunk: the assistant's role, no content yet."""
    return chunk("chat.completions", request_id, model, created, None, None) | {
        "choices": [
            {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
    }


def completion(
    kind: str,
    request_id: str,
    model: str,
    created: int,
    text: str,
    finish: str | None,
    usage: dict[str, Any],
    logprobs: dict | None,
) -> dict[str, Any]:
    """A whole (non-streamed) answer: ``chat.completion`` or ``text_completion``."""
    if kind == "chat.completions":
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    return _envelope(request_id, obj, created, model, [choice], usage)


def _envelope(
    request_id: str, obj: str, created: int, model: str, choices: list, usage: dict | None
) -> dict[str, Any]:
    return {
        "id": request_id,
        "object": obj,
        "created": created,
        "model": model,
        "choices": choices,
        "usage": usage,
    }


def sse(data: dict | str) -> bytes:
    """One server-sent event: ``data: <json>`` (or a literal such as ``[DONE]``)."""
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()
