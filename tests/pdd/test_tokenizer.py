from __future__ import annotations

import pytest
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from pdd.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer, apply_chat_template


def test_byte_tokenizer_round_trips_any_utf8_text() -> None:
    tok = ByteTokenizer()
    text = "Baton: prefill → decode, 日本語, emoji 🚀, NUL \x00 and newline\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_has_specials_after_the_bytes() -> None:
    tok = ByteTokenizer()
    assert (tok.BOS, tok.EOS, tok.vocab_size, tok.eos_id) == (256, 257, 259, 257)
    assert tok.decode([tok.BOS, *tok.encode("hi"), tok.EOS]) == "hi"
    assert isinstance(tok, Tokenizer)


def _word_level_json(tmp_path) -> str:
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3, "baton": 4}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["</s>"])
    path = tmp_path / "tokenizer.json"
    raw.save(str(path))
    return str(path)


def test_hf_tokenizer_wraps_tokenizer_json(tmp_path) -> None:
    tok = HFTokenizer(_word_level_json(tmp_path))
    assert tok.encode("hello baton world") == [2, 4, 3]
    assert tok.encode("hello zebra") == [2, 0]
    assert tok.decode([2, 4, 1]) == "hello baton"  # the special </s> is skipped
    assert tok.eos_id == 1  # found by name
    assert tok.vocab_size == 5
    assert isinstance(tok, Tokenizer)


def test_hf_tokenizer_missing_file_is_a_value_error(tmp_path) -> None:
    with pytest.raises(ValueError, match="tokenizer file not found"):
        HFTokenizer(tmp_path / "nope.json")


def test_chat_template_renders_roles_in_order_and_ends_with_assistant() -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}],
        },
    ]
    assert apply_chat_template(messages) == (
        "<|system|>\nBe brief.\n<|user|>\nHi!\n<|assistant|>\n"
    )
    assert apply_chat_template(messages, add_generation_prompt=False).endswith("<|user|>\nHi!\n")


def test_chat_template_earlier_turns_are_a_prefix_of_later_prompts() -> None:
    turn1 = [{"role": "user", "content": "a"}]
    turn2 = [*turn1, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    first = apply_chat_template(turn1, add_generation_prompt=False)
    assert apply_chat_template(turn2).startswith(first)


def test_chat_template_rejects_unknown_role() -> None:
    with pytest.raises(ValueError, match="role"):
        apply_chat_template([{"role": "robot", "content": "x"}])
