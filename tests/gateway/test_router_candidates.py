"""The router keeps its candidate set between decisions (issue 31: no loop over every worker per
decision); on random sequences of joins, departures, probes, stream items, streams going live
and ending, stale streams and clock steps, the kept set equals the one the full scan over every
worker gives, and a router that keeps it routes as one that scans every time."""
from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import AffinityPolicy
from gateway.core.policies.base import RouteRequest
from gateway.core.router import Router, Worker
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import common_pb2
from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.helpers import FakeClock, NoClient, batch, heartbeat, page, stored

FINGERPRINTS = ("tok-a", "tok-b")


def _full_scan(router: Router, exclude, fingerprint: str) -> tuple[list[str], bool]:
    """The candidate set as `Router._candidates` computed it on every decision before it kept
    one: a pass over every worker."""
    now = router._clock()
    usable = [w for n, w in sorted(router._workers.items()) if n not in exclude and (
        not fingerprint or w.info.tokenizer_fingerprint == fingerprint)]
    eligible = [w for w in usable if w.up and (w.synced or w.streaming)
                and (t := router.index.last_seen(w.name)) is not None
                and max(0.0, now - t) <= router.index.config.dead_after_s]
    if any(w.synced for w in eligible):
        return [w.name for w in eligible], False
    return [w.name for w in usable if w.up], True


class _Fleet:
    """A router and the stream position of each of its workers."""

    def __init__(self, clock: FakeClock, keep: bool) -> None:
        policy = AffinityPolicy()
        policy.array_min_candidates = 1  # the array path, whose per-candidate arrays are kept
        self.router = Router(policy, GatewayMetrics(), clock=clock)
        if not keep:  # the twin that scans every worker on every decision
            sets = self.router._candidate_sets
            sets._kept = lambda *args: None  # type: ignore[method-assign]
        self.seq: dict[str, int] = {}

    def step(self, rng: random.Random, op: str, name: str) -> None:
        router = self.router
        if op == "add" and name not in self.seq:
            info = pb.GetModelInfoResponse(worker=name, tokenizer_fingerprint=rng.choice(FINGERPRINTS))
            router.add(Worker(name, name, name, NoClient(), info))  # type: ignore[arg-type]
            self.seq[name] = 0
        elif op == "remove" and name in self.seq:
            router.remove(name)
            del self.seq[name]
        elif op == "up" and name in self.seq:
            router.set_up(name, rng.random() < 0.6)
        elif op == "batch" and name in self.seq:
            seq = self.seq[name] + (rng.random() < 0.15)  # a gap now and then: a resync
            item = cpb.SubscribeResponse(batch=batch(name, seq, stored([page(rng.randrange(20))])))
            if router.on_stream_item(name, item).status.name == "APPLIED":
                self.seq[name] = seq + 1
        elif op == "stream" and name in self.seq:  # its feed's call delivers, or ended
            router.set_streaming(name, rng.random() < 0.6)
        elif op == "heartbeat" and name in self.seq:
            hb = heartbeat(name, self.seq[name] - 1)
            hb.load.CopyFrom(common_pb2.LoadReport(queued_prefill_tokens=rng.randrange(3000)))
            router.on_stream_item(name, cpb.SubscribeResponse(heartbeat=hb))


OPS = ("add", "remove", "up", "batch", "batch", "stream", "heartbeat", "heartbeat", "clock",
       "route")


@settings(max_examples=120, deadline=None)
@given(st.integers(0, 2**32))
def test_the_kept_candidate_set_equals_a_scan_of_every_worker(seed):
    rng = random.Random(seed)
    clock, twin_clock = FakeClock(), FakeClock()
    fleet, twin = _Fleet(clock, keep=True), _Fleet(twin_clock, keep=False)
    names = [f"w{i}" for i in range(rng.randrange(1, 9))]
    for n in range(60):
        op, name = rng.choice(OPS), rng.choice(names)
        if op == "clock":
            step = rng.choice([0.5, 3.0, 12.0, 29.0, 31.0])  # dead_after_s is 30
            clock.now += step
            twin_clock.now += step
        elif op == "route":
            hashes = [page(rng.randrange(20)) for _ in range(rng.randrange(1, 4))]
            request = RouteRequest(f"r{n}", hashes, len(hashes) * 16 + 5, 16)
            kept, scanned = (f.router.route(request) for f in (fleet, twin))
            assert (kept and kept.worker.name) == (scanned and scanned.worker.name)
        else:
            state = rng.getstate()
            fleet.step(rng, op, name)
            rng.setstate(state)
            twin.step(rng, op, name)
        for fingerprint in ("", *FINGERPRINTS):
            exclude = set(rng.sample(names, rng.randrange(2)))
            for ex in ((), exclude):
                kept, blind = fleet.router._candidates(ex, fingerprint)
                assert (list(kept), blind) == _full_scan(fleet.router, ex, fingerprint)


def test_a_decision_reuses_the_kept_set_until_a_worker_goes_stale_or_comes_back():
    clock = FakeClock()
    fleet = _Fleet(clock, keep=True)
    rng = random.Random(0)
    for name in ("a", "b"):
        fleet.step(rng, "add", name)
        fleet.router.on_stream_item(name, cpb.SubscribeResponse(batch=batch(name, 0)))
    first = fleet.router._candidates(())[0]
    assert first == ("a", "b") and fleet.router._candidates(())[0] is first
    clock.now += 20
    fleet.router.on_stream_item("a", cpb.SubscribeResponse(heartbeat=heartbeat("a", 0)))
    assert fleet.router._candidates(())[0] is first  # a fresher event keeps the set
    clock.now += 15  # b's last event is 35 s old: stale
    assert fleet.router._candidates(())[0] == ("a",)
    fleet.router.on_stream_item("b", cpb.SubscribeResponse(heartbeat=heartbeat("b", 0)))
    assert fleet.router._candidates(())[0] == ("a", "b")  # b's stream came back


def test_a_warm_up_adds_each_worker_to_the_kept_set_without_a_rescan():
    """Workers whose streams go live one after another, decisions between: the set is scanned
    once, then each worker joins it in name order (a rescan a worker was ~0.3-0.6 ms at 1,000
    workers); a worker down, or whose stream ended, joins nothing."""
    clock = FakeClock()
    fleet = _Fleet(clock, keep=True)
    router, rng = fleet.router, random.Random(0)
    names = [f"w{i}" for i in (3, 1, 4, 0, 2, 5)]
    for name in names:
        fleet.step(rng, "add", name)
    router.set_up("w5", False)
    scans, scan = [], router._candidate_sets.scan

    def counted(*args):
        scans.append(args)
        return scan(*args)
    router._candidate_sets.scan = counted  # type: ignore[method-assign]
    joined = []
    for name in names:
        router.set_streaming(name, True)
        router.on_stream_item(name, cpb.SubscribeResponse(batch=batch(name, 0)))
        joined.append(name)
        expected = sorted(n for n in joined if n != "w5")
        assert list(router._candidates(())[0]) == expected
        assert list(router._candidates(())[0]) == _full_scan(router, (), "")[0]
    assert len(scans) == 1  # the first decision's; every later worker joined the kept set
    router.set_streaming("w4", False)  # not synced: its stream's end takes it out
    assert "w4" in router._candidates(())[0]  # synced by its batch, it stays eligible
