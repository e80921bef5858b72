"""The affinity policy's decision on the router's path (`choose(all_scores=False)`, scored on
arrays) equals the exhaustive one (`all_scores=True`, a WorkerScore per candidate, what
RoutePreview shows) on random fleets, indexes, loads and request sequences: near-ties and the
rotation that breaks them, holders kept against load, overloaded workers, stale load reports,
candidate subsets. Each test runs with the gateway's C library (the pick in C) and without it
(in numpy): affinity_arrays.py."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.index import KvIndex
from gateway.core.policies import AffinityConfig, AffinityPolicy, LoadTracker, RouteRequest
from prefixcache.v1 import common_pb2
from tests.gateway.helpers import DEVICE, HOST, FakeClock, batch, page, stored
from tests.gateway.index_impls import table_impl  # noqa: F401  (C pick, then numpy's)

PAGE = 16


def _fleet(seed: int):
    """One random fleet; the same seed builds an identical twin."""
    rng = random.Random(seed)
    clock = FakeClock()
    # Wide near-tie bands and idle fleets make ties (and the rotation) common.
    config = AffinityConfig(tie_abs_tokens=rng.choice([16.0, 200.0, 5000.0]),
                            recent_pages_per_worker=rng.choice([0, 4096]),
                            prefill_weight=rng.choice([1.0, 1.0, 0.7]))
    workers = [f"w{i:02d}" for i in range(rng.randrange(1, 25))]
    index, load, policy = KvIndex(clock=clock), LoadTracker(clock), AffinityPolicy(config)
    # the array path for any fleet (the router's: any in C, from 64 on in numpy)
    policy.array_min_candidates = 1
    busy = rng.random() < 0.7
    for w in workers:
        index.add_worker(w)
        events = [stored([page(i) for i in range(rng.randrange(10)) if rng.random() < 0.9], m)
                  for m in (DEVICE, HOST) if rng.random() < 0.4]
        if events:
            index.apply(batch(w, 0, *events))
        if busy:
            for r in range(rng.randrange(3)):
                load.on_route(w, f"{w}-{r}", rng.choice([0, 512, rng.randrange(20000)]))
                clock.now += rng.random() * 30  # loads decay apart
            if rng.random() < 0.5:
                load.report(w, common_pb2.LoadReport(queued_prefill_tokens=rng.randrange(30000),
                                                     running_requests=rng.randrange(4)))
    return rng, clock, workers, index, load, policy


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32))
def test_fast_decisions_equal_the_exhaustive_scoring(seed):
    rng, clock, workers, index, load, policy = _fleet(seed)
    _, twin_clock, _, twin_index, twin_load, twin = _fleet(seed)
    for n in range(12):
        candidates = (workers if rng.random() < 0.6
                      else sorted(rng.sample(workers, rng.randrange(1, len(workers) + 1))))
        hashes = [page(i) for i in range(rng.randrange(0, 12))]
        request = RouteRequest(f"q{n}", hashes, len(hashes) * PAGE + rng.randrange(1, 3000), PAGE)
        fast = policy.choose(request, candidates, index, load, all_scores=False)
        full = twin.choose(request, candidates, twin_index, twin_load, all_scores=True)
        assert (fast.worker, fast.reason, fast.prefill_tokens) == (full.worker, full.reason,
                                                                   full.prefill_tokens)
        assert fast.scores == [s for s in full.scores if s.worker == full.worker]
        assert policy._rr == twin._rr
        prefilled = rng.random() < 0.5
        for tracker in (load, twin_load):
            tracker.on_route(fast.worker, request.request_id, fast.prefill_tokens)
            if prefilled:
                tracker.on_first_token(request.request_id)
        for c in (clock, twin_clock):
            c.now += 3.0  # reports expire after 5 s
