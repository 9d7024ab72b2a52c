"""A served model run by the emulated engine (source profile:...) is tokenized with the byte
tokenizer, the ids the emulated engine speaks: no tokenizer file is needed."""

from __future__ import annotations

from pdd.tokenizer import ByteTokenizer
from routing.gateway.tokenizers import tokenizer_for


def test_a_profile_source_uses_the_byte_tokenizer():
    tok = tokenizer_for(name="paper", source="profile:paper-dsv4", tokenizer="")
    assert isinstance(tok, ByteTokenizer)
    assert tok.encode("agent") == list(b"agent")
