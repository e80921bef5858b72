"""The L3 page payload: one self-describing, authenticated Redis value per page. Bytes only (no
torch): the compute service turns tensors into the body and back (compute_service.tiers.payload).

Byte layout (little-endian; the magic and the version keep their offsets in every version):

    offset size  field
         0    8  magic b"PCKVPAGE"
         8    2  u16 format version (FORMAT_VERSION)
        10    2  u16 flags: bit 0 = a Mamba checkpoint follows the KV; bit 1 = the digest is a
                 keyed MAC (written with an L3 MAC key)
        12    1  u8 KV dtype code (DTYPE_CODES); 13: u8 SSM-state dtype code; 14: u8 conv-state
                 dtype code (0 when the model has no Mamba layers); 15: reserved, 0
        16   40  u32 x 10: page_size, kv heads, head dim, attention layers, Mamba layers,
                 Mamba heads, Mamba head dim, Mamba state size, conv dim, conv width - 1
        56   16  page hash (design.md §3)
        72    8  u64 body length in bytes
        80   16  BLAKE2b-128, keyed with the L3 MAC key when there is one (flag bit 1), over
                 the u16 length and bytes of the Redis key the page is stored under, bytes
                 [0, 80) and the body
        96       body: for each attention layer (model order) K then V, each [page_size, kv heads,
                 head dim] C-order in the KV dtype; then, when flag bit 0 is set, the SSM state of
                 every Mamba layer ([heads, head dim, state], SSM dtype), then the conv state of
                 every Mamba layer ([conv dim, conv width - 1], conv dtype). All SSM states come
                 before all conv states so that every tensor starts aligned to its element size.

Invariant: `open_payload` returns a body only for a payload that is whole, of this format,
written for exactly the expected page hash, Redis key and page format, and whose digest
matches; with a MAC key, only for a payload written with that same key (design.md §4,
"Authenticated pages"): a page forged by anyone who can write to Redis but lacks the key,
written without a key, or copied from another key is rejected. Anything else raises
`PayloadRejected` with one of REASONS, and the caller treats the page as a miss.

Without a MAC key the digest is a plain checksum: it catches corruption, not forgery (the
compute service warns at start: `event=l3_unauthenticated`).
"""
from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"PCKVPAGE"
FORMAT_VERSION = 2  # 2: the digest covers the Redis key and may be a keyed MAC (flag bit 1)
FLAG_CHECKPOINT = 1
FLAG_MAC = 2
HEADER = struct.Struct("<8sHHBBBB10I16sQ")
CHECKSUM_BYTES = 16
BODY_OFFSET = HEADER.size + CHECKSUM_BYTES  # 96
# Element types by name (torch's dtype names without "torch."); 0 = none.
DTYPE_CODES = {"float32": 1, "float16": 2, "bfloat16": 3}
# bad_mac: the MAC does not match (forged, written with another key, copied from another Redis
# key, or corrupted); unauthenticated: a payload without a MAC read with a key; unverifiable: a
# payload with a MAC read without a key.
REASONS = ("truncated", "foreign_format", "unsupported_version", "corrupted", "wrong_hash",
           "wrong_layout", "bad_mac", "unauthenticated", "unverifiable")


class PayloadRejected(Exception):
    """A payload that must not be loaded; `reason` is one of REASONS (a metric label)."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail


@dataclass(slots=True, frozen=True)
class PageFormat:
    """What a payload's header must say for the model that loads it: the ten u32 fields and the
    three dtype codes of the layout above, and the body's size without and with a checkpoint."""
    fields: tuple[int, ...]
    codes: tuple[int, int, int]
    kv_bytes: int
    checkpoint_bytes: int

    @property
    def mamba_layers(self) -> int:
        return self.fields[4]


def _digest(mac_key: bytes | None, context: bytes, header) -> hashlib.blake2b:
    """The digest over the Redis key and the header; the caller adds the body."""
    digest = hashlib.blake2b(key=mac_key or b"", digest_size=CHECKSUM_BYTES)
    digest.update(struct.pack("<H", len(context)))
    digest.update(context)
    digest.update(header)
    return digest


