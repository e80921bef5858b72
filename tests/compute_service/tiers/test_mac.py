"""Authenticated L3 pages (design.md §4): anyone who can write to Redis but lacks the MAC key
cannot change a worker's output. Every page of a prompt is forged with a valid format (as in
issue 16, where 25/25 forged pages changed the greedy output): written with another key, with
no key, or copied from another Redis key, each is rejected, counted under its reason, and the
reader's output is the cold one."""
from __future__ import annotations

import pytest
import torch

from compute_service.tiers import PayloadRejected, decode, encode
from prefixcache_client.hash import prompt_hashes
from tests.compute_service.tiers.helpers import PAGE, PROMPT, generate, l3_client, reference
from tests.compute_service.tiers.test_remote import layout

NAME = "tiny-transformer"
KEY = b"k" * 32
OTHER_KEY = b"x" * 32


def keyed(url: str, key: bytes | None, **overrides):
    client = l3_client(url, timeout_s=1.0, **overrides)
    client.cfg.mac_key = key
    return client


def forge_every_page(l3, name: str, attacker_key: bytes | None, prefix: str = "pc") -> int:
    """Rewrites every page of PROMPT in Redis with valid-format, shifted KV (what changes the
    output when accepted), digested with `attacker_key` under the page's own Redis key."""
    lay = layout(name)
    n = 0
    for h in prompt_hashes(PROMPT, PAGE, name):
        k = f"{prefix}:{name}:{h.hex()}"
        kv = torch.full(lay.kv_shape, 3.0, dtype=lay.kv_dtype)
        l3.redis.set(k, encode(h, lay, kv, mac_key=attacker_key, context=k.encode()))
        n += 1
    return n


def test_a_forged_page_is_accepted_without_a_key_so_the_key_matters(redis_server, workers):
    """The threat itself: without a MAC key, forged pages with a valid checksum change the
    greedy output (why the manifests always set a key)."""
    l3 = keyed(redis_server.url, None)
    assert forge_every_page(l3, NAME, None) == 8
    toks, s = generate(workers(NAME, l3, lookup=True), PROMPT)
    assert s.cached_tokens_remote == 32 and toks != reference(NAME, tuple(PROMPT))


@pytest.mark.parametrize("attacker_key,reason", [(OTHER_KEY, "bad_mac"),
                                                 (None, "unauthenticated")])
def test_pages_forged_without_the_key_are_misses_and_the_output_is_cold(
        redis_server, workers, attacker_key, reason):
    l3 = keyed(redis_server.url, KEY)
    a = workers(NAME, l3, l3_write_policy="write-through")
    cold, _ = generate(a, PROMPT)
    assert a.flush_l3()
    forged = forge_every_page(l3, NAME, attacker_key)
    b = workers(NAME, keyed(redis_server.url, KEY), lookup=True)
    toks, s = generate(b, PROMPT)
    assert toks == cold == reference(NAME, tuple(PROMPT))
    assert s.cached_tokens_remote == 0 and s.computed_prompt_tokens == len(PROMPT)
    m = b.tier_metrics()
    assert m[f"l3_rejected_{reason}"] == 1  # the first page ends the prefix; it is deleted
    assert m["l3_load_pages_ok"] == 0 and forged == 8


def test_pages_written_with_the_key_are_loaded(redis_server, workers):
    a = workers(NAME, keyed(redis_server.url, KEY), l3_write_policy="write-through")
    cold, _ = generate(a, PROMPT)
    assert a.flush_l3()
    b = workers(NAME, keyed(redis_server.url, KEY), lookup=True)
    toks, s = generate(b, PROMPT)
    assert toks == cold and s.cached_tokens_remote == 32
    assert sum(v for k, v in b.tier_metrics().items() if k.startswith("l3_rejected_")) == 0


def test_a_valid_page_copied_to_another_key_is_refused(redis_server, workers):
    """Keyed pages of the same model under the prefix "pc", copied byte for byte under the
    prefix "other" (same page hash): the MAC binds the Redis key, so they are refused."""
    a = workers(NAME, keyed(redis_server.url, KEY), l3_write_policy="write-through")
    cold, _ = generate(a, PROMPT)
    assert a.flush_l3()
    l3 = a.l3.client
    for h in prompt_hashes(PROMPT, PAGE, NAME):
        l3.redis.set(f"other:{NAME}:{h.hex()}", l3.redis.get(l3.key(NAME, h)))
    b = workers(NAME, keyed(redis_server.url, KEY, prefix="other"), lookup=True)
    toks, s = generate(b, PROMPT)
    assert toks == cold and s.cached_tokens_remote == 0
    assert b.tier_metrics()["l3_rejected_bad_mac"] == 1


def test_a_reader_without_the_key_refuses_keyed_pages(redis_server, workers):
    a = workers(NAME, keyed(redis_server.url, KEY), l3_write_policy="write-through")
    cold, _ = generate(a, PROMPT)
    assert a.flush_l3()
    b = workers(NAME, keyed(redis_server.url, None), lookup=True)
    toks, s = generate(b, PROMPT)
    assert toks == cold and s.cached_tokens_remote == 0
    assert b.tier_metrics()["l3_rejected_unverifiable"] == 1


def test_payload_mac_cases():
    lay = layout(NAME)
    h, ctx = bytes(range(16)), b"pc:m:00"
    kv = torch.randn(lay.kv_shape, generator=torch.Generator().manual_seed(0))
    good = encode(h, lay, kv, mac_key=KEY, context=ctx)
    assert torch.equal(decode(good, h, lay, mac_key=KEY, context=ctx).kv, kv)
    cases = {"bad_mac": [(good, dict(mac_key=OTHER_KEY, context=ctx)),
                         (good, dict(mac_key=KEY, context=b"pc:m:01")),
                         (good[:-1] + bytes([good[-1] ^ 1]), dict(mac_key=KEY, context=ctx))],
             "unauthenticated": [(encode(h, lay, kv, context=ctx), dict(mac_key=KEY, context=ctx))],
             "unverifiable": [(good, dict(context=ctx))]}
    for reason, payloads in cases.items():
        for payload, kw in payloads:
            with pytest.raises(PayloadRejected) as err:
                decode(payload, h, lay, **kw)
            assert err.value.reason == reason
