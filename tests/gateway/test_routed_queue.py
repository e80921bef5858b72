"""A decision's record of the pages it routed is queued (gateway/core/routed_prefixes.py): every
read sees it applied, records apply in the order they came, the queue is bounded, and the
router's ingest applies the last decisions' records between decisions."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.policies.base import RouteRequest
from gateway.core.routed_prefixes import MAX_QUEUED, RoutedPrefixes
from gateway.core.router import Router, Worker
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.helpers import FakeClock, NoClient, batch, heartbeat, page, pages, stored
from tests.gateway.test_routed_prefixes import c_library, same  # noqa: F401 (the fixture)

READS = {
    "match": lambda r: r.match(pages(0, 4)),
    "extend": lambda r: r.extend("w", pages(0, 4), 0),
    "extend_many": lambda r: r.extend_many(["w", "v"], pages(0, 4), [0, 1]),
    "holders": lambda r: r.holders(page(0)),
    "size": lambda r: r.size("w"),
    "remembered": lambda r: r.remembered()[0],
}


@pytest.mark.parametrize("native", [True, False], ids=["c", "dicts"])
@pytest.mark.parametrize("read", sorted(READS))
def test_every_read_sees_the_records_queued_before_it(native, read):
    queued, applied = RoutedPrefixes(8, native=native), RoutedPrefixes(8, native=native)
    for routed in (queued, applied):
        routed.record("w", pages(0, 3))
        routed.record("v", pages(0, 2))
    applied.settle()
    assert queued.queued() == 2 and applied.queued() == 0
    assert READS[read](queued) == READS[read](applied)
    assert queued.queued() == 0


@pytest.mark.parametrize("native", [True, False], ids=["c", "dicts"])
def test_a_worker_removed_loses_what_was_queued_for_it(native):
    routed = RoutedPrefixes(8, native=native)
    routed.record("w", pages(0, 3))
    routed.remove_worker("w")
    assert routed.queued() == 0
    assert routed.size("w") == 0 and routed.match(pages(0, 3)) == {}


RECORDS = st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12), st.integers(1, 8)),
                   max_size=30)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 10), RECORDS)
def test_queued_records_leave_what_records_applied_one_by_one_leave(max_pages, records):
    """Evictions included: records past a worker's bound apply in the order they came."""
    queued, at_once = RoutedPrefixes(max_pages), RoutedPrefixes(max_pages)
    workers = [f"w{i}" for i in range(4)]
    for w, start, n in records:
        for routed in (queued, at_once):
            routed.record(workers[w], pages(start, start + n))
        at_once.settle()
    assert queued.queued() == min(len(records), MAX_QUEUED)
    same(queued, at_once, workers, [pages(0, 8), pages(4, 20), pages(12, 20), []])


def test_the_queue_holds_at_most_max_queued_records():
    routed = RoutedPrefixes(4)
    for i in range(MAX_QUEUED):
        routed.record("w", [page(i)])
    assert routed.queued() == MAX_QUEUED
    routed.record("w", [page(MAX_QUEUED)])  # one more applies them all
    assert routed.queued() == 0
    assert routed._pages.size(routed._slots["w"]) == 4


def test_a_record_keeps_the_pages_as_they_were_when_routed():
    routed, hashes = RoutedPrefixes(8), pages(0, 3)
    routed.record("w", hashes)
    hashes[1:] = pages(5, 7)  # a caller reusing its list
    assert routed.extend("w", pages(0, 3), 0) == 3


def test_ingest_applies_the_last_decisions_records_before_its_page_events():
    router = Router(make_policy("affinity"), GatewayMetrics(), clock=FakeClock())
    for name in ("a", "b"):
        router.add(Worker(name, name, name, NoClient(),  # type: ignore[arg-type]
                          pb.GetModelInfoResponse(worker=name)))
        router.on_stream_item(name, cpb.SubscribeResponse(batch=batch(name, 0, stored([page(99)]))))
    recent, rng = router.policy.recent, random.Random(0)
    for n in range(3):
        hashes = [page(rng.randrange(50)) for _ in range(4)]
        route = router.route(RouteRequest(f"r{n}", hashes, 4 * 16 + 1, 16))
        assert route is not None
        router.finish(f"r{n}")
    assert recent.queued() == 1  # each decision's read applied the one before it
    router.on_stream_item("a", cpb.SubscribeResponse(heartbeat=heartbeat("a", 0)))
    assert recent.queued() == 0
