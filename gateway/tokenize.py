"""The gateway's tokenizers: torch-free twins of `compute_service.model.tokenizer`.

The gateway tokenizes text prompts itself and forwards token ids, so that the page hashes it
routes on are exactly the pages the worker computes. It must therefore produce the worker's ids
bit for bit, with the worker's BOS rule (`compute_service.server_messages.prompt_of`: a text
prompt starts with BOS when the tokenizer has one; token-id prompts are taken exactly as sent). It cannot import the
worker's module: `compute_service.model` imports torch, which the gateway never does.
tests/gateway/test_server_offline.py checks that both produce the same ids.

    byte  ids 0-255 are the UTF-8 bytes; 256 = pad, 257 = bos, 258 = eos (vocab 259)
    PATH  a checkpoint directory: PATH/tokenizer.json through the `tokenizers` package, BOS from
          config.json's bos_token_id, else tokenizer_config.json's bos_token (as the worker)
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from prefixcache.v1 import compute_service_pb2 as pb

BYTE = "byte"


class PromptTokenizer(Protocol):
    """What the gateway needs of a tokenizer: ids of a text and the ids' upper bound."""
    vocab_size: int
    bos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...


class ByteTokenizer:
    """`compute_service.model.tokenizer.ByteTokenizer`'s encode (same ids, same BOS)."""
    vocab_size = 259
    bos_token_id: int | None = 257

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class JsonTokenizer:
    """`tokenizer.json` with the worker's `HFTokenizer` rules: no post-processor specials
    (add_special_tokens=False), BOS from config.json, else from tokenizer_config.json."""

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer  # only needed for checkpoints that ship one

        path = Path(path)
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"--tokenizer {path}: no tokenizer.json in that directory")
        self._tok = Tokenizer.from_file(str(file))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.bos_token_id = self._bos(path)

    def _bos(self, path: Path) -> int | None:
        config = path / "config.json"
        if config.is_file():
            bos = json.loads(config.read_text()).get("bos_token_id")
            if bos is not None:
                return int(bos)
        conf_file = path / "tokenizer_config.json"
        if not conf_file.is_file():
            return None
        tok = json.loads(conf_file.read_text()).get("bos_token")
        tok = tok.get("content") if isinstance(tok, dict) else tok
        return self._tok.token_to_id(tok) if isinstance(tok, str) else None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(spec: str) -> PromptTokenizer:
    """`byte` or a checkpoint directory (see the module docstring)."""
    return ByteTokenizer() if spec == BYTE else JsonTokenizer(spec)


def prompt_ids(request: pb.GenerateRequest, tokenizer: PromptTokenizer) -> list[int]:
    """The token ids the worker would compute for `request`'s prompt. ValueError naming the
    field when there is none (the worker's own message for it)."""
    which = request.WhichOneof("prompt")
    if which == "token_ids":
        ids = list(request.token_ids.ids)
    elif which == "text" and request.text:
        bos = tokenizer.bos_token_id
        ids = ([bos] if bos is not None else []) + tokenizer.encode(request.text)
    else:
        ids = []
    if not ids:
        raise ValueError("prompt: must not be empty")
    return ids
