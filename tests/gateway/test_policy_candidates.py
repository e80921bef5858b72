"""The affinity policy's shortcuts equal the full scans they replace, on random states: recent
pages are extended only for the workers the index matches or that remember the first page, and
the candidates' loads are read in one pass."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.index import KvIndex, PrefixMatch
from gateway.core.policies import AffinityPolicy, LoadTracker, RouteRequest
from prefixcache.v1 import common_pb2
from tests.gateway.helpers import DEVICE, HOST, REMOTE, FakeClock, batch, page, stored

PAGE = 16


def _full_scan_matches(policy: AffinityPolicy, request: RouteRequest, candidates: list[str],
                       index: KvIndex) -> dict[str, PrefixMatch]:
    """The loop over every candidate that `_matches` replaced."""
    matches = index.lookup(request.page_hashes)
    hashes = request.page_hashes
    for worker in candidates:
        m = matches.get(worker)
        start = m.device_pages if m is not None else 0
        end = policy.recent.extend(worker, hashes, start)
        if end == start:
            continue
        if m is None:
            matches[worker] = PrefixMatch(end, 0, 0, 1.0)
        else:
            host_end = max(m.device_pages + m.host_pages, end)
            rem_end = max(m.device_pages + m.host_pages + m.remote_pages, host_end)
            matches[worker] = PrefixMatch(end, host_end - end, rem_end - host_end, m.confidence)
    return matches


def _random_state(rng: random.Random):
    clock = FakeClock()
    workers = [f"w{i}" for i in range(rng.randrange(1, 30))]
    index, load, policy = KvIndex(clock=clock), LoadTracker(clock), AffinityPolicy()
    for w in workers:
        index.add_worker(w)
        events = [stored([page(i) for i in range(rng.randrange(10)) if rng.random() < 0.9], m)
                  for m in (DEVICE, HOST, REMOTE) if rng.random() < 0.4]
        if events:
            index.apply(batch(w, 0, *events))
        if rng.random() < 0.3:
            policy.recent.record(w, [page(i) for i in range(rng.randrange(12))])
        for r in range(rng.randrange(3)):
            load.on_route(w, f"{w}-{r}", rng.randrange(2000))
            clock.now += rng.random() * 30  # loads decay apart
        if rng.random() < 0.5:
            load.report(w, common_pb2.LoadReport(queued_prefill_tokens=rng.randrange(5000),
                                                 running_requests=rng.randrange(4)))
    return workers, index, load, policy


@settings(max_examples=80, deadline=None)
@given(st.integers(0, 2**32))
def test_matches_and_loads_equal_the_full_scan(seed):
    rng = random.Random(seed)
    workers, index, load, policy = _random_state(rng)
    candidates = sorted(rng.sample(workers, rng.randrange(1, len(workers) + 1)))
    hashes = [page(i) for i in range(rng.randrange(1, 12))]
    request = RouteRequest("r", hashes, len(hashes) * PAGE + 5, PAGE)
    assert policy._matches(request, candidates, index) == _full_scan_matches(policy, request, candidates, index)
    assert load.get_many(candidates) == [load.get(w) for w in candidates]
    decision = policy.preview(request, candidates, index, load)
    assert decision.worker in candidates and len(decision.scores) == len(candidates)


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**32))
def test_the_loads_of_a_kept_candidate_tuple_follow_workers_that_join_and_leave(seed):
    """LoadTracker keeps a copy of the rows of the tuple it was last asked for (the router's
    candidate set): every write (a route, a report, a first token, a finish), a worker given its
    first row, or removed, must show in the next read; and no write of a worker outside it
    (the table grows past its first 8 rows on the way)."""
    rng = random.Random(seed)
    clock = FakeClock()
    load = LoadTracker(clock)
    everyone = [f"w{i}" for i in range(rng.randrange(1, 24))]
    workers = tuple(rng.sample(everyone, rng.randrange(1, len(everyone) + 1)))
    for n in range(40):
        worker, op = rng.choice(everyone), rng.random()
        if op < 0.4:
            load.on_route(worker, f"r{n}", rng.randrange(2000))
        elif op < 0.6:
            load.report(worker, common_pb2.LoadReport(queued_prefill_tokens=rng.randrange(5000)))
        elif op < 0.7:
            load.remove_worker(worker)
        elif op < 0.85:
            load.on_first_token(f"r{rng.randrange(n + 1)}")
        else:
            load.on_finish(f"r{rng.randrange(n + 1)}")
        clock.now += rng.random() * 3
        assert load.get_many(workers) == [load.get(w) for w in workers]
