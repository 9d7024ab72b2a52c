"""Incremental detokenisation with stop strings: text is released only once it can no longer
change (a multi-byte character completed, a stop string ruled out)."""

from __future__ import annotations

from pdd.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"


class TextAssembler:
    def __init__(self, tokenizer: Tokenizer, *, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already released
        self.decoded_len = 0  # characters the tokens pushed so far decode to

    def _text(self) -> str:
        return self.tokenizer.decode(self.ids)

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
