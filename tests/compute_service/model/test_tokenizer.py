"""The worker's tokenizer: the shared byte-level and tokenizer.json tokenizers, and a checkpoint
without a tokenizer (token ids only, EOS from its configs, never the byte fallback)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from compute_service.model import (ByteTokenizer, JsonTokenizer, NoTokenizer, NoTokenizerError,
                                   load_tokenizer, preset_config)
from prefixcache_client.tokenizer import TokenizerError

BPE = Path(__file__).resolve().parents[2] / "data" / "bpe_tokenizer"


def test_byte_round_trip_including_multibyte_text() -> None:
    tok = ByteTokenizer()
    text = "héllo, wörld — 你好 🙂\n"
    ids = tok.encode(text)
    assert all(0 <= i < 256 for i in ids) and len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_special_tokens() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("ab", add_bos=True) + [tok.EOS]
    assert ids == [tok.BOS, 97, 98, tok.EOS] == tok.text_prompt_ids("ab") + [tok.EOS]
    assert tok.decode(ids) == "ab"
    assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>ab<|eos|>"
    assert tok.eos_token_ids == (258,) and tok.vocab_size == 259


def test_byte_decode_of_a_partial_character_is_replaced() -> None:
    tok = ByteTokenizer()
    ids = tok.encode("é")
    assert tok.decode(ids[:1]) == "\ufffd"


def _checkpoint(tmp_path: Path, config: dict, generation: dict | None = None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(config))
    if generation is not None:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return tmp_path


def test_tokenizer_json_is_used_with_the_checkpoints_eos(tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BPE / name, tmp_path / name)
    cfg = preset_config("tiny-transformer")
    # No ids in the configs: tokenizer_config.json's bos_token and eos_token.
    tok = load_tokenizer(_checkpoint(tmp_path, {"model_type": "llama"}), cfg)
    assert isinstance(tok, JsonTokenizer)
    assert (tok.bos_token_id, tok.eos_token_ids, tok.adds_bos) == (0, (3,), True)
    assert tok.decode(tok.text_prompt_ids("hello world")) == "hello world"
    # config.json's and generation_config.json's ids win, all of them, in that order.
    tok = load_tokenizer(_checkpoint(tmp_path, {"bos_token_id": 0, "eos_token_id": 1},
                                     {"eos_token_id": [3, 1]}), cfg)
    assert tok.eos_token_ids == (1, 3)


def test_a_tokenizer_larger_than_the_model_is_refused(tmp_path: Path) -> None:
    shutil.copy(BPE / "tokenizer.json", tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match="vocab_size"):
        load_tokenizer(tmp_path, preset_config("tiny-transformer").replace(vocab_size=300))


@pytest.mark.parametrize("vocab", [100, 320])
def test_no_tokenizer_json_serves_token_ids_only(tmp_path: Path, vocab: int) -> None:
    cfg = preset_config("tiny-mamba2").replace(vocab_size=vocab, eos_token_ids=(7,))
    tok = load_tokenizer(_checkpoint(tmp_path, {"eos_token_id": 7},
                                     {"eos_token_id": [7, 9]}), cfg)
    assert isinstance(tok, NoTokenizer)
    assert tok.vocab_size == vocab and tok.eos_token_ids == (7, 9)
    assert tok.fingerprint == "" and tok.bos_token_id is None and tok.decode([1, 2]) == ""
    with pytest.raises(NoTokenizerError, match="prompt.text.*send token_ids"):
        tok.text_prompt_ids("hi")
