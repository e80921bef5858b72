"""The cache service's side of writing L3 pages again (cache_service/l3_refill.py, issue 25,
finding 7): a worker's report of failed writes (`StepRequest.failed_remote_writes`) marks their
runs unwritten and lists them again once the store answered a check after the report, and not
before, nor twice; a store that lost its data has every resident run its policy wrote listed
again at the pool's next step, parents first and a bounded number of pages a step. The store is
a real redis-server watched by the real StoreWatch."""
from __future__ import annotations

import pytest
import redis

from cache_service import l3_refill
from cache_service.core import CacheCore
from cache_service.l3_loss import StoreWatch
from pagestore.client import L3Client, L3Config
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.errors import CacheError, ErrorCode
from prefixcache_client.hash import prompt_hashes
from tests.cache_service.test_core import MODEL, P, PROMPT
from tests.cache_service.test_l3 import remote_copies, worker

OTHER = [9] * 16  # 4 pages of another conversation
WRITE_THROUGH = pb.REMOTE_WRITE_POLICY_WRITE_THROUGH


@pytest.fixture
def watched(redis_server):
    """(a CacheCore whose L3 client carries a StoreWatch, the watch, a client of the Redis)."""
    l3 = L3Client(L3Config(redis_server.url, timeout_s=1.0, connect_timeout_s=1.0))
    watch = StoreWatch(l3)
    assert watch.check() is False  # armed
    return CacheCore(remote=l3), watch, redis.Redis.from_url(redis_server.url)


def written(resp: pb.StepResponse) -> list[bytes]:
    return [c.page_hash for c in remote_copies(resp)]


def test_failed_writes_are_listed_again_once_the_store_answers(watched):
    core, watch, _ = watched
    w = worker(core, remote_write_policy=WRITE_THROUGH)
    hashes = prompt_hashes(PROMPT, P, MODEL)[:4]
    w.run(PROMPT)
    assert w.stats().remote_writes == 4
    # The worker could not write pages 2 and 3 (its breaker was open): nothing is listed until
    # the store answered a check made after the report ...
    assert written(w.step(failed_remote_writes=hashes[2] + hashes[3])) == []
    assert written(w.step()) == []
    assert watch.check() is False
    # ... then the run holding them is written again, whole, once.
    assert written(w.step()) == hashes
    assert written(w.step()) == []
    assert w.stats().remote_writes == 8


def test_a_report_of_pages_no_longer_held_changes_nothing(watched):
    core, watch, _ = watched
    w = worker(core, remote_write_policy=WRITE_THROUGH)
    w.run(PROMPT)
    w.step(failed_remote_writes=bytes(16))  # a page this pool never held (or dropped since)
    assert watch.check() is False
    assert written(w.step()) == [] and w.stats().remote_writes == 4


def test_after_the_store_lost_its_data_every_resident_run_is_listed_again(watched):
    core, watch, store = watched
    w = worker(core, remote_write_policy=WRITE_THROUGH)
    w.run(PROMPT)
    w.run(OTHER)
    store.flushall()
    assert watch.check() is True
    # One step with nothing in it (the pool's worker serving other requests) lists both runs.
    again = written(w.step())
    assert sorted(again) == sorted(prompt_hashes(PROMPT, P, MODEL)[:4]
                                   + prompt_hashes(OTHER, P, MODEL))
    assert written(w.step()) == []  # once per loss


def test_a_refill_is_bounded_per_step_and_lists_parents_first(watched, monkeypatch):
    monkeypatch.setattr(l3_refill, "PAGES_PER_STEP", 2)
    core, watch, store = watched
    w = worker(core, remote_write_policy=WRITE_THROUGH)
    w.run(PROMPT[:8])  # a run of 2 pages ...
    w.run(PROMPT)  # ... and its child of 2 more
    store.flushall()
    assert watch.check() is True
    hashes = prompt_hashes(PROMPT, P, MODEL)[:4]
    assert written(w.step()) == hashes[:2]
    assert written(w.step()) == hashes[2:]
    assert written(w.step()) == []


@pytest.mark.parametrize("policy, min_hits, hits, expected", [
    (pb.REMOTE_WRITE_POLICY_HOT, 2, 2, 4),  # written when hot: written again
    (pb.REMOTE_WRITE_POLICY_HOT, 2, 1, 0),  # never written: not now either
    (pb.REMOTE_WRITE_POLICY_WRITE_BACK, 1, 0, 0),  # written when it leaves the worker
])
def test_a_refill_writes_what_the_policy_had_written(watched, policy, min_hits, hits, expected):
    core, watch, store = watched
    w = worker(core, remote_write_policy=policy, remote_min_hits=min_hits)
    w.run(PROMPT)
    for _ in range(hits):
        w.step(releases=[pb.ReleaseOp(lease_id=w.match(PROMPT).lease_id)])
    store.flushall()
    assert watch.check() is True
    assert len(written(w.step())) == expected


@pytest.mark.parametrize("data, why", [
    (bytes(15), "15 bytes is not a whole number of 16-byte page hashes"),
    (bytes(16 * 65537), "65537 page hashes exceed the limit of 65536 per step"),
])
def test_a_bad_report_is_refused_naming_the_field_with_nothing_applied(data, why):
    w = worker(remote_write_policy=WRITE_THROUGH)
    m = w.match(PROMPT)
    w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=5)])
    with pytest.raises(CacheError) as err:
        w.step(publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=4)],
               failed_remote_writes=data)
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    assert err.value.message == f"failed_remote_writes: {why}"
    assert w.stats().remote_writes == 0  # the publish in the same step was not applied
