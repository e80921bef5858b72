"""L3 across workers: worker A writes pages to Redis under each write policy, worker B (another
cache service, same Redis) loads them instead of computing, with output identical to a cold
run; and every invalid payload is rejected, deleted, counted and computed instead."""
from __future__ import annotations

import dataclasses
import struct

import pytest
import torch

from compute_service.tiers import FORMAT_VERSION, PageLayout, decode, encode
from prefixcache_client.hash import prompt_hashes
from tests.compute_service.hf_families import HF_FAMILIES
from tests.compute_service.tiers.helpers import (PAGE, PROMPT, ProbeAll, generate, l3_client,
                                                 model, prompt_of, reference)

FAMILIES = ["tiny-transformer", "tiny-hybrid"]
# L3 round trip of the transformers-checked families: the first test only (the others exercise
# the tier, not the model).
WITH_HF = [*FAMILIES, *HF_FAMILIES]


def layout(name: str) -> PageLayout:
    return PageLayout.of_model(model(name).config, PAGE, model(name).dtype)


def hashes(name: str, prompt: list[int] = PROMPT) -> list[bytes]:
    return prompt_hashes(prompt, PAGE, name)


def key(l3, name: str, page_hash: bytes) -> str:
    return l3.key(name, page_hash)


@pytest.mark.parametrize("name", WITH_HF)
def test_worker_b_loads_what_worker_a_wrote_through(redis_server, workers, name):
    l3 = l3_client(redis_server.url)
    a = workers(name, l3, l3_write_policy="write-through")
    cold, sa = generate(a, PROMPT)
    assert cold == reference(name, tuple(PROMPT)) and sa.cached_tokens_remote == 0
    assert a.flush_l3()
    # Every published page is in L3, with its Mamba checkpoint for the models with Mamba2 layers.
    for h in hashes(name):
        k = key(l3, name, h)
        page = decode(l3.redis.get(k), h, layout(name), context=k.encode())
        assert (page.mamba is not None) == bool(model(name).config.mamba_layer_ids)
    b = workers(name, l3, lookup=True)
    toks, sb = generate(b, PROMPT)
    assert toks == cold
    assert sb.cached_tokens_remote == 32 and sb.cached_tokens_device == 0
    assert sb.computed_prompt_tokens == 1  # only the last token: its logits start decoding
    m = b.tier_metrics()
    assert m["l3_load_pages_ok"] == 8 and m["l3_loads"] == 1
    assert b.stats.remote_loaded_tokens == 32
    # The loaded pages were published on B: a third request hits B's device cache.
    again, sc = generate(b, PROMPT)
    assert again == cold and sc.cached_tokens_device == 32 and sc.cached_tokens_remote == 0


@pytest.mark.parametrize("name", FAMILIES)
def test_a_device_prefix_extended_from_l3(redis_server, workers, name):
    """B holds the first 4 pages (loaded from L3 by a shorter prompt, then published with their
    checkpoints); the full prompt hits them on the device and loads the next 4 from L3."""
    l3 = l3_client(redis_server.url)
    a = workers(name, l3, l3_write_policy="write-through")
    cold = generate(a, PROMPT)[0]
    assert a.flush_l3()
    b = workers(name, l3, lookup=True)
    short, s1 = generate(b, PROMPT[:17])
    assert short == reference(name, tuple(PROMPT[:17])) and s1.cached_tokens_remote == 16
    toks, s2 = generate(b, PROMPT)
    assert toks == cold
    assert (s2.cached_tokens_device, s2.cached_tokens_remote, s2.computed_prompt_tokens) == (16, 16, 1)


def test_loads_are_batched_and_stop_at_a_batch_that_returns_nothing(redis_server, workers):
    name = "tiny-transformer"
    l3 = l3_client(redis_server.url)
    a = workers(name, l3, l3_write_policy="write-through")
    cold = generate(a, PROMPT)[0]
    assert a.flush_l3()
    b = workers(name, l3_client(redis_server.url), lookup=True, l3_batch_pages=3)
    toks, s = generate(b, PROMPT)
    assert toks == cold and s.cached_tokens_remote == 32
    assert b.tier_metrics()["l3_client_get_pages"] == 8  # MGETs of 3, 3 and 2 pages
    # Pages 3-5 gone (as after an eviction): the second batch is empty, the third is not asked.
    for h in hashes(name)[3:6]:
        l3.redis.delete(key(l3, name, h))
    c = workers(name, l3_client(redis_server.url), lookup=True, l3_batch_pages=3,
                probe=ProbeAll())
    toks, s = generate(c, PROMPT)
    assert toks == cold and s.cached_tokens_remote == 12
    assert c.tier_metrics()["l3_client_get_pages"] == 6


@pytest.mark.parametrize("name", FAMILIES)
def test_write_back_writes_pages_when_they_leave_the_worker(redis_server, workers, name):
    l3 = l3_client(redis_server.url)
    a = workers(name, l3, l3_write_policy="write-back", device_pages=10)
    cold = generate(a, PROMPT)[0]
    assert a.flush_l3() and l3.redis.dbsize() == 0  # still on the device: nothing written
    generate(a, prompt_of(7, 36))  # needs all 10 pages: every page of PROMPT is dropped
    assert a.flush_l3()
    assert all(l3.redis.exists(key(l3, name, h)) for h in hashes(name))
    b = workers(name, l3, lookup=True)
    toks, sb = generate(b, PROMPT)
    assert toks == cold == reference(name, tuple(PROMPT))
    assert sb.cached_tokens_remote == 32


