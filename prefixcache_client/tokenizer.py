"""One tokenizer for the compute workers and the gateway: the byte-level tokenizer of the presets
and a checkpoint's `tokenizer.json`, torch-free (stdlib, `tokenizers`, `jinja2`).

The gateway hashes a prompt's pages from token ids it computes itself, so it must tokenize every
text and every chat exactly as the worker that runs the request; both use this module, and a
tokenizer is identified by its `fingerprint`, so that two tokenizers are interchangeable iff
their fingerprints are equal.

Files (`Tokenizer.files`, what GetTokenizer sends): the checkpoint's `tokenizer.json`,
`tokenizer_config.json`, `special_tokens_map.json` and `chat_template.jinja` as they are, plus
`config.json` and `generation_config.json` cut down to their token ids (`bos_token_id`,
`eos_token_id`, `pad_token_id`, canonical JSON; absent when they hold none): the rest of those
files describes the weights, and two checkpoints sharing a tokenizer must share a fingerprint.
The presets' byte-level tokenizer is the single file `prefixcache_byte_tokenizer.json` (a
constant), so its fingerprint is a constant too. `from_files(t.files)` rebuilds `t` exactly.

Fingerprint: SHA-256 over a version tag, each file's name and content in name order (length
prefixed), and the BOS rule; a change of any byte of any file changes it.

Rules, as transformers' `PreTrainedTokenizerFast` applies them to the same files:
- `encode(text)` never runs tokenizer.json's post-processor (add_special_tokens=False); special
  tokens written in the text are matched as tokens.
- BOS rule: a text prompt starts with BOS iff `adds_bos`: iff tokenizer.json's post-processor
  puts one token before a text (transformers v5 ignores tokenizer_config.json's `add_bos_token`
  when tokenizer.json exists: the post-processor is the truth), and that token is
  `bos_token_id`; so a text prompt's ids are transformers' `tokenizer(text)` ids. Otherwise
  `bos_token_id` is tokenizer_config.json's `bos_token` looked up in the vocabulary, else
  config.json's or generation_config.json's `bos_token_id`. Tokens a post-processor would add
  after the text (an EOS) are not added: a prompt is continued, not ended.
- EOS: config.json's and generation_config.json's `eos_token_id` (int or list, all of them),
  else tokenizer_config.json's `eos_token`.
- Chat: the template (chat_template.jinja, else tokenizer_config.json's `chat_template`; of a
  list of named templates, `default`) rendered by `prefixcache_client.chat_template` with the
  special-token strings as variables; `chat_ids` encodes the rendered text without adding BOS
  (transformers' `apply_chat_template(tokenize=True)`: the template writes the BOS it wants).
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from prefixcache_client.chat_template import (ChatTemplateError, NoChatTemplate, TokenizerError,
                                              compile_template, render)

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS_MAP = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
BYTE_TOKENIZER_FILE = "prefixcache_byte_tokenizer.json"
# Files taken as they are, and files cut down to their token ids.
RAW_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, CHAT_TEMPLATE_FILE,
             BYTE_TOKENIZER_FILE)
ID_FILES = (CONFIG, GENERATION_CONFIG)
_ID_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id")
# Bumped whenever a rule above changes, so that older and newer code never claim to agree.
_FINGERPRINT_VERSION = b"prefixcache-tokenizer-v1"
# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")

__all__ = ["BYTE_TOKENIZER_FILE", "ByteTokenizer", "ChatTemplateError", "JsonTokenizer",
           "NoChatTemplate", "Tokenizer", "TokenizerError", "checkpoint_token_ids",
           "from_directory", "from_files", "has_tokenizer", "tokenizer_files"]


class Tokenizer(Protocol):
    """What the engine, the worker's server and the gateway use of a tokenizer."""
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    adds_bos: bool
    fingerprint: str
    files: Mapping[str, bytes]
    chat_template: str | None

    def encode(self, text: str, add_bos: bool = False) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_bytes(self, token_id: int) -> bytes: ...

    def text_prompt_ids(self, text: str) -> list[int]: ...

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str: ...

    def chat_ids(self, messages: Sequence[Mapping[str, Any]],
                 add_generation_prompt: bool = True,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]: ...


