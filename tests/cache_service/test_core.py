"""Cache core semantics, in process (design.md §4 and the lessons of §7 it is responsible for)."""
from __future__ import annotations

import pytest

from cache_service.core import CacheCore
from prefixcache.v1 import cache_service_pb2 as pb, common_pb2
from prefixcache_client.errors import CacheError, ErrorCode
from prefixcache_client.hash import prompt_hashes

P = 4
MODEL = "m"
NAMESPACES = [("", ""), ("lora-a", ""), ("", "tenant-1"), ("lora-a", "tenant-1"), ("ü", "🔑")]


class Worker:
    """Drives one pool the way an engine does, in process."""

    def __init__(self, core: CacheCore | None = None, device=32, host=0, slots=0, pool="w"):
        self.core = core or CacheCore()
        self.pool = pool
        self.core.register_pool(pb.RegisterPoolRequest(
            pool_id=pool, epoch=1, page_size=P, device_pages=device, host_pages=host,
            mamba_slots=slots, model_id=MODEL))

    def step(self, **ops) -> pb.StepResponse:
        return self.core.step(pb.StepRequest(pool_id=self.pool, epoch=1, **ops))

    def match(self, tokens, adapter="", salt="", **kw) -> pb.MatchResult:
        ns = common_pb2.Namespace(adapter=adapter, salt=salt)
        return self.step(matches=[pb.MatchOp(request_id="r", namespace=ns, token_ids=tokens, **kw)]).matches[0]

    def run(self, tokens, adapter="", salt="", checkpoint_last=False, release=True) -> pb.MatchResult:
        """Match, allocate the rest, publish every full page, optionally checkpoint, release."""
        m = self.match(tokens, adapter, salt)
        need = -(-len(tokens) // P) - len(m.device_pages)
        if need:
            assert self.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=need)]).allocations[0].ok
        full = len(tokens) // P
        self.step(publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=full)])
        if checkpoint_last and full:
            assert self.step(checkpoints=[pb.CheckpointOp(lease_id=m.lease_id, page_index=full - 1)]).checkpoints[0].ok
        if release:
            self.step(releases=[pb.ReleaseOp(lease_id=m.lease_id)])
        return m

    def stats(self) -> pb.PoolStats:
        return self.core.get_stats(pb.GetStatsRequest(pool_id=self.pool)).pools[0]

    def device(self) -> pb.MediumStats:
        return self.stats().media[0]

    def events(self):
        return self.core._pools[self.pool].log.since(-1)


def stored_hashes(batches) -> set[bytes]:
    return {h for b in batches for e in b.events if e.HasField("stored") for h in e.stored.block_hashes}


PROMPT = list(range(100, 118))  # 4.5 pages: 4 full pages, at most 4 reusable (17 // 4)


@pytest.mark.parametrize("adapter,salt", NAMESPACES)
@pytest.mark.parametrize("slots", [0, 4])
def test_no_hit_partial_page_and_full_hit_in_every_namespace(adapter, salt, slots):
    w = Worker(slots=slots)
    cold = w.match(PROMPT, adapter, salt)  # design.md lesson 6: no hit means 0, never a negative depth
    assert (cold.cached_tokens, list(cold.device_pages), cold.unusable_pages) == (0, [], 0)
    w.step(releases=[pb.ReleaseOp(lease_id=cold.lease_id)])
    w.run(PROMPT, adapter, salt, checkpoint_last=bool(slots))
    # Diverging in the middle of page 2: pages 0 and 1 hit, the partial page never does.
    partial = w.match(PROMPT[:10] + [7] * 8, adapter, salt)
    want = 0 if slots else 2 * P  # hybrid: no checkpoint at page 1, so nothing is resumable
    assert partial.cached_tokens == want
    full = w.match(PROMPT, adapter, salt)
    assert full.cached_tokens == 4 * P
    assert list(full.page_hashes) == prompt_hashes(PROMPT, P, MODEL, adapter, salt)[:4]
    assert full.mamba_slot == (-1 if not slots else full.mamba_slot) and (not slots or full.mamba_slot >= 0)
    # The last prompt token is always computed: a page-aligned prompt reuses all but its last page.
    aligned = w.match(PROMPT[:16], adapter, salt)
    assert aligned.cached_tokens == (0 if slots else 3 * P)


