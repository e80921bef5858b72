"""The attacks of issue 16 on a cache service, each tried against a real server on loopback with
service authentication on (service_shell/auth.py, cache_service/access.py): each must be refused
with the right code, and the victim (worker-1's pool, holding tenant alice's cached prompt) must
be intact afterwards. Test ids named test_attack_* are the attacks counted in the closing table.
"""
from __future__ import annotations

import contextlib
import os
import time

import grpc
import pytest

from cache_service.access import CacheLimits
from prefixcache.v1 import cache_service_pb2 as pb
from service_shell.auth import ServiceIdentities
from tests.cache_service.grpc_harness import running_server, stub_for
from tests.security.harness import (DENIED, DEVICE_PAGES, PAGE, TOKENS, UNAUTHENTICATED,
                                    UNKNOWN_TOKEN, VICTIM_POOL, VICTIM_PROMPT, VICTIM_SALT,
                                    cache_prompt, namespace, refused, register, secure_cache,
                                    write_identities)

CACHED_PAGES = (len(VICTIM_PROMPT) - 1) // PAGE  # 23
INVALID = grpc.StatusCode.INVALID_ARGUMENT


@pytest.fixture
def cache(tmp_path):
    with secure_cache(tmp_path) as cache:
        yield cache


def device(stats: pb.PoolStats) -> pb.MediumStats:
    return stats.media[0]


def assert_victim_intact(cache, before: pb.PoolStats) -> None:
    """The victim's pool: same epoch, same cached pages, no lease anyone else took, and its
    worker still steps it (a match finds the whole cached prefix)."""
    after = cache.victim_stats()
    assert cache.victim_info().epoch == 1
    assert device(after).cached_pages == device(before).cached_pages == CACHED_PAGES
    assert device(after).used_pages == device(before).used_pages
    assert after.active_leases == 0
    with cache.stub(TOKENS["worker-1"]) as worker:
        resp = worker.Step(pb.StepRequest(pool_id=VICTIM_POOL, epoch=1, matches=[pb.MatchOp(
            request_id="check", namespace=namespace(), token_ids=VICTIM_PROMPT)]), timeout=10)
        assert resp.matches[0].cached_tokens == CACHED_PAGES * PAGE
        worker.Step(pb.StepRequest(pool_id=VICTIM_POOL, epoch=1, releases=[
            pb.ReleaseOp(lease_id=resp.matches[0].lease_id)]), timeout=10)


def test_attack_subscribe_streams_every_tenants_token_ids(cache):
    """Subscribe without credentials streamed every tenant's token ids (a confidential prompt
    read back from the events)."""
    before = cache.victim_stats()
    request = pb.SubscribeRequest(pool_id=VICTIM_POOL, after_seq=-1)
    for token in (None, UNKNOWN_TOKEN):
        with cache.stub(token) as stub:
            refused(lambda: stub.Subscribe(request, timeout=5), UNAUTHENTICATED)
    for token in (TOKENS["worker-1"], TOKENS["worker-2"]):  # workers do not read event streams
        with cache.stub(token) as stub:
            assert "may not call" in refused(lambda: stub.Subscribe(request, timeout=5), DENIED)
    # The gateway still reads it: the snapshot holds alice's prompt, which is why it is guarded.
    with cache.stub(TOKENS["gateway"]) as stub:
        stored = []
        for item in stub.Subscribe(request, timeout=5):
            stored += [e.stored for e in item.batch.events if e.HasField("stored")]
            if item.batch.snapshot_end:
                break
        assert [t for s in stored for t in s.token_ids] == VICTIM_PROMPT[:CACHED_PAGES * PAGE]
    assert cache.refusals("Subscribe", "missing_credentials") == 1
    assert cache.refusals("Subscribe", "unknown_token") == 1
    assert cache.refusals("Subscribe", "role") == 2
    assert_victim_intact(cache, before)


def test_attack_step_with_a_known_salt_reads_the_tenants_cached_prefix(cache):
    """A direct Step with a tenant's salt got its 368-token cached prefix; the salt was the only
    secret."""
    before = cache.victim_stats()
    step = pb.StepRequest(pool_id=VICTIM_POOL, epoch=1, matches=[pb.MatchOp(
        request_id="probe", namespace=namespace(VICTIM_SALT), token_ids=VICTIM_PROMPT)])
    for token in (None, UNKNOWN_TOKEN):
        with cache.stub(token) as stub:
            refused(lambda: stub.Step(step, timeout=5), UNAUTHENTICATED)
    with cache.stub(TOKENS["worker-2"]) as stub:  # another worker: not its pool
        assert "may not use pool 'worker-1'" in refused(lambda: stub.Step(step, timeout=5), DENIED)
    for role in ("gateway", "subscriber", "operator"):  # only a worker steps, and only its own
        with cache.stub(TOKENS[role]) as stub:
            refused(lambda: stub.Step(step, timeout=5), DENIED)
    assert cache.victim_stats().queried_tokens == before.queried_tokens  # no match ever ran
    assert_victim_intact(cache, before)