def seal(page_hash: bytes, fmt: PageFormat, parts: Sequence, *, checkpoint: bool,
         mac_key: bytes | None = None, context: bytes = b"") -> bytes:
    """The payload of a body given as `parts` (buffers, in body order; `checkpoint`: they hold
    the Mamba checkpoint too); `context` is the Redis key it is written under, `mac_key` the L3
    MAC key (None: an unkeyed checksum)."""
    if len(page_hash) != 16:
        raise ValueError(f"page_hash: 16 bytes expected, got {len(page_hash)}")
    body_len = sum(len(p) for p in parts)
    flags = (FLAG_CHECKPOINT if checkpoint else 0) | (FLAG_MAC if mac_key else 0)
    header = HEADER.pack(MAGIC, FORMAT_VERSION, flags, *fmt.codes, 0, *fmt.fields,
                         page_hash, body_len)
    digest = _digest(mac_key, context, header)
    for part in parts:
        digest.update(part)
    return b"".join([header, digest.digest(), *parts])


def open_payload(payload: bytes, expected_hash: bytes, fmt: PageFormat, *,
                 mac_key: bytes | None = None, context: bytes = b"") -> tuple[bool, memoryview]:
    """(whether it holds a checkpoint, its body) of the payload stored under the Redis key
    `context`, or PayloadRejected (see the module invariant)."""
    if len(payload) < BODY_OFFSET:
        if payload[:len(MAGIC)] != MAGIC[:len(payload)]:
            raise PayloadRejected("foreign_format", "bad magic")
        raise PayloadRejected("truncated", f"{len(payload)} bytes, shorter than the header")
    (magic, version, flags, kv_code, ssm_code, conv_code, _, *fields) = HEADER.unpack_from(payload)
    page_hash, body_len = fields[-2], fields[-1]
    if magic != MAGIC:
        raise PayloadRejected("foreign_format", "bad magic")
    if version != FORMAT_VERSION:
        raise PayloadRejected("unsupported_version", f"format {version}, expected {FORMAT_VERSION}")
    if len(payload) - BODY_OFFSET < body_len:
        raise PayloadRejected("truncated", f"body of {len(payload) - BODY_OFFSET} bytes, header "
                                           f"says {body_len}")
    if len(payload) - BODY_OFFSET > body_len:
        raise PayloadRejected("corrupted", "bytes after the body")
    # Any failed check rejects the page; the order only picks the reason reported. The page
    # hash first: another page's value under this key is named as such, keyed or not.
    if page_hash != expected_hash:
        raise PayloadRejected("wrong_hash", f"payload of page {page_hash.hex()}, expected "
                                            f"{expected_hash.hex()}")
    keyed = bool(flags & FLAG_MAC)
    if mac_key and not keyed:
        raise PayloadRejected("unauthenticated", "written without an L3 MAC key")
    if keyed and not mac_key:
        raise PayloadRejected("unverifiable", "written with an L3 MAC key; this reader has none")
    view = memoryview(payload)
    digest = _digest(mac_key, context, view[:HEADER.size])
    digest.update(view[BODY_OFFSET:])
    if not hmac.compare_digest(digest.digest(), payload[HEADER.size:BODY_OFFSET]):
        if keyed:
            raise PayloadRejected("bad_mac", "MAC mismatch: forged, written with another key, "
                                             "copied from another Redis key, or corrupted")
        raise PayloadRejected("corrupted", "checksum mismatch")
    has_ckpt = bool(flags & FLAG_CHECKPOINT)
    if tuple(fields[:-2]) != fmt.fields or (kv_code, ssm_code, conv_code) != fmt.codes:
        raise PayloadRejected("wrong_layout", f"fields {tuple(fields[:-2])} dtypes "
                              f"{(kv_code, ssm_code, conv_code)}, expected {fmt.fields} "
                              f"{fmt.codes}")
    expected_len = fmt.kv_bytes + (fmt.checkpoint_bytes if has_ckpt else 0)
    if body_len != expected_len or (has_ckpt and not fmt.mamba_layers):
        raise PayloadRejected("wrong_layout", f"body of {body_len} bytes, expected {expected_len}")
    return has_ckpt, view[BODY_OFFSET:]