def fingerprint_of(files: Mapping[str, bytes], bos_rule: int | None) -> str:
    """See the module docstring; `bos_rule` is the BOS a text prompt starts with, or None."""
    h = hashlib.sha256(_FINGERPRINT_VERSION)
    for name in sorted(files):
        for part in (name.encode(), files[name]):
            h.update(len(part).to_bytes(8, "little") + part)
    h.update(b"bos:" + (b"none" if bos_rule is None else str(bos_rule).encode()))
    return h.hexdigest()


def _json(files: Mapping[str, bytes], name: str) -> dict[str, Any]:
    if name not in files:
        return {}
    try:
        value = json.loads(files[name])
    except (ValueError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{name}: not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise TokenizerError(f"{name}: must hold a JSON object")
    return value


def _ids_only(raw: bytes, name: str) -> bytes | None:
    """`name` (config.json, generation_config.json) cut down to its token ids, canonical."""
    ids = {k: v for k, v in _json({name: raw}, name).items() if k in _ID_KEYS and v is not None}
    return json.dumps(ids, sort_keys=True, separators=(",", ":")).encode() if ids else None


def _as_ids(value: Any, where: str) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [] if value is None else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(f"{where}: must be a token id or a list of them, got {value!r}")
    return tuple(values)


def checkpoint_token_ids(files: Mapping[str, bytes]) -> tuple[int | None, tuple[int, ...]]:
    """(BOS, EOS ids) of config.json and generation_config.json in `files` (see the rules)."""
    config, generation = _json(files, CONFIG), _json(files, GENERATION_CONFIG)
    bos = next((d["bos_token_id"] for d in (config, generation)
                if d.get("bos_token_id") is not None), None)
    if bos is not None:
        bos = next(iter(_as_ids(bos, f"{CONFIG} bos_token_id")), None)
    eos = (_as_ids(config.get("eos_token_id"), f"{CONFIG} eos_token_id")
           + _as_ids(generation.get("eos_token_id"), f"{GENERATION_CONFIG} eos_token_id"))
    return bos, tuple(dict.fromkeys(eos))


class _ChatMixin:
    """render_chat / chat_ids over `chat_template` and `special_tokens` (template variables)."""
    chat_template: str | None
    special_tokens: dict[str, str]
    _compiled: Any = None

    def render_chat(self, messages: Sequence[Mapping[str, Any]],
                    add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        """The chat as the checkpoint's template writes it (transformers'
        `apply_chat_template(messages, tools=..., tokenize=False, add_generation_prompt=...)`)."""
        if self.chat_template is None:
            raise NoChatTemplate("this tokenizer has no chat template (tokenizer_config.json "
                                 "chat_template or chat_template.jinja); send a plain prompt")
        if self._compiled is None:
            self._compiled = compile_template(self.chat_template)
        return render(self._compiled, messages, add_generation_prompt=add_generation_prompt,
                      variables=self.special_tokens, tools=tools)

    def chat_ids(self, messages: Sequence[Mapping[str, Any]],
                 add_generation_prompt: bool = True,
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
        """transformers' `apply_chat_template(messages, tools=..., tokenize=True)`: the rendered
        text encoded without post-processor and without a BOS of ours."""
        return self.encode(self.render_chat(messages, add_generation_prompt,  # type: ignore
                                            tools))

    def text_prompt_ids(self, text: str) -> list[int]:
        """The ids of a text prompt: `encode` with the BOS rule."""
        return self.encode(text, add_bos=self.adds_bos)  # type: ignore


class ByteTokenizer(_ChatMixin):
    """Ids 0-255 are the UTF-8 bytes of the text; 256 = <|pad|>, 257 = <|bos|>, 258 = <|eos|>.
    Text prompts start with BOS. No chat template. EOS is 258 unless `files` carry a
    checkpoint's eos ids (a checkpoint that names this tokenizer keeps its own EOS).

    decode() replaces an incomplete UTF-8 sequence with U+FFFD, so a streaming caller should
    decode the whole output and emit the new suffix once it no longer ends in a partial char.
    """

    PAD, BOS, EOS = 256, 257, 258
    SPECIAL_TOKENS = {PAD: "<|pad|>", BOS: "<|bos|>", EOS: "<|eos|>"}
    SPEC = json.dumps({"type": "prefixcache-byte", "version": 1, "pad": 256, "bos": 257,
                       "eos": 258, "vocab_size": 259}, sort_keys=True).encode()
    vocab_size = 259
    bos_token_id = BOS
    adds_bos = True
    chat_template = None

    def __init__(self, files: Mapping[str, bytes] | None = None) -> None:
        files = dict(files or {BYTE_TOKENIZER_FILE: self.SPEC})
        if files.get(BYTE_TOKENIZER_FILE) != self.SPEC:
            raise TokenizerError(f"{BYTE_TOKENIZER_FILE}: not this version's byte tokenizer "
                                 f"(expected {self.SPEC.decode()})")
        self.files = files
        self.eos_token_ids = checkpoint_token_ids(files)[1] or (self.EOS,)
        self.special_tokens = {"bos_token": "<|bos|>", "eos_token": "<|eos|>",
                               "pad_token": "<|pad|>"}
        self.fingerprint = fingerprint_of(files, self.BOS)

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

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes: one byte of the text, or a special token's string."""
        if 0 <= token_id < 256:
            return bytes([token_id])
        return self.SPECIAL_TOKENS.get(token_id, f"<|{token_id}|>").encode()


def _gpt2_byte_alphabet() -> dict[str, int]:
    """The printable character byte-level BPE writes for each byte (GPT-2's bytes_to_unicode),
    inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_UNICODE_TO_BYTE = _gpt2_byte_alphabet()


def _token_string(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_strings(config: dict[str, Any], special_map: dict[str, Any]) -> dict[str, str]:
    """The template variables transformers passes (`special_tokens_map`): the named special
    tokens and any other `*_token` string; special_tokens_map.json overrides only when
    tokenizer_config.json has no `added_tokens_decoder` (transformers' legacy path)."""
    sources = [config] + ([] if "added_tokens_decoder" in config else [special_map])
    out: dict[str, str] = {}
    for source in sources:
        extra = source.get("extra_special_tokens")
        items = list(source.items()) + (list(extra.items()) if isinstance(extra, dict) else [])
        for key, value in items:
            token = _token_string(value)
            if token is not None and (key in _NAMED_SPECIAL or key.endswith("_token")):
                out[key] = token
    return out


class JsonTokenizer(_ChatMixin):
    """A checkpoint's tokenizer.json (through the `tokenizers` package) with the rules of the
    module docstring. Build it with `from_files` or `from_directory`."""

    def __init__(self, files: Mapping[str, bytes]) -> None:
        from tokenizers import Tokenizer as _Backend  # imported with the first checkpoint

        self.files = dict(files)
        try:
            self._tok = _Backend.from_str(files[TOKENIZER_JSON].decode("utf-8"))
        except Exception as exc:  # tokenizers raises a bare Exception on a bad file
            raise TokenizerError(f"{TOKENIZER_JSON}: cannot be read: {exc}") from None
        config = _json(files, TOKENIZER_CONFIG)
        self.special_tokens = _special_strings(config, _json(files, SPECIAL_TOKENS_MAP))
        config_bos, eos = checkpoint_token_ids(files)
        prefix = self._post_processor_prefix()
        self.adds_bos = len(prefix) == 1
        bos = prefix[0] if self.adds_bos else self._token_id(self.special_tokens.get("bos_token"))
        bos = config_bos if bos is None else bos
        if not eos:
            eos_tok = self._token_id(self.special_tokens.get("eos_token"))
            eos = (eos_tok,) if eos_tok is not None else ()
        self.bos_token_id, self.eos_token_ids = bos, eos
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        self.chat_template = self._template(config)
        self.fingerprint = fingerprint_of(self.files, bos if self.adds_bos else None)
        spec = json.loads(files[TOKENIZER_JSON])
        self._byte_level = '"ByteLevel"' in json.dumps(spec.get("decoder"))
        self._added_ids = {t["id"] for t in spec.get("added_tokens") or ()}

    def _token_id(self, token: str | None) -> int | None:
        return self._tok.token_to_id(token) if token is not None else None

    def _post_processor_prefix(self) -> list[int]:
        """The ids tokenizer.json's post-processor puts before a text."""
        plain = self._tok.encode("a", add_special_tokens=False).ids
        full = self._tok.encode("a", add_special_tokens=True).ids
        return next((full[:k] for k in range(len(full) - len(plain) + 1)
                     if full[k:k + len(plain)] == plain), [])

    def _template(self, config: dict[str, Any]) -> str | None:
        if CHAT_TEMPLATE_FILE in self.files:
            return self.files[CHAT_TEMPLATE_FILE].decode("utf-8")
        template = config.get("chat_template")
        if isinstance(template, list):  # [{name, template}, ...]: the default one
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        return template if isinstance(template, str) else None

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_token_id] if add_bos and self.bos_token_id is not None else []) + ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, a part of a character included: a byte-level BPE piece
        mapped back through GPT-2's byte alphabet, a SentencePiece byte-fallback `<0xNN>`;
        any other token (an added token, a piece of another decoder) its decoded UTF-8."""
        piece = self._tok.id_to_token(token_id)
        if piece is None or token_id in self._added_ids:
            return self.decode([token_id], skip_special_tokens=False).encode()
        if self._byte_level and all(c in _UNICODE_TO_BYTE for c in piece):
            return bytes(_UNICODE_TO_BYTE[c] for c in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return self.decode([token_id], skip_special_tokens=False).encode()


def has_tokenizer(files: Mapping[str, bytes]) -> bool:
    """`files` hold a tokenizer (tokenizer.json or the byte tokenizer), not only token ids."""
    return TOKENIZER_JSON in files or BYTE_TOKENIZER_FILE in files


def _normalized(files: Mapping[str, bytes]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    for name, content in files.items():
        if name in ID_FILES:
            ids = _ids_only(bytes(content), name)
            if ids is not None:
                out[name] = ids
        elif name in RAW_FILES:
            out[name] = bytes(content)
        else:
            raise TokenizerError(f"files: {name!r} is not a tokenizer file "
                                 f"(known: {', '.join(RAW_FILES + ID_FILES)})")
    return out


def from_files(files: Mapping[str, bytes]) -> ByteTokenizer | JsonTokenizer:
    """The tokenizer of `files` (a `Tokenizer.files`, GetTokenizer's files, or a checkpoint's
    files by name); TokenizerError when they hold none or a file is bad."""
    files = _normalized(files)
    if BYTE_TOKENIZER_FILE in files:
        if TOKENIZER_JSON in files:
            raise TokenizerError(f"files: both {TOKENIZER_JSON} and {BYTE_TOKENIZER_FILE}")
        return ByteTokenizer(files)
    if TOKENIZER_JSON not in files:
        raise TokenizerError(f"files: no {TOKENIZER_JSON} (nor {BYTE_TOKENIZER_FILE})")
    return JsonTokenizer(files)


def tokenizer_files(path: str | Path) -> dict[str, bytes]:
    """The tokenizer files of checkpoint directory `path`, normalized (see the module
    docstring); without tokenizer.json they hold only the token ids of its configs."""
    path = Path(path)
    return _normalized({name: (path / name).read_bytes() for name in RAW_FILES + ID_FILES
                        if (path / name).is_file()})


def from_directory(path: str | Path) -> ByteTokenizer | JsonTokenizer:
    """The tokenizer of checkpoint directory `path`; FileNotFoundError when it has none."""
    files = tokenizer_files(path)
    if not has_tokenizer(files):
        raise FileNotFoundError(f"{path}: no {TOKENIZER_JSON} (nor {BYTE_TOKENIZER_FILE})")
    return from_files(files)
