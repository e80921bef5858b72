"""Random operation sequences against the core, checked against a simple reference model.

The reference knows only what the public API says: the pages each lease was given, the pages it
pinned by matching or publishing, and the page set described by the event stream. After every
operation it checks:
- per medium, free + used = total, and no page is in two places (never handed out twice);
- a pinned page is never evicted or demoted (no BlockRemoved for it, it stays on the device);
- the event stream applied to an empty index equals the tree's page set, per medium;
- a match returns exactly the longest prefix of the prompt's page hashes (computed independently
  with prefixcache_client.hash) that the event-derived index holds, within the documented caps;
- lease expiry frees exactly what the lease held.
"""
from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cache_service.core import CacheCore
from cache_service.tree import DEVICE, HOST, subtree
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2
from prefixcache_client.hash import prompt_hashes

PAGE = 2
MODEL = "m"
PREFIXES = [[1, 2, 3, 4, 5, 6], [1, 2, 3, 9, 9, 9], [7, 7, 7, 7]]


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CoreMachine(RuleBasedStateMachine):
    eviction = "lru"  # the cache service's eviction policy (cache_service/eviction.py)

    @initialize(device=st.integers(4, 12), host=st.sampled_from([0, 0, 3, 8]),
                slots=st.sampled_from([0, 0, 2, 4]))
    def setup(self, device, host, slots):
        self.clock = Clock()
        self.core = CacheCore(clock=self.clock, eviction=self.eviction)
        self.cfg = dict(device=device, host=host, slots=slots)
        self.core.register_pool(pb.RegisterPoolRequest(
            pool_id="p", epoch=1, page_size=PAGE, device_pages=device, host_pages=host,
            mamba_slots=slots, model_id=MODEL, lease_ttl_s=10))
        self.pool = self.core._pools["p"]
        self.index: set[tuple[bytes, int]] = set()  # (hash, medium) from the event stream
        self.seen_seq = -1
        self.leases: dict[str, dict] = {}  # lease id -> {"ns", "tokens", "pages", "pinned"}
        self._drain_events()

    # ---- helpers ------------------------------------------------------------------------

    def _step(self, **ops) -> pb.StepResponse:
        resp = self.core.step(pb.StepRequest(pool_id="p", epoch=1, **ops))
        self._drain_events()
        return resp

    def _drain_events(self):
        for batch in self.pool.log.since(self.seen_seq) or []:
            assert batch.seq == self.seen_seq + 1, "seq must grow by one per batch"
            self.seen_seq = batch.seq
            for ev in batch.events:
                kind = ev.WhichOneof("event")
                if kind == "cleared":
                    self.index.clear()
                elif kind == "stored":
                    for h in ev.stored.block_hashes:
                        assert (h, ev.stored.medium) not in self.index, "stored twice"
                        self.index.add((h, ev.stored.medium))
                else:
                    for h in ev.removed.block_hashes:
                        assert (h, ev.removed.medium) in self.index, "removed a page never stored"
                        self.index.discard((h, ev.removed.medium))
                        if ev.removed.medium == DEVICE and not self._evicting_namespace:
                            assert h not in self._pinned_hashes(), "a pinned page left the device"

    _evicting_namespace = False

    def _pinned_hashes(self) -> set[bytes]:
        return {h for lease in self.leases.values() for h in lease["pinned"]}

    # ---- rules --------------------------------------------------------------------------

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=5),
          adapter=st.sampled_from(["", "", "lora"]), salt=st.sampled_from(["", "", "t2"]),
          skip_host=st.booleans())
    def match(self, prefix, tail, adapter, salt, skip_host):
        tokens = prefix + tail
        ns = common_pb2.Namespace(adapter=adapter, salt=salt)
        before = set(self.index)
        resp = self._step(matches=[pb.MatchOp(request_id="r", namespace=ns, token_ids=tokens,
                                              skip_host_load=skip_host)])
        m = resp.matches[0]
        hashes = prompt_hashes(tokens, PAGE, MODEL, adapter, salt)
        assert list(m.page_hashes) == hashes[:len(m.page_hashes)], "match hashes follow the spec"
        # Longest prefix held (device, then host when loaded back) per the event stream.
        limit = max(0, len(tokens) - 1) // PAGE
        held = 0
        for h in hashes[:limit]:
            if (h, DEVICE) in before or (not skip_host and (h, HOST) in before):
                held += 1
            else:
                break
        if self.cfg["slots"] or self.cfg["host"]:
            assert len(m.page_hashes) <= held  # capped by checkpoints or by lack of device pages
        else:
            assert len(m.page_hashes) == held
        assert m.cached_tokens == PAGE * len(m.device_pages) == m.device_hit_tokens + m.host_hit_tokens
        for h in m.page_hashes:
            assert (h, DEVICE) in self.index, "matched pages are on the device"
        self.leases[m.lease_id] = {"ns": (adapter, salt), "tokens": tokens,
                                   "pages": list(m.device_pages), "pinned": list(m.page_hashes)}

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=6),
          adapter=st.sampled_from(["", "lora"]), keep=st.booleans())
    def serve(self, prefix, tail, adapter, keep):
        """What an engine does with one request: match, allocate the rest, publish every full
        page, checkpoint the last one (hybrid pools), and release unless still running."""
        self.match(prefix, tail, adapter, "", False)
        lease_id = max(self.leases, key=lambda k: int(k.rsplit("/", 1)[1]))
        lease = self.leases[lease_id]
        missing = -(-len(lease["tokens"]) // PAGE) - len(lease["pages"])
        if missing > 0:
            resp = self._step(allocations=[pb.AllocateOp(lease_id=lease_id, num_pages=missing)])
            if not resp.allocations[0].ok:
                self._step(releases=[pb.ReleaseOp(lease_id=lease_id)])
                del self.leases[lease_id]
                return
            lease["pages"] += list(resp.allocations[0].device_pages)
        full = len(lease["tokens"]) // PAGE
        resp = self._step(publishes=[pb.PublishOp(lease_id=lease_id, computed_pages=full)])
        for remap in resp.publishes[0].remaps:
            lease["pages"][remap.index] = remap.new_page
        if full > len(lease["pinned"]) and not self.pool.leases[lease_id].root.dead:
            lease["pinned"] = prompt_hashes(lease["tokens"], PAGE, MODEL, adapter, "")[:full]
        if self.cfg["slots"] and full:
            resp = self._step(checkpoints=[pb.CheckpointOp(lease_id=lease_id, page_index=full - 1)])
        if not keep:
            self._step(releases=[pb.ReleaseOp(lease_id=lease_id)])
            del self.leases[lease_id]

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), n=st.integers(1, 4))
    def allocate(self, data, n):
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        # Pages held by leases (their own and the pinned cached ones) must never be handed out;
        # unpinned cached pages may be evicted and reused.
        used_elsewhere = {p for lease in self.pool.leases.values() for p in lease.pages}
        resp = self._step(allocations=[pb.AllocateOp(lease_id=lease_id, num_pages=n)])
        a = resp.allocations[0]
        if a.ok:
            assert len(a.device_pages) == n
            assert not set(a.device_pages) & used_elsewhere, "a page was handed out twice"
            self.leases[lease_id]["pages"] += list(a.device_pages)
        else:
            assert "need" in a.reason

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=4))
    def publish(self, data, extra):
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        lease = self.leases[lease_id]
        tokens = lease["tokens"] + extra
        can = min(len(tokens) // PAGE, len(lease["pages"]))
        n = data.draw(st.integers(0, can))
        resp = self._step(publishes=[pb.PublishOp(lease_id=lease_id, append_token_ids=extra,
                                                  computed_pages=n)])
        lease["tokens"] = tokens
        for remap in resp.publishes[0].remaps:
            assert lease["pages"][remap.index] == remap.old_page
            lease["pages"][remap.index] = remap.new_page
        if n > len(lease["pinned"]) and not self.pool.leases[lease_id].root.dead:
            lease["pinned"] = prompt_hashes(tokens, PAGE, MODEL, *lease["ns"])[:n]
            for h in lease["pinned"]:
                assert (h, DEVICE) in self.index, "published pages are on the device"

    @precondition(lambda self: self.leases and self.cfg["slots"])
    @rule(data=st.data(), detach=st.booleans())
    def checkpoint(self, data, detach):
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        published = len(self.pool.leases[lease_id].nodes)
        if not published:
            return
        index = data.draw(st.integers(0, published - 1))
        resp = self._step(checkpoints=[pb.CheckpointOp(lease_id=lease_id, page_index=index,
                                                       detach=detach)])
        c = resp.checkpoints[0]
        if c.ok and not detach:
            assert 0 <= c.slot < self.cfg["slots"]

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def release(self, data):
        lease_id = data.draw(st.sampled_from(sorted(self.leases)))
        self._step(releases=[pb.ReleaseOp(lease_id=lease_id)])
        del self.leases[lease_id]

    @precondition(lambda self: self.leases)
    @rule(data=st.data())
    def expire_one(self, data):
        """Let every lease but one renew, then expire the other: exactly its pages come back."""
        victim = data.draw(st.sampled_from(sorted(self.leases)))
        others = [lid for lid in self.leases if lid != victim]
        self._step(renew_lease_ids=sorted(self.leases))
        self.clock.now += 6
        self._step(renew_lease_ids=others)
        owned = self.pool.leases[victim].pages[len(self.pool.leases[victim].nodes):]
        free_before = set(self.pool.free[DEVICE])
        self.clock.now += 6
        resp = self._step()
        assert list(resp.expired_lease_ids) == [victim]
        assert set(owned) <= set(self.pool.free[DEVICE]) - free_before
        assert victim not in self.pool.leases
        del self.leases[victim]

    @rule(adapter=st.sampled_from(["", "lora"]), salt=st.sampled_from(["", "t2"]))
    def evict_namespace(self, adapter, salt):
        if self.pool.root(adapter, salt, create=False) is None:
            return
        self._evicting_namespace = True
        try:
            self.core.evict_namespace(pb.EvictNamespaceRequest(
                pool_id="p", namespace=common_pb2.Namespace(adapter=adapter, salt=salt)))
            self._drain_events()
        finally:
            self._evicting_namespace = False
        for lease in self.leases.values():
            if lease["ns"] == (adapter, salt):
                lease["pinned"] = []  # deferred: freed at release, no longer in the index

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def pages_are_accounted_exactly_once(self):
        for medium, total in ((DEVICE, self.cfg["device"]), (HOST, self.cfg["host"])):
            places = list(self.pool.free[medium])
            for root in self.pool.roots.values():
                places += [n.page for n in subtree(root) if n.medium == medium]
            if medium == DEVICE:
                # Pages of an evicted namespace that leases still pin (deferred), once each.
                dead = {n for lease in self.pool.leases.values() for n in lease.nodes
                        if n.parent is None}
                assert all(n.page >= 0 for n in dead), "a pinned page was freed"
                places += [n.page for n in dead]
                for lease in self.pool.leases.values():
                    places += lease.pages[len(lease.nodes):]
            assert sorted(places) == list(range(total)), f"medium {medium} pages leaked or doubled"

    @invariant()
    def event_stream_equals_tree(self):
        tree = {(n.hash, n.medium) for root in self.pool.roots.values() for n in subtree(root)}
        assert tree == self.index

    @invariant()
    def leases_match_the_reference(self):
        assert set(self.pool.leases) == set(self.leases)
        for lease_id, ref in self.leases.items():
            lease = self.pool.leases[lease_id]
            assert lease.pages == ref["pages"]
            live = [n for n in lease.nodes if n.parent is not None]
            for node in live:
                assert node.medium == DEVICE  # on the device, in the tree
            if live and live == lease.nodes:
                assert lease.nodes[-1].pins > 0  # the deepest node is pinned
                for parent, child_ in zip(lease.nodes, lease.nodes[1:]):
                    assert child_.parent is parent  # a path: ancestors have a device child

    @invariant()
    def stats_add_up(self):
        stats = self.core.get_stats(pb.GetStatsRequest(pool_id="p")).pools[0]
        for m in stats.media:
            assert m.free_pages + m.used_pages == m.total_pages
            assert m.cached_pages == m.evictable_pages + m.pinned_pages
        assert stats.mamba_slots_used == len(self.pool.checkpointed)


TestCoreProperties = CoreMachine.TestCase
TestCoreProperties.settings = settings(max_examples=400, stateful_step_count=50, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])


class FrequencyCoreMachine(CoreMachine):
    """The same machine and invariants (the event stream equals the tree, the accounting adds
    up) under the frequency policy."""
    eviction = "frequency"


TestCorePropertiesFrequency = FrequencyCoreMachine.TestCase
TestCorePropertiesFrequency.settings = settings(max_examples=100, stateful_step_count=50,
                                                deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])


class AdaptiveCoreMachine(CoreMachine):
    """The same under the adaptive policy (its shadows see every run: the pool is small)."""
    eviction = "adaptive"


TestCorePropertiesAdaptive = AdaptiveCoreMachine.TestCase
TestCorePropertiesAdaptive.settings = settings(max_examples=100, stateful_step_count=50,
                                               deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
