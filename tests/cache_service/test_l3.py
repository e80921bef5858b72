"""L3 in the cache service: write policies as ordered copy instructions, the remote extension of
a match, and a Redis that is down, paused or failing (always a miss, never an error)."""
from __future__ import annotations

import time

import pytest

from cache_service.core import CacheCore
from pagestore.client import L3Client, L3Config
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2
from prefixcache_client.errors import CacheError, ErrorCode
from prefixcache_client.hash import prompt_hashes
from tests.cache_service.test_core import MODEL, P, PROMPT, Worker

REMOTE = common_pb2.MEDIUM_REMOTE


def worker(core=None, **register) -> Worker:
    w = Worker.__new__(Worker)
    w.core, w.pool = core or CacheCore(), "w"
    fields = dict(pool_id="w", epoch=1, page_size=P, device_pages=32, model_id=MODEL)
    fields.update(register)
    w.core.register_pool(pb.RegisterPoolRequest(**fields))
    return w


def remote_copies(resp: pb.StepResponse) -> list[common_pb2.CopyOp]:
    return [c for c in resp.copies if c.dst_medium == REMOTE]


def test_write_through_writes_each_published_page_once():
    w = worker(remote_write_policy=pb.REMOTE_WRITE_POLICY_WRITE_THROUGH)
    m = w.match(PROMPT)
    w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=5)])
    resp = w.step(publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=4)])
    writes = remote_copies(resp)
    assert [c.page_hash for c in writes] == prompt_hashes(PROMPT, P, MODEL)[:4]
    assert [c.src_page for c in writes] == list(range(4)) and all(c.mamba_slot == -1 for c in writes)
    w.step(releases=[pb.ReleaseOp(lease_id=m.lease_id)])
    again = w.match(PROMPT)
    b = w.step(allocations=[pb.AllocateOp(lease_id=again.lease_id, num_pages=1)],
               publishes=[pb.PublishOp(lease_id=again.lease_id, computed_pages=4)])
    assert not remote_copies(b)  # duplicates are not written again
    assert w.stats().remote_writes == 4


def test_write_back_writes_a_page_before_its_memory_is_reused():
    w = worker(device_pages=5, host_pages=4, remote_write_policy=pb.REMOTE_WRITE_POLICY_WRITE_BACK)
    w.run(PROMPT)  # 4 pages cached on device
    resp_a = w.step(matches=[pb.MatchOp(token_ids=[7] * 21)])  # fills the device: demotes to host
    lease = resp_a.matches[0].lease_id
    demote = w.step(allocations=[pb.AllocateOp(lease_id=lease, num_pages=5)])
    assert not remote_copies(demote)  # demotion keeps the page: nothing to write yet
    w.step(publishes=[pb.PublishOp(lease_id=lease, computed_pages=5)],
           releases=[pb.ReleaseOp(lease_id=lease)])
    # Now host must make room: replaying the copies in order over the pages' contents, every L3
    # write must read the bytes of the page it names (written before its memory is reused).
    from cache_service.tree import subtree
    pool = w.core._pools["w"]
    holds = {(n.medium, n.page): n.hash for r in pool.roots.values() for n in subtree(r)}
    m = w.match([9] * 21)
    resp = w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=5)])
    writes = 0
    for c in resp.copies:
        if c.dst_medium == REMOTE:
            assert holds[(c.src_medium, c.src_page)] == c.page_hash
            writes += 1
        else:
            holds[(c.dst_medium, c.dst_page)] = holds[(c.src_medium, c.src_page)]
    assert writes >= 1


def test_hot_policy_writes_after_min_hits():
    w = worker(remote_write_policy=pb.REMOTE_WRITE_POLICY_HOT, remote_min_hits=2)
    w.run(PROMPT)
    first = w.step(matches=[pb.MatchOp(token_ids=PROMPT)])
    assert not remote_copies(first)
    second = w.step(matches=[pb.MatchOp(token_ids=PROMPT)])
    assert len(remote_copies(second)) == 4


def test_remote_lookup_needs_an_l3():
    with pytest.raises(CacheError) as err:
        worker(remote_lookup=True)
    assert err.value.code == ErrorCode.FAILED_PRECONDITION and "remote_lookup" in err.value.message


def test_match_extends_into_l3_with_allocated_pages(redis_server):
    l3 = L3Client(L3Config(redis_server.url))
    hashes = prompt_hashes(PROMPT, P, MODEL)
    assert l3.set_many(MODEL, [(h, b"payload") for h in hashes[:3]])
    w = worker(CacheCore(remote=l3), remote_lookup=True)
    w.run(PROMPT[:9])  # the first 2 pages are on the device already
    m = w.match(PROMPT)
    assert m.cached_tokens == 8 and m.remote_hit_tokens == 4  # page 2 only: page 3 is not in L3
    assert list(m.remote_page_hashes) == hashes[2:3] and len(m.remote_pages) == 1
    assert m.remote_pages[0] not in m.device_pages
    # The worker loads it and publishes it like a computed page.
    w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=2)],
           publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=3)])
    assert w.stats().hit_tokens_remote == 8 + 4  # the first run's match found 2 pages in L3 too
    assert w.match(PROMPT).cached_tokens == 12


def test_a_dead_or_paused_redis_is_a_bounded_miss_and_the_breaker_recovers(redis_server):
    l3 = L3Client(L3Config(redis_server.url, timeout_s=0.1, connect_timeout_s=0.1,
                           failure_threshold=2, reset_after_s=0.3))
    hashes = prompt_hashes(PROMPT, P, MODEL)
    assert l3.set_many(MODEL, [(h, b"x") for h in hashes])
    w = worker(CacheCore(remote=l3), remote_lookup=True)
    assert w.match(PROMPT).remote_hit_tokens == 16
    redis_server.pause()
    try:
        for _ in range(3):
            start = time.monotonic()
            m = w.match(PROMPT)  # never an error: a miss, within the timeout
            assert m.remote_hit_tokens == 0
            assert time.monotonic() - start < 0.5
        assert l3.breaker.state == "open" and l3.counters.calls["skipped_breaker_open"] >= 1
    finally:
        redis_server.resume()
    time.sleep(0.35)  # half-open: one trial call goes through, succeeds, closes the breaker
    assert w.match(PROMPT).remote_hit_tokens == 16
    assert l3.breaker.state == "closed"
    redis_server.stop()
    assert w.match(PROMPT).remote_hit_tokens == 0
    assert l3.counters.calls["errors"] + l3.counters.calls["timeouts"] >= 1


def test_write_through_copies_carry_the_checkpoint_attached_in_the_same_step():
    w = worker(mamba_slots=2, remote_write_policy=pb.REMOTE_WRITE_POLICY_WRITE_THROUGH)
    m = w.match(PROMPT)
    w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=5)])
    resp = w.step(publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=4)],
                  checkpoints=[pb.CheckpointOp(lease_id=m.lease_id, page_index=3)])
    slots = [c.mamba_slot for c in remote_copies(resp)]
    assert slots == [-1, -1, -1, resp.checkpoints[0].slot] and slots[-1] >= 0