def test_attack_evict_namespace_of_every_pool_and_salt(cache):
    """EvictNamespace (all pools, all salts) emptied every cache."""
    before = cache.victim_stats()
    evict = pb.EvictNamespaceRequest(namespace=namespace(""), all_salts=True)
    for token in (None, UNKNOWN_TOKEN):
        with cache.stub(token) as stub:
            refused(lambda: stub.EvictNamespace(evict, timeout=5), UNAUTHENTICATED)
    for role in ("gateway", "subscriber"):
        with cache.stub(TOKENS[role]) as stub:
            refused(lambda: stub.EvictNamespace(evict, timeout=5), DENIED)
    with cache.stub(TOKENS["worker-1"]) as stub:  # even its own worker: not every pool
        assert "only in its own pool" in refused(lambda: stub.EvictNamespace(evict, timeout=5),
                                                 DENIED)
    with cache.stub(TOKENS["worker-2"]) as stub:
        mine = pb.EvictNamespaceRequest(pool_id=VICTIM_POOL, namespace=namespace(VICTIM_SALT))
        refused(lambda: stub.EvictNamespace(mine, timeout=5), DENIED)
    assert_victim_intact(cache, before)
    with cache.stub(TOKENS["operator"]) as stub:  # the operator's call it is
        assert stub.EvictNamespace(evict, timeout=5).removed_pages == CACHED_PAGES


def test_attack_register_pool_resets_a_workers_pool(cache):
    """RegisterPool under a new epoch reset a worker's pool (its cache, its leases)."""
    before = cache.victim_stats()
    for token in (None, UNKNOWN_TOKEN):
        with cache.stub(token) as stub:
            refused(lambda: register(stub, epoch=2), UNAUTHENTICATED)
    for role in ("gateway", "subscriber", "worker-2"):
        with cache.stub(TOKENS[role]) as stub:
            refused(lambda: register(stub, epoch=2), DENIED)
    assert_victim_intact(cache, before)


def test_attack_register_pool_by_another_unrestricted_worker(tmp_path):
    """A worker identity without a `pools` restriction still cannot take a pool another worker
    registered: the registering identity owns it."""
    extra = [{"name": "roaming", "role": "worker", "token": "roaming-worker-token-0123"}]
    with secure_cache(tmp_path, auth=ServiceIdentities.from_file(
            write_identities(tmp_path, extra))) as cache:
        before = cache.victim_stats()
        with cache.stub("roaming-worker-token-0123") as stub:
            assert "belongs to identity 'worker-1'" in refused(lambda: register(stub, epoch=2),
                                                               DENIED)
            step = pb.StepRequest(pool_id=VICTIM_POOL, epoch=1)
            refused(lambda: stub.Step(step, timeout=5), DENIED)
            register(stub, pool_id="roaming-pool")  # a pool of its own is fine
        assert cache.refusals("RegisterPool", "pool_owner") == 1
        assert_victim_intact(cache, before)


def test_attack_unregister_pool_removes_a_workers_pool(cache):
    """UnregisterPool dropped a live worker's pool."""
    before = cache.victim_stats()
    unregister = pb.UnregisterPoolRequest(pool_id=VICTIM_POOL)
    for token in (None, UNKNOWN_TOKEN):
        with cache.stub(token) as stub:
            refused(lambda: stub.UnregisterPool(unregister, timeout=5), UNAUTHENTICATED)
    for role in ("gateway", "subscriber", "worker-2"):
        with cache.stub(TOKENS[role]) as stub:
            refused(lambda: stub.UnregisterPool(unregister, timeout=5), DENIED)
    assert_victim_intact(cache, before)


