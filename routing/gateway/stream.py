"""Incremental detokenisation with stop strings: text is released only once it can no longer
change (a multi-byte character completed, a stop string ruled out)."""

from __future__ import annotations

from pdd.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class TextAssembler:
    """Decodes a window of the last few tokens per push, not the whole text (which made a
    token's cost grow with the answer: 72 us per token at 3,000 tokens, nearly all of it
    re-decoding): the text of the tokens up to ``_read`` is settled in ``self.text``; a push
    decodes ``ids[_prefix:]`` and ``ids[_prefix:_read]`` (the window starts one settled step
    back, so a tokenizer that treats a sequence's first token differently, such as a
    leading-space marker, does so in both) and settles the difference once it ends in a whole
    character."""

    MAX_WINDOW = 16  # tokens that never complete a character (invalid bytes) settle anyway

    def __init__(self, tokenizer: Tokenizer, *, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # the settled text: what ids[:_read] decode to
        self._prefix = 0
        self._read = 0
        self.emitted = 0  # characters of the text already released
        self.decoded_len = 0  # characters the tokens pushed so far decode to

    def _text(self) -> str:
        """The settled text plus the window's (its cut character, if any, as U+FFFD)."""
        decode = self.tokenizer.decode
        settled_part = decode(self.ids[self._prefix : self._read])
        window = decode(self.ids[self._prefix :])
        fresh = window[len(settled_part) :]
        whole = not fresh.endswith(_REPLACEMENT)
        if fresh and (whole or len(self.ids) - self._prefix > self.MAX_WINDOW):
            self.text += fresh
            self._prefix, self._read = self._read, len(self.ids)
            return self.text
        return self.text + fresh

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add one token; return (text now safe to release, whether a stop string was hit)."""
        self.ids.append(token_id)
        text = self._text()
        self.decoded_len = len(text)
        for stop in self.stop:
            at = text.find(stop, max(0, self.emitted - len(stop)))
            if at != -1:
                piece = text[self.emitted : at] if at > self.emitted else ""
                self.emitted = max(self.emitted, at)
                return piece, True
        safe = len(text)
        if text.endswith(_REPLACEMENT):
            safe -= 1  # maybe a character cut mid-way; wait for its next byte
        for stop in self.stop:  # hold back a tail that could still grow into a stop string
            for k in range(min(len(stop) - 1, safe - self.emitted), 0, -1):
                if text[safe - k : safe] == stop[:k]:
                    safe -= k
                    break
        if safe <= self.emitted:
            return "", False
        piece = text[self.emitted : safe]
        self.emitted = safe
        return piece, False

    def flush(self) -> str:
        text = self._text()
        piece = text[self.emitted :]
        self.emitted = len(text)
        return piece
