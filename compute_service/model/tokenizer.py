"""The worker's tokenizer: the shared `prefixcache_client.tokenizer` classes (the gateway uses the
very same ones) and what only a worker knows, its model's config.

- A checkpoint with `tokenizer.json` (or the byte tokenizer's file) gets that tokenizer; its
  largest id must be inside the model's vocabulary, else loading fails (an id past the
  embedding would be a crash at the first request that produces it).
- A checkpoint without one gets `NoTokenizer`: whatever its architecture and vocabulary size it
  serves token-id prompts, and a text prompt is refused (`NoTokenizerError`); it never falls
  back to the byte tokenizer, whose ids mean nothing to a real checkpoint.
- EOS always comes from the checkpoint: config.json's and generation_config.json's
  `eos_token_id` (int or list, all of them), never from a fallback.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from compute_service.model.config import ModelConfig
from prefixcache_client.tokenizer import (BYTE_TOKENIZER_FILE, ByteTokenizer, JsonTokenizer,
                                          Tokenizer, TokenizerError, checkpoint_token_ids,
                                          from_files, has_tokenizer, tokenizer_files)

__all__ = ["ByteTokenizer", "JsonTokenizer", "NoTokenizer", "NoTokenizerError", "Tokenizer",
           "load_tokenizer"]


class NoTokenizerError(TokenizerError):
    """A text prompt (or chat) sent to a worker that has no tokenizer."""

    def __init__(self) -> None:
        super().__init__("prompt.text: this worker has no tokenizer (its checkpoint has no "
                         "tokenizer.json); send token_ids")


class NoTokenizer:
    """The tokenizer of a checkpoint without one: token ids in, token ids out. `decode` gives
    "" (a response carries the ids only), `fingerprint` is "" (matches no tokenizer)."""

    bos_token_id = None
    adds_bos = False
    fingerprint = ""
    chat_template = None
    files: Mapping[str, bytes] = {}

    def __init__(self, vocab_size: int, eos_token_ids: tuple[int, ...]) -> None:
        self.vocab_size, self.eos_token_ids = vocab_size, eos_token_ids

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        raise NoTokenizerError()

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""

    def text_prompt_ids(self, text: str) -> list[int]:
        raise NoTokenizerError()

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True) -> str:
        raise NoTokenizerError()

    def chat_ids(self, messages: Sequence[Mapping[str, Any]],
                 add_generation_prompt: bool = True) -> list[int]:
        raise NoTokenizerError()


def load_tokenizer(path: str | Path, cfg: ModelConfig) -> Tokenizer:
    """The tokenizer of checkpoint directory `path` for a model of config `cfg` (see the module
    docstring). ValueError naming the file when a tokenizer file is unusable."""
    files = tokenizer_files(path)
    if not has_tokenizer(files):
        eos = checkpoint_token_ids(files)[1] or cfg.eos_token_ids
        return NoTokenizer(cfg.vocab_size, eos)
    tok = from_files(files)
    if tok.vocab_size > cfg.vocab_size:
        name = BYTE_TOKENIZER_FILE if isinstance(tok, ByteTokenizer) else "tokenizer.json"
        raise TokenizerError(f"{Path(path) / name}: ids up to {tok.vocab_size - 1}, but the "
                             f"model's vocabulary (config.json vocab_size) is {cfg.vocab_size}")
    return tok