def test_paired_namespaces_same_hits_other_adapter_or_salt_never():
    w = Worker()
    w.run(PROMPT, "lora-a", "t1")
    same = w.match(PROMPT, "lora-a", "t1")
    assert same.cached_tokens == 16
    for adapter, salt in [("", "t1"), ("lora-b", "t1"), ("lora-a", ""), ("lora-a", "t2")]:
        assert w.match(PROMPT, adapter, salt).cached_tokens == 0, (adapter, salt)
    # Now every namespace has published the same tokens: no event hash is shared (design.md lesson 4).
    w2 = Worker(pool="w2", core=w.core)
    per_ns = []
    for adapter, salt in NAMESPACES:
        before = stored_hashes(w2.events())
        w2.run(PROMPT, adapter, salt)
        per_ns.append(stored_hashes(w2.events()) - before)
    assert all(len(h) == 4 for h in per_ns)
    assert len(set().union(*per_ns)) == 4 * len(NAMESPACES)


def test_model_id_is_part_of_the_namespace():
    core = CacheCore()
    a, b = Worker(core, pool="a"), None
    core.register_pool(pb.RegisterPoolRequest(pool_id="b", epoch=1, page_size=P, device_pages=8,
                                              model_id="other"))
    a.run(PROMPT)
    b = Worker.__new__(Worker)
    b.core, b.pool = core, "b"
    b.run(PROMPT)
    assert not stored_hashes(a.events()) & stored_hashes(b.events())
    with pytest.raises(CacheError) as err:
        a.step(matches=[pb.MatchOp(namespace=common_pb2.Namespace(model_id="other"), token_ids=[1])])
    assert err.value.code == ErrorCode.INVALID_ARGUMENT and "namespace.model_id" in err.value.message


def test_hybrid_match_is_capped_at_the_deepest_checkpoint_and_checkpoint_eviction_keeps_pages():
    w = Worker(slots=1)
    m = w.match(PROMPT)
    w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=5)])
    w.step(publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=4)])
    ck = w.step(checkpoints=[pb.CheckpointOp(lease_id=m.lease_id, page_index=1)]).checkpoints[0]
    assert ck.ok and ck.slot == 0
    again = w.step(checkpoints=[pb.CheckpointOp(lease_id=m.lease_id, page_index=1)]).checkpoints[0]
    assert again.already_present and again.slot == 0
    w.step(releases=[pb.ReleaseOp(lease_id=m.lease_id)])
    hit = w.match(PROMPT)
    assert (hit.cached_tokens, hit.mamba_slot, hit.unusable_pages) == (2 * P, 0, 2)
    w.step(releases=[pb.ReleaseOp(lease_id=hit.lease_id)])
    # A second prompt needs the only slot: the unpinned checkpoint is evicted, its pages stay.
    other = [9] * 9
    w.run(other, checkpoint_last=True)
    assert w.stats().mamba_evictions == 1
    assert w.device().cached_pages == 6
    assert w.match(PROMPT).cached_tokens == 0  # KV pages still there, but not resumable


def test_host_only_match_is_loaded_back():
    w = Worker(device=5, host=8)
    w.run(PROMPT)  # 5 device pages: 4 published + 1 partial freed at release
    w.run([5] * 20)  # needs all 5 device pages: the first prompt is demoted to host
    s = w.stats()
    assert s.media[1].cached_pages == 4 and s.media[0].evictions == 4
    resp = w.step(matches=[pb.MatchOp(request_id="again", token_ids=PROMPT)])
    m = resp.matches[0]
    assert (m.cached_tokens, m.host_hit_tokens) == (16, 16)  # design.md lesson 12: used, not ignored
    loads = [c for c in resp.copies if c.src_medium == common_pb2.MEDIUM_HOST]
    assert [c.dst_page for c in loads] == list(m.device_pages)
    assert [c.page_hash for c in loads] == list(m.page_hashes)
    # Copies run in order: no earlier copy may overwrite a host page before it is loaded back.
    for i, c in enumerate(resp.copies):
        if c.src_medium == common_pb2.MEDIUM_HOST:
            earlier = [x.dst_page for x in resp.copies[:i] if x.dst_medium == common_pb2.MEDIUM_HOST]
            assert c.src_page not in earlier


