"""Byte-level fallback tokenizer and tokenizer.json loading."""

from __future__ import annotations

from pathlib import Path

import pytest

from compute_service.model import ByteTokenizer, HFTokenizer, load_tokenizer, preset_config


def test_byte_round_trip_including_multibyte_text() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld — 你好 🙂\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_special_tokens() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("ab", add_bos=True) + [tok.EOS]
    assert ids == [tok.BOS, 97, 98, tok.EOS]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>ab<|eos|>"
    assert tok.eos_token_ids == (258,) and tok.vocab_size == 259


def test_byte_decode_of_a_partial_character_is_replaced() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("é")
    assert tok.decode(ids[:1]) == "\ufffd"


def test_tokenizer_json_is_used_when_present(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    vocab = {"[UNK]": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4, "again": 5}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tk.decoder = tokenizers.decoders.WordPiece()
    tk.add_special_tokens(["<s>", "</s>"])
    tk.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        '{"bos_token": "<s>", "eos_token": {"content": "</s>"}}'
    )
    cfg = preset_config("tiny-transformer").replace(bos_token_id=None, eos_token_ids=())
    tok = load_tokenizer(tmp_path, cfg)
    assert isinstance(tok, HFTokenizer)
    ids = tok.encode("hello world again", add_bos=True)
    assert ids == [1, 3, 4, 5]
    assert tok.decode(ids + [2]) == "hello world again"
    assert tok.bos_token_id == 1 and tok.eos_token_ids == (2,)
    # Ids from config.json win over tokenizer_config.json.
    tok = load_tokenizer(tmp_path, cfg.replace(eos_token_ids=(4, 5)))
    assert tok.eos_token_ids == (4, 5)


def test_byte_fallback_needs_room_in_the_vocabulary(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        load_tokenizer(tmp_path, preset_config("tiny-transformer").replace(vocab_size=100))