def test_attack_step_allocating_every_page_of_a_worker(cache):
    """A Step allocating all 512 pages of a worker made its next request time out."""
    before = cache.victim_stats()
    probe = pb.StepRequest(pool_id=VICTIM_POOL, epoch=1, matches=[pb.MatchOp(
        request_id="hog", token_ids=list(range(DEVICE_PAGES * PAGE + 1)))])
    for token in (None, UNKNOWN_TOKEN):
        with cache.stub(token) as stub:
            refused(lambda: stub.Step(probe, timeout=5), UNAUTHENTICATED)
    with cache.stub(TOKENS["worker-2"]) as stub:
        refused(lambda: stub.Step(probe, timeout=5), DENIED)
    assert device(cache.victim_stats()).free_pages == device(before).free_pages
    started = time.monotonic()
    with cache.stub(TOKENS["worker-1"]) as worker:  # the worker's next request is served now
        cache_prompt(worker, [5000 + i for i in range(4 * PAGE + 1)], salt="salt-of-bob")
    assert time.monotonic() - started < 5
    assert device(cache.victim_stats()).cached_pages == CACHED_PAGES + 4


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("auth", ["on", "off"])
def test_attack_register_pool_with_50M_device_pages(tmp_path, auth):
    """RegisterPool with device_pages 50M took 2 GB of the cache service's memory, and 2^32-1
    answered INTERNAL. The limit holds whoever calls (here the pool's own worker), auth on or
    off."""
    limits = CacheLimits(max_pool_pages=1 << 20)
    with contextlib.ExitStack() as stack:
        if auth == "on":
            cache = stack.enter_context(secure_cache(tmp_path, limits=limits))
            server, stub = cache.server, stack.enter_context(cache.stub(TOKENS["worker-1"]))
        else:
            server = stack.enter_context(running_server(limits=limits))
            stub = stack.enter_context(stub_for(server))
        rss = _rss_bytes()
        for field, value in (("device_pages", 50_000_000), ("device_pages", 2**32 - 1),
                             ("host_pages", 2**32 - 1), ("mamba_slots", 2**32 - 1)):
            message = refused(lambda: register(stub, epoch=2, **{field: value}), INVALID)
            assert message.startswith(f"{field}: must be <= 1048576"), message
            assert "--max-pool-pages" in message
        ttl = refused(lambda: register(stub, epoch=2, lease_ttl_s=1e9), INVALID)
        assert ttl.startswith("lease_ttl_s: must be <= 600")
        assert _rss_bytes() - rss < 200 << 20  # nothing near the 2 GB the issue measured
        pools = {p.pool_id: p for p in server.core.list_pools(pb.ListPoolsRequest()).pools}
        if auth == "on":
            assert pools[VICTIM_POOL].epoch == 1
            assert_victim_intact(cache, cache.victim_stats())
        else:
            assert VICTIM_POOL not in pools


def test_attack_a_lease_that_never_expires_pins_pages(cache):
    """A match asking for a huge lease TTL would pin the matched pages long after its caller
    vanished; the TTL is bounded (--max-lease-ttl-s)."""
    before = cache.victim_stats()
    with cache.stub(TOKENS["worker-1"]) as worker:
        hog = pb.StepRequest(pool_id=VICTIM_POOL, epoch=1, matches=[pb.MatchOp(
            request_id="pin", namespace=namespace(), token_ids=VICTIM_PROMPT, lease_ttl_s=1e7)])
        assert refused(lambda: worker.Step(hog, timeout=5), INVALID).startswith(
            "matches[0].lease_ttl_s: must be <= 300")
    assert cache.refusals("Step", "limit") == 1
    assert_victim_intact(cache, before)


def test_control_without_auth_the_same_probes_succeed(tmp_path):
    """The negative control: the same server without an identities file (the CLI's default)
    lets an anonymous caller read alice's prompt back, match her prefix with her salt and evict
    it: what the attacks above must be refused, and proof that they test something."""
    with secure_cache(tmp_path, auth=None) as cache:
        with cache.stub(None) as anonymous:
            first = next(iter(anonymous.Subscribe(
                pb.SubscribeRequest(pool_id=VICTIM_POOL, after_seq=-1), timeout=5)))
            assert any(e.HasField("stored") for e in first.batch.events)
            match = anonymous.Step(pb.StepRequest(pool_id=VICTIM_POOL, epoch=1, matches=[
                pb.MatchOp(request_id="probe", namespace=namespace(VICTIM_SALT),
                           token_ids=VICTIM_PROMPT)]), timeout=5).matches[0]
            assert match.cached_tokens == CACHED_PAGES * PAGE == 368
            evicted = anonymous.EvictNamespace(pb.EvictNamespaceRequest(
                namespace=namespace(""), all_salts=True), timeout=5)
            assert evicted.removed_pages + evicted.deferred_pages == CACHED_PAGES