def test_hot_policy_writes_pages_once_hit_enough(redis_server, workers):
    name = "tiny-transformer"
    l3 = l3_client(redis_server.url)
    a = workers(name, l3, l3_write_policy="hot", l3_min_hits=2)
    for _ in range(2):  # computed, then hit once
        generate(a, PROMPT)
        assert a.flush_l3() and l3.redis.dbsize() == 0
    generate(a, PROMPT)  # hit twice: hot
    assert a.flush_l3()
    # The 8 prompt pages every match hit; not the page holding output tokens, never hit.
    assert all(l3.redis.exists(key(l3, name, h)) for h in hashes(name)) and l3.redis.dbsize() == 8
    assert a.tier_metrics()["l3_write_pages_ok"] == 8


def _patch_version(payload: bytes) -> bytes:
    return payload[:8] + struct.pack("<H", FORMAT_VERSION - 1) + payload[10:]


def _reencode(name: str, payload: bytes, h: bytes, **changes) -> bytes:
    """The same page written by a worker whose model has another layout."""
    lay = layout(name)
    context = f"pc:{name}:{h.hex()}".encode()
    page = decode(payload, h, lay, context=context)
    kv = page.kv
    if "attention_layers" in changes:
        kv = kv[:-1]
    if "kv_heads" in changes:
        kv = kv.reshape(*kv.shape[:3], changes["kv_heads"], -1)
    if "kv_dtype" in changes:
        kv = kv.to(changes["kv_dtype"])
    return encode(h, dataclasses.replace(lay, **changes), kv, page.mamba, context=context)


def _mutate(case: str, name: str, payload: bytes, h: bytes, next_payload: bytes) -> bytes:
    lay = layout(name)
    match case:
        case "corrupted":
            return payload[:-3] + bytes([payload[-3] ^ 0x10]) + payload[-2:]
        case "truncated":
            return payload[:len(payload) // 2]
        case "foreign_magic":
            return b"GARBAGE!" + payload[8:]
        case "old_version":
            return _patch_version(payload)
        case "wrong_hash":
            return next_payload  # another page's value under this page's key
        case "wrong_layer_count":
            return _reencode(name, payload, h, attention_layers=lay.attention_layers - 1)
        case "wrong_shape":
            return _reencode(name, payload, h, kv_heads=lay.kv_heads * 2,
                             head_dim=lay.head_dim // 2)
        case "wrong_dtype":
            return _reencode(name, payload, h, kv_dtype=torch.float16)
    raise AssertionError(case)


REASON = {"corrupted": "corrupted", "truncated": "truncated", "foreign_magic": "foreign_format",
          "old_version": "unsupported_version", "wrong_hash": "wrong_hash",
          "wrong_layer_count": "wrong_layout", "wrong_shape": "wrong_layout",
          "wrong_dtype": "wrong_layout"}


@pytest.mark.parametrize("name,case", [("tiny-transformer", c) for c in REASON]
                         + [("tiny-hybrid", "corrupted"), ("tiny-hybrid", "wrong_dtype")])
def test_a_bad_payload_is_rejected_deleted_counted_and_computed(redis_server, workers, name, case):
    l3 = l3_client(redis_server.url)
    a = workers(name, l3, l3_write_policy="write-through")
    cold = generate(a, PROMPT)[0]
    assert a.flush_l3()
    hs = hashes(name)
    bad = key(l3, name, hs[3])
    l3.redis.set(bad, _mutate(case, name, l3.redis.get(bad), hs[3],
                              l3.redis.get(key(l3, name, hs[4]))))
    b = workers(name, l3, lookup=True)
    toks, sb = generate(b, PROMPT)
    assert toks == cold == reference(name, tuple(PROMPT))
    # Pages 0-2 were loaded; page 3 was rejected, so it and every later page were computed.
    assert sb.cached_tokens_remote == 12 and sb.computed_prompt_tokens == len(PROMPT) - 12
    assert b.flush_l3()
    assert not l3.redis.exists(bad) and all(l3.redis.exists(key(l3, name, h)) for h in hs[:3])
    m = b.tier_metrics()
    assert m[f"l3_rejected_{REASON[case]}"] == 1
    assert sum(v for k, v in m.items() if k.startswith("l3_rejected_")) == 1
    assert m["l3_deletes"] == 1 and m["l3_load_pages_ok"] == 3 and m["l3_load_pages_skipped"] == 4


def test_the_engine_refuses_an_l3_policy_without_a_client(workers):
    with pytest.raises(ValueError, match="^l3"):
        workers("tiny-transformer", l3_write_policy="write-through")
    with pytest.raises(ValueError, match="^l3_write_policy"):
        workers("tiny-transformer", l3_client("redis://127.0.0.1:1/0"), l3_write_policy="always")


def test_redis_keys_are_the_contract_keys(redis_server, workers):
    """`<prefix>:<model id>:<page hash hex>`, so any worker of the model finds them."""
    l3 = l3_client(redis_server.url)
    a = workers("tiny-transformer", l3, l3_write_policy="write-through")
    out = generate(a, PROMPT)[0]
    assert a.flush_l3()
    keys = {k.decode() for k in l3.redis.keys("*")}
    # Prompt and output: the page completed by generated tokens is published and written too.
    written = hashes("tiny-transformer", PROMPT + out)
    assert len(written) == 9 and {f"pc:tiny-transformer:{h.hex()}" for h in written} == keys