def test_evicting_a_namespace_defers_pinned_pages_until_release():
    w = Worker(device=16)
    w.run(PROMPT, "lora-a")
    w.run([1] * 9, "lora-a")
    holder = w.match(PROMPT, "lora-a")  # pins 4 pages
    free_before = w.device().free_pages
    resp = w.core.evict_namespace(pb.EvictNamespaceRequest(
        pool_id="w", namespace=common_pb2.Namespace(adapter="lora-a")))
    assert (resp.removed_pages, resp.deferred_pages) == (2, 4)
    removed = [h for e in w.events()[-1].events for h in e.removed.block_hashes]
    assert len(removed) == 6  # every page leaves the index now, pinned ones included
    assert w.device().free_pages == free_before + 2
    assert w.match(PROMPT, "lora-a").cached_tokens == 0  # nothing left to hit
    # The running request can still publish and release safely (design.md lesson 5).
    w.step(allocations=[pb.AllocateOp(lease_id=holder.lease_id, num_pages=1)],
           publishes=[pb.PublishOp(lease_id=holder.lease_id, computed_pages=4)])
    w.step(releases=[pb.ReleaseOp(lease_id=holder.lease_id)])
    s = w.stats()
    assert s.media[0].cached_pages == 0
    assert s.media[0].free_pages == s.media[0].total_pages - 0 - sum(
        len(l.pages) for l in w.core._pools["w"].leases.values())
    with pytest.raises(CacheError) as err:
        w.core.evict_namespace(pb.EvictNamespaceRequest(
            pool_id="w", namespace=common_pb2.Namespace(adapter="nope")))
    assert err.value.code == ErrorCode.NOT_FOUND and "namespace" in err.value.message


def test_concurrent_publish_of_the_same_prefix_is_deduplicated():
    w = Worker()
    a, b = w.match(PROMPT), w.match(PROMPT)  # neither hits: both compute it
    for m in (a, b):
        w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=5)])
    w.step(publishes=[pb.PublishOp(lease_id=a.lease_id, computed_pages=2)])
    before = w.device().free_pages
    res = w.step(publishes=[pb.PublishOp(lease_id=b.lease_id, computed_pages=4)]).publishes[0]
    assert res.inserted_pages == 2 and [r.index for r in res.remaps] == [0, 1]
    assert w.device().free_pages == before + 2  # the duplicates went back to the pool
    third = w.match(PROMPT)  # sees both publishes at once, mid-flight (design.md lesson 1)
    assert third.cached_tokens == 16
    assert w.stats().duplicate_pages == 2


def test_idle_steps_keep_the_cache():
    w = Worker()
    w.run(PROMPT)
    for _ in range(3):
        w.step()  # design.md lesson 7: an idle step must not reset anything
    assert w.match(PROMPT).cached_tokens == 16


def test_allocation_failure_says_why_and_changes_nothing_it_cannot():
    w = Worker(device=4)
    m = w.match(PROMPT)
    a = w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=5)]).allocations[0]
    assert not a.ok and "need 5 device pages" in a.reason
    assert w.device().free_pages == 4
    assert w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=4)]).allocations[0].ok


def test_hit_rate_is_counted_once_per_request():
    w = Worker()
    w.run(PROMPT)
    w.match(PROMPT)
    w.match(PROMPT, is_resume=True)  # a preempted request matching again is not a new query
    s = w.stats()
    assert (s.queried_tokens, s.hit_tokens_device) == (2 * len(PROMPT), 16)
    assert s.skipped_prefill_tokens + s.computed_prefill_tokens == s.queried_tokens


