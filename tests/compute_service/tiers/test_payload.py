"""The L3 page payload: exact round trips, and a typed rejection for every way a value can be
wrong (no Redis here; the engine-level consequences are in test_remote.py)."""
from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from compute_service.model import preset_config
from compute_service.tiers import FORMAT_VERSION, PageLayout, PayloadRejected, decode, encode
from pagestore.page_format import BODY_OFFSET, HEADER

HASH = bytes(range(16))
OTHER = bytes(range(1, 17))


def layout(name: str = "tiny-hybrid", dtype: torch.dtype = torch.float32) -> PageLayout:
    return PageLayout.of_model(preset_config(name), 4, dtype)


def random_page(lay: PageLayout, checkpoint: bool, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    kv = torch.randn(lay.kv_shape, generator=gen).to(lay.kv_dtype)
    mamba = None
    if checkpoint:
        mamba = [(torch.randn(lay.ssm_shape, generator=gen).to(lay.ssm_dtype),
                  torch.randn(lay.conv_shape, generator=gen).to(lay.conv_dtype))
                 for _ in range(lay.mamba_layers)]
    return kv, mamba


@pytest.mark.parametrize("name,dtype,checkpoint", [
    ("tiny-transformer", torch.float32, False),
    ("tiny-transformer", torch.bfloat16, False),
    ("tiny-hybrid", torch.float32, False),
    ("tiny-hybrid", torch.float32, True),
    ("tiny-hybrid", torch.float16, True),
    ("tiny-mamba2", torch.float32, True),
])
def test_round_trip_is_exact(name, dtype, checkpoint):
    lay = layout(name, dtype)
    kv, mamba = random_page(lay, checkpoint)
    payload = encode(HASH, lay, kv, mamba)
    body = lay.kv_bytes() + (lay.checkpoint_bytes() if checkpoint else 0)
    assert len(payload) == BODY_OFFSET + body
    page = decode(payload, HASH, lay)
    assert page.page_hash == HASH and torch.equal(page.kv, kv) and page.kv.dtype == dtype
    if not checkpoint:
        assert page.mamba is None
        return
    assert len(page.mamba) == lay.mamba_layers
    for (s, c), (s2, c2) in zip(mamba, page.mamba, strict=True):
        assert torch.equal(s, s2) and torch.equal(c, c2)
        assert s2.dtype == torch.float32 and c2.dtype == dtype


def test_encode_takes_non_contiguous_views():
    lay = layout()
    kv, _ = random_page(lay, False)
    wide = torch.stack([kv, kv], dim=2)[:, :, 1]  # a strided view, as the engine's gather gives
    assert not wide.is_contiguous()
    assert torch.equal(decode(encode(HASH, lay, wide), HASH, lay).kv, kv)


def _reencode(lay: PageLayout, kv: torch.Tensor, **changes) -> bytes:
    other = dataclasses.replace(lay, **changes)
    return encode(HASH, other, kv)


def _patch_version(payload: bytes, version: int) -> bytes:
    return payload[:8] + struct.pack("<H", version) + payload[10:]


GOOD_LAYOUT = layout()
GOOD_KV, GOOD_MAMBA = random_page(GOOD_LAYOUT, True)
GOOD = encode(HASH, GOOD_LAYOUT, GOOD_KV, GOOD_MAMBA)
L, _, P, H, D = GOOD_LAYOUT.kv_shape

CASES = {
    "corrupted body byte": ("corrupted", GOOD[:-5] + bytes([GOOD[-5] ^ 1]) + GOOD[-4:]),
    "corrupted header byte": ("corrupted", GOOD[:20] + bytes([GOOD[20] ^ 4]) + GOOD[21:]),
    "trailing bytes": ("corrupted", GOOD + b"\0"),
    "truncated body": ("truncated", GOOD[:-100]),
    "truncated header": ("truncated", GOOD[:40]),
    "empty": ("truncated", b""),
    "foreign magic": ("foreign_format", b"NOTAPAGE" + GOOD[8:]),
    "foreign short value": ("foreign_format", b"hello"),
    "old version": ("unsupported_version", _patch_version(GOOD, FORMAT_VERSION - 1)),
    "future version": ("unsupported_version", _patch_version(GOOD, FORMAT_VERSION + 1)),
    "wrong hash": ("wrong_hash", encode(OTHER, GOOD_LAYOUT, GOOD_KV, GOOD_MAMBA)),
    "fewer attention layers": ("wrong_layout", _reencode(GOOD_LAYOUT, GOOD_KV[:-1],
                                                         attention_layers=L - 1)),
    "other kv shape": ("wrong_layout", _reencode(
        GOOD_LAYOUT, GOOD_KV.reshape(L, 2, P, H * 2, D // 2), kv_heads=H * 2, head_dim=D // 2)),
    "other page size": ("wrong_layout", _reencode(GOOD_LAYOUT, torch.cat([GOOD_KV, GOOD_KV], 2),
                                                  page_size=2 * P)),
    "other dtype": ("wrong_layout", _reencode(GOOD_LAYOUT, GOOD_KV.half(), kv_dtype=torch.float16)),
    "other mamba layers": ("wrong_layout", encode(HASH, dataclasses.replace(
        GOOD_LAYOUT, mamba_layers=1), GOOD_KV, GOOD_MAMBA[:1])),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_bad_payload_is_rejected_with_its_reason(case):
    reason, payload = CASES[case]
    with pytest.raises(PayloadRejected) as err:
        decode(payload, HASH, GOOD_LAYOUT)
    assert err.value.reason == reason, err.value.detail


def test_a_transformer_payload_is_not_a_hybrid_page():
    lay = layout("tiny-transformer")
    kv, _ = random_page(lay, False)
    with pytest.raises(PayloadRejected) as err:
        decode(encode(HASH, lay, kv), HASH, GOOD_LAYOUT)
    assert err.value.reason == "wrong_layout"


def test_header_is_96_bytes_and_encode_checks_its_inputs():
    assert HEADER.size == 80 and BODY_OFFSET == 96 and GOOD[:8] == b"PCKVPAGE"
    with pytest.raises(ValueError, match="page_hash"):
        encode(b"short", GOOD_LAYOUT, GOOD_KV)
    with pytest.raises(ValueError, match="kv"):
        encode(HASH, GOOD_LAYOUT, GOOD_KV.half())
    with pytest.raises(ValueError, match="mamba"):
        encode(HASH, GOOD_LAYOUT, GOOD_KV, GOOD_MAMBA[:1])
