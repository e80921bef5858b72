"""The L3 page payload: one self-describing, authenticated Redis value per page.

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

Invariant: `decode` returns tensors only for a payload that is whole, of this format, written
for exactly the expected page hash, Redis key and layout, and whose digest matches; with a MAC
key, only for a payload written with that same key (design.md §4, "Authenticated pages"): a
page forged by anyone who can write to Redis but lacks the key, written without a key, or
copied from another key is rejected. Anything else raises `PayloadRejected` with one of
REASONS, and the caller treats the page as a miss.

Without a MAC key the digest is a plain checksum: it catches corruption, not forgery (the
compute service warns at start: `event=l3_unauthenticated`).
"""
from __future__ import annotations

import hashlib
import hmac
import math
import struct
from dataclasses import dataclass

import torch

from compute_service.model import ModelConfig

MAGIC = b"PCKVPAGE"
FORMAT_VERSION = 2  # 2: the digest covers the Redis key and may be a keyed MAC (flag bit 1)
FLAG_CHECKPOINT = 1
FLAG_MAC = 2
HEADER = struct.Struct("<8sHHBBBB10I16sQ")
CHECKSUM_BYTES = 16
BODY_OFFSET = HEADER.size + CHECKSUM_BYTES  # 96
DTYPE_CODES = {torch.float32: 1, torch.float16: 2, torch.bfloat16: 3}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
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
class PageLayout:
    """Everything a payload must agree on with the model that loads it."""
    page_size: int
    kv_dtype: torch.dtype
    kv_heads: int
    head_dim: int
    attention_layers: int
    mamba_layers: int = 0
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    conv_dim: int = 0
    conv_width: int = 0  # conv kernel - 1: the conv state's last dimension
    ssm_dtype: torch.dtype | None = None
    conv_dtype: torch.dtype | None = None

    @classmethod
    def of_model(cls, cfg: ModelConfig, page_size: int, dtype: torch.dtype) -> PageLayout:
        """The layout of a model's KV pages and Mamba states (see `allocate_kv_caches` and
        `allocate_mamba_states`: the SSM state is always fp32, the conv state the model dtype)."""
        mamba = len(cfg.mamba_layer_ids)
        attn = len(cfg.attention_layer_ids)
        return cls(page_size, dtype, cfg.num_kv_heads if attn else 0, cfg.head_dim if attn else 0,
                   attn, mamba, *((cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size,
                                   cfg.mamba_conv_dim, cfg.mamba_conv_kernel - 1, torch.float32,
                                   dtype) if mamba else ()))

    @property
    def kv_shape(self) -> tuple[int, ...]:
        """One page's KV: [attention layers, 2 (K, V), page_size, kv heads, head dim]."""
        return (self.attention_layers, 2, self.page_size, self.kv_heads, self.head_dim)

    @property
    def ssm_shape(self) -> tuple[int, int, int]:
        return (self.mamba_heads, self.mamba_head_dim, self.mamba_state)

    @property
    def conv_shape(self) -> tuple[int, int]:
        return (self.conv_dim, self.conv_width)

    def kv_bytes(self) -> int:
        return math.prod(self.kv_shape) * _itemsize(self.kv_dtype)

    def checkpoint_bytes(self) -> int:
        if not self.mamba_layers:
            return 0
        return self.mamba_layers * (math.prod(self.ssm_shape) * _itemsize(self.ssm_dtype)
                                    + math.prod(self.conv_shape) * _itemsize(self.conv_dtype))

    def _fields(self) -> tuple[int, ...]:
        return (self.page_size, self.kv_heads, self.head_dim, self.attention_layers,
                self.mamba_layers, self.mamba_heads, self.mamba_head_dim, self.mamba_state,
                self.conv_dim, self.conv_width)

    def _codes(self) -> tuple[int, int, int]:
        return (DTYPE_CODES[self.kv_dtype], DTYPE_CODES.get(self.ssm_dtype, 0),
                DTYPE_CODES.get(self.conv_dtype, 0))


MambaStates = list[tuple[torch.Tensor, torch.Tensor]]  # per Mamba layer: (ssm, conv)


@dataclass(slots=True)
class PageData:
    """A decoded page: KV [attention layers, 2, page_size, kv heads, head dim] on the CPU, and
    the Mamba checkpoint after the page (per Mamba layer (ssm, conv)) or None."""
    page_hash: bytes
    kv: torch.Tensor
    mamba: MambaStates | None


