"""Tokenizers behind one small protocol: a byte-level one for baton-tiny and a wrapper over a
Hugging Face `tokenizer.json`, plus the chat template that turns OpenAI messages into a prompt.

The tokenizer front the engines and the gateway share: no torch (the `tokenizers` package is
imported only when a `tokenizer.json` is loaded); `agents.engine` re-exports it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and the HTTP layer need from a tokenizer."""

    @property
    def eos_id(self) -> int | None: ...

    @property
    def vocab_size(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; specials follow. Any text round-trips exactly."""

    BOS = 256
    EOS = 257
    PAD = 258
    NUM_SPECIALS = 3

    @property
    def eos_id(self) -> int:
        return self.EOS

    @property
    def bos_id(self) -> int:
        return self.BOS

    @property
    def vocab_size(self) -> int:
        return 256 + self.NUM_SPECIALS

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        # Specials carry no text; a cut multi-byte sequence (mid-stream) becomes U+FFFD.
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


# Tried in order when the caller does not say which token ends a sequence.
_EOS_CANDIDATES = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


class HFTokenizer:
    """A Hugging Face `tokenizers` tokenizer loaded from a `tokenizer.json` file."""

    def __init__(self, path: str | Path, eos_id: int | None = None) -> None:
        from tokenizers import Tokenizer as RawTokenizer

        path = Path(path)
        if not path.is_file():
            raise ValueError(f"tokenizer file not found: {path}")
        self._tok = RawTokenizer.from_file(str(path))
        if eos_id is None:
            for token in _EOS_CANDIDATES:
                eos_id = self._tok.token_to_id(token)
                if eos_id is not None:
                    break
        self._eos_id = eos_id

    @property
    def eos_id(self) -> int | None:
        return self._eos_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        # Specials (BOS) come from the prompt text, not from the post-processor.
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


CHAT_ROLES = ("system", "user", "assistant", "tool")


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError("chat content parts must be {'type': 'text', 'text': ...}")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise ValueError(f"chat message content must be a string or a list, got {type(content)}")


def apply_chat_template(
    messages: Iterable[Mapping[str, Any]], add_generation_prompt: bool = True
) -> str:
    """Render OpenAI-style messages as one prompt string.

    The format is fixed and model-independent: every message becomes
    ``"<|{role}|>\\n{content}\\n"`` in order, and with `add_generation_prompt` the prompt ends
    with ``"<|assistant|>\\n"`` so the model continues as the assistant. Content may be a string
    or a list of ``{"type": "text", "text": ...}`` parts (joined without separator). Identical
    messages always give an identical string, so a multi-turn session's earlier turns are an
    exact prefix of its later prompts (which is what makes the prefix caches hit).
    """
    out = []
    for msg in messages:
        role = msg.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"chat message role must be one of {CHAT_ROLES}, got {role!r}")
        out.append(f"<|{role}|>\n{_content_text(msg.get('content'))}\n")
    if add_generation_prompt:
        out.append("<|assistant|>\n")
    return "".join(out)
