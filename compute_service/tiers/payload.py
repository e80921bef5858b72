"""L3 pages as tensors: the layout of a model's KV pages and Mamba states (`PageLayout`), and
`encode` / `decode` between a page's CPU tensors and its payload. The payload's bytes, digest and
MAC are pagestore.page_format's (torch-free, shared with the page store): this module supplies
the body and views the decoded body as tensors.

Invariant: `decode` returns tensors only for a payload that pagestore.page_format.open_payload
accepts for exactly the expected page hash, Redis key and layout (design.md §4, "Authenticated
pages"); anything else raises `PayloadRejected` with one of REASONS, and the caller treats the
page as a miss.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from compute_service.model import ModelConfig
from pagestore.page_format import (BODY_OFFSET, DTYPE_CODES as CODES_BY_NAME, FORMAT_VERSION,
                                   HEADER, REASONS, PageFormat, PayloadRejected, open_payload,
                                   seal)

__all__ = ["BODY_OFFSET", "DTYPE_CODES", "FORMAT_VERSION", "HEADER", "REASONS", "MambaStates",
           "PageData", "PageLayout", "PayloadRejected", "decode", "encode"]

# torch dtypes by their code in the payload header (pagestore.page_format.DTYPE_CODES).
DTYPE_CODES = {getattr(torch, name): code for name, code in CODES_BY_NAME.items()}
DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


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
    _format: PageFormat | None = field(default=None, init=False, repr=False, compare=False)

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
    def format(self) -> PageFormat:
        """What the payload header says for this layout (made once: every encode and decode
        uses it)."""
        if self._format is None:
            object.__setattr__(self, "_format", PageFormat(self._fields(), self._codes(),
                                                           self.kv_bytes(),
                                                           self.checkpoint_bytes()))
        return self._format

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
    return seal(page_hash, layout.format, parts, checkpoint=mamba is not None, mac_key=mac_key,
                context=context)


def decode(payload: bytes, expected_hash: bytes, layout: PageLayout, *,
           mac_key: bytes | None = None, context: bytes = b"") -> PageData:
    """The page in `payload` stored under the Redis key `context`, or PayloadRejected (see the
    module invariant)."""
    has_ckpt, view = open_payload(payload, expected_hash, layout.format, mac_key=mac_key,
                                  context=context)
    # One copy into memory torch owns (frombuffer on an immutable bytes object would alias it).
    body = torch.frombuffer(bytearray(view), dtype=torch.uint8) if len(view) else \
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
    return PageData(page_hash=expected_hash, kv=kv, mamba=mamba)


def _check(t: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype | None, name: str) -> None:
    if tuple(t.shape) != shape or t.dtype != dtype or t.device.type != "cpu":
        raise ValueError(f"{name}: expected a CPU tensor {shape} {dtype}, got {tuple(t.shape)} "
                         f"{t.dtype} on {t.device}")


def _raw(t: torch.Tensor) -> memoryview:
    """The tensor's bytes in C order, without a copy when it is contiguous already."""
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _itemsize(dtype: torch.dtype | None) -> int:
    return dtype.itemsize if dtype is not None else 0