def test_lease_expiry_frees_what_it_held_and_reports_it():
    now = [0.0]
    core = CacheCore(clock=lambda: now[0])
    w = Worker(core)
    m = w.match(PROMPT, lease_ttl_s=5)
    w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=5)])
    assert w.device().free_pages == 27
    now[0] = 6
    resp = w.step()
    assert list(resp.expired_lease_ids) == [m.lease_id]
    assert w.device().free_pages == 32 and w.stats().lease_expiries == 1
    with pytest.raises(CacheError) as err:
        w.step(releases=[pb.ReleaseOp(lease_id=m.lease_id)])
    assert err.value.code == ErrorCode.NOT_FOUND and "releases[0]" in err.value.message


@pytest.mark.parametrize("ops,code,field", [
    (dict(checkpoints=[pb.CheckpointOp(lease_id="LEASE", page_index=0)]), ErrorCode.INVALID_ARGUMENT, "checkpoints[0]"),
    (dict(publishes=[pb.PublishOp(lease_id="LEASE", computed_pages=9)]), ErrorCode.INVALID_ARGUMENT, "publishes[0].computed_pages"),
    (dict(publishes=[pb.PublishOp(lease_id="LEASE", append_token_ids=[-3])]), ErrorCode.INVALID_ARGUMENT, "publishes[0].append_token_ids"),
    (dict(allocations=[pb.AllocateOp(lease_id="LEASE", num_pages=0)]), ErrorCode.INVALID_ARGUMENT, "allocations[0].num_pages"),
    (dict(releases=[pb.ReleaseOp(lease_id="LEASE")], allocations=[pb.AllocateOp(lease_id="LEASE", num_pages=1)]), ErrorCode.INVALID_ARGUMENT, "allocations[0].lease_id"),
    (dict(matches=[pb.MatchOp(token_ids=[1, 2**32])]), ErrorCode.INVALID_ARGUMENT, "matches[1].token_ids"),
    (dict(matches=[pb.MatchOp(namespace=common_pb2.Namespace(adapter="x" * 300))]), ErrorCode.INVALID_ARGUMENT, "matches[1].namespace.adapter"),
])
def test_a_bad_op_rejects_the_whole_step_and_changes_nothing(ops, code, field):
    w = Worker()
    w.run(PROMPT)
    lease = w.match(PROMPT).lease_id
    before = (w.stats(), w.core._pools["w"].log.head_seq)
    for op_list in ops.values():
        for op in op_list:
            if hasattr(op, "lease_id") and op.lease_id == "LEASE":
                op.lease_id = lease
    # A valid match rides along first: were the step half-applied, it would leave a lease.
    ops = {**ops, "matches": [pb.MatchOp(request_id="ok", token_ids=PROMPT), *ops.get("matches", [])]}
    with pytest.raises(CacheError) as err:
        w.step(**ops)
    assert err.value.code == code and field in err.value.message
    assert (w.stats(), w.core._pools["w"].log.head_seq) == before


def test_registration_is_idempotent_a_new_epoch_clears_and_a_shape_change_is_refused():
    w = Worker()
    w.run(PROMPT)
    req = pb.RegisterPoolRequest(pool_id="w", epoch=1, page_size=P, device_pages=32, model_id=MODEL)
    assert not w.core.register_pool(req).reset
    assert w.match(PROMPT).cached_tokens == 16
    with pytest.raises(CacheError) as err:
        w.core.register_pool(pb.RegisterPoolRequest(pool_id="w", epoch=1, page_size=8,
                                                    device_pages=32, model_id=MODEL))
    assert err.value.code == ErrorCode.FAILED_PRECONDITION
    req.epoch = 2
    resp = w.core.register_pool(req)
    assert resp.reset and resp.next_seq == 1
    first = w.core._pools["w"].log.since(-1)[0]
    assert first.epoch == 2 and first.seq == 0 and first.events[0].HasField("cleared")
    with pytest.raises(CacheError) as err:
        w.step()  # still at epoch 1
    assert err.value.code == ErrorCode.FAILED_PRECONDITION and "epoch" in err.value.message


