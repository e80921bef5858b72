"""The page hash (docs/design.md §3): one chained SHA-256 that every service and language
recomputes.

    ns_seed         = SHA-256(b"prefixcache-ns-v1" || field(model) || field(adapter) || field(salt))[:16]
    field(s)        = u32_le(len(utf8(s))) || utf8(s)
    page_hash(p, t) = SHA-256(p || t_0 u32_le || ... || t_{P-1} u32_le)[:16]
    hash(page 0)    = page_hash(ns_seed, page 0);  hash(page i) = page_hash(hash(page i-1), page i)

Only full pages are hashed. A namespace field (model, adapter, salt) is at most MAX_NAME_BYTES
UTF-8 bytes: the cache service rejects a longer one, the gateway and the compute service check it
up front. Command line (one lower-case hex hash per full page, one per line):

    python -m prefixcache_client.hash --model M --adapter A --salt S --page-size P TOKEN...
"""
from __future__ import annotations

import argparse
import array
import hashlib
import struct
import sys
from collections.abc import Iterable, Sequence

import numpy as np

from prefixcache_client.limits import MAX_NAME_BYTES  # noqa: F401  (one set of limits)

HASH_BYTES = 16
NS_DOMAIN = b"prefixcache-ns-v1"
MAX_TOKEN_ID = 2**32 - 1

_sha256 = hashlib.sha256
# The array module's 4-byte unsigned type code on this platform ("I" nearly everywhere).
_U32 = next((code for code in "IL" if array.array(code).itemsize == 4), None)


def _field(text: str) -> bytes:
    data = text.encode("utf-8")
    return struct.pack("<I", len(data)) + data


def namespace_seed(model_id: str, adapter: str = "", salt: str = "") -> bytes:
    """The 16-byte parent hash of the first page of every prompt in this namespace."""
    return _sha256(NS_DOMAIN + _field(model_id) + _field(adapter) + _field(salt)).digest()[:HASH_BYTES]


def token_bytes(tokens: Sequence[int] | Iterable[int], field: str = "token_ids") -> bytes:
    """Tokens as u32 little-endian bytes. Raises ValueError naming `field` for an id outside u32.

    Two converters, each the faster one for its input (8k tokens): a Python list or tuple (a
    tokenizer's output) goes through the array module, ~4x faster than numpy there; anything else
    (a protobuf repeated field, a numpy array) through numpy, ~20x faster than the array module
    there. Both check every id (the array module raises on a negative, too large or
    non-integer one; numpy then names it)."""
    if isinstance(tokens, (list, tuple)) and _U32 is not None:
        try:
            packed = array.array(_U32, tokens)
        except (OverflowError, TypeError):
            pass  # a bad id: numpy below finds it and names it
        else:
            if sys.byteorder == "big":
                packed.byteswap()
            return packed.tobytes()
    ids = np.asarray(tokens if isinstance(tokens, Sequence) else list(tokens))
    if ids.size and (ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() > MAX_TOKEN_ID):
        bad = next((t for t in ids.tolist() if not isinstance(t, int) or not 0 <= t <= MAX_TOKEN_ID), None)
        raise ValueError(f"{field}: token id {bad!r} is outside [0, {MAX_TOKEN_ID}]")
    return ids.astype("<u4").tobytes()


def page_hash(parent: bytes, page: bytes) -> bytes:
    """Hash of one page given its parent's hash and its tokens as u32-le bytes."""
    return _sha256(parent + page).digest()[:HASH_BYTES]


def chain_hashes(parent: bytes, data: bytes, page_size: int) -> list[bytes]:
    """Hashes of every full page of `data` (u32-le token bytes), chained from `parent`."""
    stride = 4 * page_size
    hashes = []
    for start in range(0, len(data) - stride + 1, stride):
        parent = _sha256(parent + data[start:start + stride]).digest()[:HASH_BYTES]
        hashes.append(parent)
    return hashes


def prompt_hashes(tokens: Sequence[int], page_size: int, model_id: str, adapter: str = "",
                  salt: str = "") -> list[bytes]:
    """Hashes of every full page of a prompt in a namespace."""
    if page_size < 1:
        raise ValueError(f"page_size: must be >= 1, got {page_size}")
    return chain_hashes(namespace_seed(model_id, adapter, salt), token_bytes(tokens), page_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m prefixcache_client.hash",
        description="Print the page hash of every full page of TOKENs, one lower-case hex per line.")
    parser.add_argument("--model", required=True, help="model id")
    parser.add_argument("--adapter", default="", help='LoRA adapter name ("" = base model)')
    parser.add_argument("--salt", default="", help="tenant salt")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    parser.add_argument("tokens", nargs="*", type=int, metavar="TOKEN")
    args = parser.parse_args(argv)
    try:
        hashes = prompt_hashes(args.tokens, args.page_size, args.model, args.adapter, args.salt)
    except ValueError as exc:
        parser.error(str(exc))
    sys.stdout.write("".join(h.hex() + "\n" for h in hashes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
