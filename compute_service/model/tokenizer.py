"""Tokenizers: a byte-level fallback and `tokenizer.json` through the `tokenizers` package.

Both implement the `Tokenizer` protocol the engine uses: `encode`, `decode`, `vocab_size`,
`bos_token_id` and `eos_token_ids` (a model may have several stop ids).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from compute_service.model.config import ModelConfig


class Tokenizer(Protocol):
    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class ByteTokenizer:
    """Ids 0-255 are the UTF-8 bytes of the text; 256 = <|pad|>, 257 = <|bos|>, 258 = <|eos|>.

    decode() replaces an incomplete UTF-8 sequence with U+FFFD, so a streaming caller should
    decode the whole output and emit the new suffix once it no longer ends in a partial char.
    """

    PAD, BOS, EOS = 256, 257, 258
    SPECIAL_TOKENS = {PAD: "<|pad|>", BOS: "<|bos|>", EOS: "<|eos|>"}

    @property
    def vocab_size(self) -> int:
        return 259

    @property
    def bos_token_id(self) -> int:
        return self.BOS

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return (self.EOS,)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        return ([self.BOS] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        out, run = [], bytearray()
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            if not skip_special_tokens:
                out.append(self.SPECIAL_TOKENS.get(i, f"<|{i}|>"))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


class HFTokenizer:
    """A `tokenizer.json` (Hugging Face `tokenizers`), with bos/eos from the model config,
    falling back to tokenizer_config.json's token strings."""

    def __init__(
        self, path: str | Path, bos_token_id: int | None, eos_token_ids: tuple[int, ...]
    ) -> None:
        from tokenizers import Tokenizer as _Tokenizer  # only needed when a checkpoint ships one

        path = Path(path)
        self._tok = _Tokenizer.from_file(str(path / "tokenizer.json"))
        if bos_token_id is None or not eos_token_ids:
            bos, eos = self._special_from_tokenizer_config(path)
            bos_token_id = bos if bos_token_id is None else bos_token_id
            eos_token_ids = eos_token_ids or eos
        self._bos, self._eos = bos_token_id, eos_token_ids

    def _special_from_tokenizer_config(self, path: Path) -> tuple[int | None, tuple[int, ...]]:
        file = path / "tokenizer_config.json"
        if not file.exists():
            return None, ()
        conf = json.loads(file.read_text())

        def token_id(key: str) -> int | None:
            tok = conf.get(key)
            tok = tok.get("content") if isinstance(tok, dict) else tok
            return self._tok.token_to_id(tok) if isinstance(tok, str) else None

        eos = token_id("eos_token")
        return token_id("bos_token"), (eos,) if eos is not None else ()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        # add_special_tokens=False: the tokenizer's post-processor may add BOS on its own;
        # whether to add it is the caller's choice here.
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self._bos] if add_bos and self._bos is not None else []) + ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)


def load_tokenizer(path: str | Path, cfg: ModelConfig) -> Tokenizer:
    """`path/tokenizer.json` when present, else the byte-level fallback (which needs
    cfg.vocab_size >= 259)."""
    path = Path(path)
    if (path / "tokenizer.json").exists():
        return HFTokenizer(path, cfg.bos_token_id, cfg.eos_token_ids)
    if cfg.vocab_size < ByteTokenizer().vocab_size:
        raise ValueError(
            f"{path}: no tokenizer.json and vocab_size {cfg.vocab_size} < 259 for byte fallback"
        )
    return ByteTokenizer()