def test_unregister_with_a_stale_epoch_leaves_the_newer_registration():
    w = Worker()
    w.core.register_pool(pb.RegisterPoolRequest(pool_id="w", epoch=2, page_size=P, device_pages=8,
                                                model_id=MODEL))
    with pytest.raises(CacheError) as err:
        w.core.unregister_pool(pb.UnregisterPoolRequest(pool_id="w", epoch=1))
    assert err.value.code == ErrorCode.FAILED_PRECONDITION and "epoch" in err.value.message
    w.core.unregister_pool(pb.UnregisterPoolRequest(pool_id="w", epoch=2))
    assert not w.core.list_pools(pb.ListPoolsRequest()).pools


def test_evicting_an_adapter_for_all_salts_keeps_the_base_model_and_other_adapters():
    w = Worker()
    for adapter, salt in [("lora-a", "t1"), ("lora-a", "t2"), ("", "t1"), ("lora-b", "t1")]:
        w.run(PROMPT, adapter, salt)
    resp = w.core.evict_namespace(pb.EvictNamespaceRequest(
        namespace=common_pb2.Namespace(adapter="lora-a"), all_salts=True))
    assert resp.removed_pages == 8
    assert w.match(PROMPT, "lora-a", "t1").cached_tokens == 0
    assert w.match(PROMPT, "lora-a", "t2").cached_tokens == 0
    assert w.match(PROMPT, "", "t1").cached_tokens == 16
    assert w.match(PROMPT, "lora-b", "t1").cached_tokens == 16


def test_a_lease_named_in_a_step_survives_a_forward_longer_than_its_ttl():
    now = [0.0]
    w = Worker(CacheCore(clock=lambda: now[0]))
    m = w.match(PROMPT, lease_ttl_s=5)
    now[0] = 60  # the worker's forward took a minute
    resp = w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=5)])
    assert resp.allocations[0].ok and not resp.expired_lease_ids


def test_packed_token_ids_are_the_same_prompt_and_misuse_is_rejected():
    import numpy as np
    w = Worker()
    w.run(PROMPT)
    packed = np.asarray(PROMPT, dtype="<u4").tobytes()
    m = w.step(matches=[pb.MatchOp(packed_token_ids=packed)]).matches[0]
    assert m.cached_tokens == 16 and list(m.page_hashes) == prompt_hashes(PROMPT, P, MODEL)[:4]
    for op, msg in [(pb.MatchOp(packed_token_ids=packed, token_ids=[1]), "not both"),
                    (pb.MatchOp(packed_token_ids=packed[:-1]), "multiple of 4")]:
        with pytest.raises(CacheError) as err:
            w.step(matches=[op])
        assert err.value.code == ErrorCode.INVALID_ARGUMENT and msg in err.value.message
        assert "matches[0].token_ids" in err.value.message


def test_page_hashes_can_be_left_out_of_a_match():
    w = Worker()
    w.run(PROMPT)
    m = w.step(matches=[pb.MatchOp(token_ids=PROMPT, omit_page_hashes=True)]).matches[0]
    assert m.cached_tokens == 16 and not m.page_hashes


def test_checkpoints_after_a_namespace_eviction_fail_softly():
    w = Worker(slots=2)
    m = w.match(PROMPT, "lora-a")
    w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=5)])
    w.step(publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=1)])
    w.core.evict_namespace(pb.EvictNamespaceRequest(
        pool_id="w", namespace=common_pb2.Namespace(adapter="lora-a")))
    resp = w.step(publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=4)],
                  checkpoints=[pb.CheckpointOp(lease_id=m.lease_id, page_index=3),
                               pb.CheckpointOp(lease_id=m.lease_id, page_index=0)])
    assert [c.ok for c in resp.checkpoints] == [False, False]
    assert all("evicted" in c.reason for c in resp.checkpoints)