def _digest(mac_key: bytes | None, context: bytes, header) -> hashlib.blake2b:
    """The digest over the Redis key and the header; the caller adds the body."""
    digest = hashlib.blake2b(key=mac_key or b"", digest_size=CHECKSUM_BYTES)
    digest.update(struct.pack("<H", len(context)))
    digest.update(context)
    digest.update(header)
    return digest


def encode(page_hash: bytes, layout: PageLayout, kv: torch.Tensor,
           mamba: MambaStates | None = None, *, mac_key: bytes | None = None,
           context: bytes = b"") -> bytes:
    """Serializes one page (CPU tensors of the layout's shapes and dtypes); `context` is the
    Redis key it is written under, `mac_key` the L3 MAC key (None: an unkeyed checksum)."""
    if len(page_hash) != 16:
        raise ValueError(f"page_hash: 16 bytes expected, got {len(page_hash)}")
    _check(kv, layout.kv_shape, layout.kv_dtype, "kv")
    parts = [_raw(kv)]
    if mamba is not None:
        if len(mamba) != layout.mamba_layers or not layout.mamba_layers:
            raise ValueError(f"mamba: {len(mamba)} layers for a layout of {layout.mamba_layers}")
        for ssm, conv in mamba:
            _check(ssm, layout.ssm_shape, layout.ssm_dtype, "ssm")
            _check(conv, layout.conv_shape, layout.conv_dtype, "conv")
        parts += [_raw(ssm) for ssm, _ in mamba] + [_raw(conv) for _, conv in mamba]
    body_len = sum(len(p) for p in parts)
    flags = (FLAG_CHECKPOINT if mamba is not None else 0) | (FLAG_MAC if mac_key else 0)
    header = HEADER.pack(MAGIC, FORMAT_VERSION, flags, *layout._codes(), 0, *layout._fields(),
                         page_hash, body_len)
    digest = _digest(mac_key, context, header)
    for part in parts:
        digest.update(part)
    return b"".join([header, digest.digest(), *parts])


def decode(payload: bytes, expected_hash: bytes, layout: PageLayout, *,
           mac_key: bytes | None = None, context: bytes = b"") -> PageData:
    """The page in `payload` stored under the Redis key `context`, or PayloadRejected (see the
    module invariant)."""
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
    if tuple(fields[:-2]) != layout._fields() or (kv_code, ssm_code, conv_code) != layout._codes():
        raise PayloadRejected("wrong_layout", f"fields {tuple(fields[:-2])} dtypes "
                              f"{(kv_code, ssm_code, conv_code)}, expected {layout._fields()} "
                              f"{layout._codes()}")
    expected_len = layout.kv_bytes() + (layout.checkpoint_bytes() if has_ckpt else 0)
    if body_len != expected_len or (has_ckpt and not layout.mamba_layers):
        raise PayloadRejected("wrong_layout", f"body of {body_len} bytes, expected {expected_len}")
    # One copy into memory torch owns (frombuffer on an immutable bytes object would alias it).
    body = torch.frombuffer(bytearray(view[BODY_OFFSET:]), dtype=torch.uint8) if body_len else \
        torch.empty(0, dtype=torch.uint8)
    kv_end = layout.kv_bytes()
    kv = body[:kv_end].view(layout.kv_dtype).view(layout.kv_shape)
    mamba = None
    if has_ckpt:
        ssm_bytes = math.prod(layout.ssm_shape) * _itemsize(layout.ssm_dtype)
        conv_bytes = math.prod(layout.conv_shape) * _itemsize(layout.conv_dtype)
        conv_start = kv_end + layout.mamba_layers * ssm_bytes
        mamba = [(body[kv_end + i * ssm_bytes:kv_end + (i + 1) * ssm_bytes]
                  .view(layout.ssm_dtype).view(layout.ssm_shape),
                  body[conv_start + i * conv_bytes:conv_start + (i + 1) * conv_bytes]
                  .view(layout.conv_dtype).view(layout.conv_shape))
                 for i in range(layout.mamba_layers)]
    return PageData(page_hash, kv, mamba)


def _check(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None, name: str) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor {shape} {dtype}, got {tuple(t.shape)} "
                         f"{t.dtype} on {t.device}")


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, without a copy when it is contiguous already."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _itemsize(dtype: torch.dtype | None) -> int:
    return dtype.itemsize if dtype is not None else 0
