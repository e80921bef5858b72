"""The tree of runs (cache_service/tree.py): a published prompt is one run, and runs are split
only where a match, a divergent publish, a checkpoint or eviction needs it; the native chain
hash; event batches encoded once, when read."""
from __future__ import annotations

import hashlib
import os

import pytest

from cache_service import chain_hash
from cache_service.tree import DEVICE, HOST, nodes_below, size
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.hash import prompt_hashes
from tests.cache_service.test_core import MODEL, P, Worker


def runs(w: Worker) -> list[tuple[int, int]]:
    """(pages, medium) of every run, parents first."""
    pool = w.core._pools[w.pool]
    return [(size(n), n.medium) for r in pool.roots.values() for n in nodes_below(r)]


def tokens(n_pages: int, first: int) -> list[int]:
    return list(range(first, first + n_pages * P)) + [7]  # one token past the last full page


def test_a_prompt_is_one_run_split_only_where_a_match_ends():
    w = Worker()
    w.run(tokens(6, 100))
    assert runs(w) == [(6, DEVICE)]
    assert w.match(tokens(6, 100)).cached_tokens == 6 * P  # ends where the run ends: no split
    assert runs(w) == [(6, DEVICE)]
    shorter = w.match(tokens(6, 100)[:4 * P + 1])  # 4 of the 6 pages
    assert shorter.cached_tokens == 4 * P
    assert runs(w) == [(4, DEVICE), (2, DEVICE)]
    # A prompt diverging inside the first run shares its head and hangs a new run below it.
    w.run(tokens(6, 100)[:2 * P] + tokens(3, 900))
    assert sorted(runs(w)) == [(2, DEVICE), (2, DEVICE), (2, DEVICE), (3, DEVICE)]
    hashes = prompt_hashes(tokens(6, 100), P, MODEL)
    assert list(w.match(tokens(6, 100)).page_hashes) == hashes


def test_eviction_takes_only_the_tail_pages_it_needs_from_the_lru_run():
    w = Worker(device=10)
    w.run(tokens(6, 100))  # 6 cached pages, 4 free
    other = w.match(tokens(1, 500)[:P])
    assert w.step(allocations=[pb.AllocateOp(lease_id=other.lease_id, num_pages=7)]).allocations[0].ok
    assert runs(w) == [(3, DEVICE)]  # 3 tail pages evicted, the head stays cached
    assert w.stats().media[0].evictions == 3
    w.step(releases=[pb.ReleaseOp(lease_id=other.lease_id)])
    assert w.match(tokens(6, 100)).cached_tokens == 3 * P


def test_demotion_moves_the_tail_of_a_run_to_host_and_a_match_loads_it_back():
    w = Worker(device=8, host=8)
    w.run(tokens(6, 100))
    other = w.match(tokens(1, 500)[:P])
    resp = w.step(allocations=[pb.AllocateOp(lease_id=other.lease_id, num_pages=5)])
    assert resp.allocations[0].ok
    assert runs(w) == [(3, DEVICE), (3, HOST)]
    demoted = [c for c in resp.copies if c.dst_medium == HOST]
    assert [c.page_hash for c in demoted] == prompt_hashes(tokens(6, 100), P, MODEL)[3:]
    w.step(releases=[pb.ReleaseOp(lease_id=other.lease_id)])
    again = w.match(tokens(6, 100))
    assert (again.cached_tokens, again.host_hit_tokens) == (6 * P, 3 * P)
    assert runs(w) == [(3, DEVICE), (3, DEVICE)]


def test_a_checkpoint_inside_a_run_splits_it_after_the_checkpointed_page():
    w = Worker(slots=2)
    m = w.match(tokens(6, 100))
    w.step(allocations=[pb.AllocateOp(lease_id=m.lease_id, num_pages=7)])
    w.step(publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=6)])
    ck = w.step(checkpoints=[pb.CheckpointOp(lease_id=m.lease_id, page_index=2)]).checkpoints[0]
    assert ck.ok and runs(w) == [(3, DEVICE), (3, DEVICE)]
    w.step(releases=[pb.ReleaseOp(lease_id=m.lease_id)])
    hit = w.match(tokens(6, 100))
    assert (hit.cached_tokens, hit.mamba_slot, hit.unusable_pages) == (3 * P, ck.slot, 3)


def test_event_batches_are_encoded_once_when_first_read():
    w = Worker()
    w.run(tokens(4, 100))
    log = w.core._pools[w.pool].log
    assert all(entry[4] is None for entry in log._batches)  # nothing encoded yet
    first = log.since(-1)
    assert [b.seq for b in first] == list(range(log.head_seq + 1))
    assert all(a is b for a, b in zip(first, log.since(-1), strict=True))
    stored = [h for b in first for e in b.events if e.HasField("stored")
              for h in e.stored.block_hashes]
    assert stored == prompt_hashes(tokens(4, 100), P, MODEL)


@pytest.mark.parametrize("stride", [4, 64, 1024])
def test_the_chain_hash_is_the_spec_whichever_implementation_runs(stride):
    data = hashlib.shake_256(b"chain").digest(stride * 9)
    parent = os.urandom(16)
    want = chain_hash.python_chain(parent, data, stride)
    assert chain_hash.chain_function()(parent, data, stride) == want
    assert len(want) == 9 * 16
    first = hashlib.sha256(parent + data[:stride]).digest()[:16]
    second = hashlib.sha256(first + data[stride:2 * stride]).digest()[:16]
    assert (want[:16], want[16:32]) == (first, second)
