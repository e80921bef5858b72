"""The index checkpoint (gateway/core/index_checkpoint.py): a restarted gateway loads the index it
wrote and resumes each worker's stream from its last applied seq (no snapshot); a worker whose
epoch changed meanwhile gets a snapshot, alone; a corrupt or foreign checkpoint is ignored.
Real gRPC over loopback and the real CacheCore, as tests/gateway/test_stream_resume.py."""
from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np
import pytest

from cache_service.core import CacheCore
from gateway.core import index_checkpoint
from gateway.core.discovery import WorkerAddress
from gateway.core.index import KvIndex
from gateway.core.index_checkpoint import IndexCheckpointer, capture, load, sizes, write
from gateway.core.index_table import PageTable
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import RouteRequest, make_policy
from gateway.core.router import Router, Worker
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import common_pb2, events_pb2
from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.gateway_harness import FakeWorker, cache_prompt, register_pool, running_gateway, wait_until
from tests.gateway.helpers import check_holder_sets
from tests.gateway.test_stream_resume import BreakableCache

DEVICE = common_pb2.MEDIUM_DEVICE
SPEC = "spec"


def _prompt(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + 9))  # 2 full pages of 4


def _held(gw, pool: str) -> set:
    with gw.router.lock:
        return set(gw.router.index.pages(pool, DEVICE))


def _fleet(core: CacheCore, pools: list[str]):
    caches = {p: BreakableCache(core, None) for p in pools}
    workers = {p: FakeWorker(p) for p in pools}
    return caches, workers, lambda: [WorkerAddress(workers[p].address, caches[p].address) for p in pools]


def _stop(caches, workers) -> None:
    for w in workers.values():
        w.stop()
    for c in caches.values():
        c.server.stop(0)


def _first_run(tmp_path, core, pools, source) -> dict:
    """A gateway indexes one prompt per pool and shuts down cleanly (writing the checkpoint)."""
    path = str(tmp_path / "index.ckpt")
    with running_gateway(source, index_checkpoint=path) as gw:
        for p in pools:
            cache_prompt(core, p, _prompt(0))
        for p in pools:
            wait_until(lambda p=p: len(_held(gw, p)) == 2, what="first pages indexed")
        return {p: _held(gw, p) for p in pools}


def test_a_restart_loads_the_index_and_resumes_every_stream_from_its_seq(tmp_path):
    core = CacheCore()
    pools = ["ca", "cb"]
    for p in pools:
        register_pool(core, p)
    caches, workers, source = _fleet(core, pools)
    try:
        before = _first_run(tmp_path, core, pools, source)
        last = {p: max(seq for seq, _ in caches[p].sent[0]) for p in pools}
        restored = KvIndex()
        assert sorted(load(restored, str(tmp_path / "index.ckpt"), "default", _spec())) == pools
        assert {p: set(restored.pages(p, DEVICE)) for p in pools} == before
        for i in (1, 2):  # while the gateway is down
            cache_prompt(core, "ca", _prompt(i))
        with running_gateway(source, index_checkpoint=str(tmp_path / "index.ckpt")) as gw:
            wait_until(lambda: len(_held(gw, "ca")) == 6, what="downtime events applied")
            wait_until(lambda: gw.router.ready(), what="ready")
            assert _held(gw, "cb") == before["cb"]
        for p in pools:
            assert caches[p].requests[1] == (1, last[p])  # resumed from the checkpoint's seq
            assert not any(snap for _, snap in caches[p].sent[1])  # no snapshot
        assert [seq for seq, _ in caches["ca"].sent[1]][:2] == [last["ca"] + 1, last["ca"] + 2]
    finally:
        _stop(caches, workers)


def test_an_epoch_change_while_down_snapshots_that_worker_only(tmp_path):
    core = CacheCore()
    pools = ["ea", "eb"]
    for p in pools:
        register_pool(core, p)
    caches, workers, source = _fleet(core, pools)
    try:
        before = _first_run(tmp_path, core, pools, source)
        register_pool(core, "ea", epoch=2)  # its worker restarted: a new, empty pool
        cache_prompt(core, "ea", _prompt(5), epoch=2)
        with running_gateway(source, index_checkpoint=str(tmp_path / "index.ckpt")) as gw:
            wait_until(lambda: len(_held(gw, "ea")) == 2 and _held(gw, "ea") != before["ea"],
                       what="new epoch's snapshot applied")
            assert _held(gw, "eb") == before["eb"]
        assert caches["ea"].sent[1][0][1] is True  # a snapshot for the worker whose epoch changed
        assert not any(snap for _, snap in caches["eb"].sent[1])  # the other one resumed
    finally:
        _stop(caches, workers)


def _spec() -> str:
    from prefixcache_client.hash import NS_DOMAIN
    return NS_DOMAIN.decode()


def test_a_corrupt_or_foreign_checkpoint_is_ignored_with_a_warning(tmp_path, caplog):
    path = str(tmp_path / "bad.ckpt")
    with open(path, "wb") as f:
        f.write(b"PK\x03\x04 not a checkpoint")
    index = KvIndex()
    with caplog.at_level(logging.WARNING, logger="gateway.checkpoint"):
        assert load(index, path, "default", SPEC) == []
    assert "index_checkpoint_ignored" in caplog.text and len(index) == 0 and not index.workers()
    good = str(tmp_path / "good.ckpt")
    index.add_worker("w")
    write(capture(index, {}, "other", SPEC), good)
    for ns, spec in (("default", SPEC), ("other", "another spec")):
        fresh = KvIndex()
        assert load(fresh, good, ns, spec) == [] and not fresh.workers()
    old = capture(index, {}, "other", SPEC)
    old.meta["version"] = 1  # the layout that held every slot: refused, the gateway starts cold
    write(old, good)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="gateway.checkpoint"):
        assert load(KvIndex(), good, "other", SPEC) == []
    assert "version 1" in caplog.text
    # A gateway started on a corrupt checkpoint starts empty, and its feeds from a snapshot.
    core = CacheCore()
    register_pool(core, "cz")
    caches, workers, source = _fleet(core, ["cz"])
    try:
        cache_prompt(core, "cz", _prompt(0))
        with running_gateway(source, index_checkpoint=path) as gw:
            wait_until(lambda: len(_held(gw, "cz")) == 2, what="indexed from a snapshot")
        assert caches["cz"].requests[0] == (0, -1)
    finally:
        _stop(caches, workers)


def test_the_tables_round_trip_mid_growth_with_wide_masks(tmp_path):
    """Arrays, an old table still migrating, pairs, triples, sets and masks of slots past 64 come
    back equal, the sets, pairs and triples counted."""
    index = KvIndex()
    rng = np.random.default_rng(1)
    keys = rng.integers(0, 2**63, size=(3000, 2), dtype=np.uint64).view("V16").ravel()
    for slot in range(70):
        index.add_worker(f"w{slot}")
    table = index._tables[0]
    for slot in (0, 69):
        table.add_many(keys[:2000], slot)
    table.add_many(keys[2000:2500], 3)
    table.add_many(keys[:300], 3)  # triples; the rest of the 2,000 stay pairs
    table.add_many(keys[:100], 4)  # a set of four
    table._grow(0)  # a growth just begun: every page still in the old table
    table.migrate_step = table.rate = 0  # and migrating only the pages calls touch
    table.add_many(keys[2500:], 3)  # some migrated, most not
    assert table._old is not None
    path = str(tmp_path / "ckpt")
    write(capture(index, {}, "default", SPEC), path)
    # Only the occupied slots are written: the new table's arrays are mostly empty.
    in_memory = sum(dt.itemsize * n for dt, n in sizes(index).values())
    assert os.path.getsize(path) < 0.75 * in_memory  # all of it before
    again = KvIndex()
    assert len(load(again, path, "default", SPEC)) == 70
    hashes = [k.tobytes() for k in keys]
    assert again._tables[0].masks(hashes) == table.masks(hashes)
    assert isinstance(again._tables[0], PageTable) and again._tables[0]._old is not None
    check_holder_sets(again._tables[0])
    restored = again._tables[0].holder_sets
    assert restored.pairs == 1700 and restored.triples == 200 and len(restored) == 1
    again._tables[0].add_many(keys[:10], 5)  # still a working table
    assert again._tables[0].mask(hashes[0]) == 1 << 0 | 1 << 69 | 1 << 3 | 1 << 4 | 1 << 5
    # the loaded tables take the feed loop's idle steps and report their stats, as fresh ones
    while again.migrate_some(4096):
        pass
    assert again._tables[0]._old is None and again.stats().shrinks == 0
    assert again._tables[0].masks(hashes[10:]) == table.masks(hashes[10:])


@pytest.mark.parametrize("slots", [(5,), (0, 5), (0, 6, 5)],
                         ids=["alone", "in_a_pair", "in_a_triple"])
def test_a_checkpoint_naming_unknown_holders_is_ignored(tmp_path, slots):
    index = KvIndex()
    index.add_worker("w")
    for slot in slots:  # slot 5: no worker has it
        index._tables[0].add_many([bytes(16)], slot)
    path = str(tmp_path / "ckpt")
    write(capture(index, {}, "default", SPEC), path)
    fresh = KvIndex()
    assert load(fresh, path, "default", SPEC) == [] and len(fresh) == 0


def test_restored_workers_not_admitted_again_are_dropped_and_checkpoints_are_periodic(tmp_path):
    core = CacheCore()
    pools = ["da", "db"]
    for p in pools:
        register_pool(core, p)
    caches, workers, source = _fleet(core, pools)
    path = tmp_path / "index.ckpt"
    try:
        _first_run(tmp_path, core, pools, source)
        only_da = lambda: [a for a in source() if a.compute == workers["da"].address]  # noqa: E731
        written = path.stat().st_mtime_ns
        with running_gateway(only_da, index_checkpoint=str(path), dead_after_s=0.5,
                             index_checkpoint_interval_s=0.2) as gw:
            with gw.router.lock:
                assert sorted(gw.router.index.workers()) == pools  # both restored
            wait_until(lambda: gw.router.index.workers() == ["da"], what="db dropped")
            wait_until(lambda: path.stat().st_mtime_ns != written, what="a periodic checkpoint")
            assert _held(gw, "db") == set()
    finally:
        _stop(caches, workers)


def _batch(seq: int, first: int, pages: int) -> events_pb2.EventBatch:
    hashes = [i.to_bytes(16, "little") for i in range(first, first + pages)]
    ev = events_pb2.KvEvent(stored=events_pb2.BlockStored(block_hashes=hashes, medium=DEVICE))
    return events_pb2.EventBatch(pool_id="w0", epoch=0, seq=seq, events=[ev])


def test_a_checkpoint_of_an_unchanged_index_is_skipped(tmp_path):
    """A write only when the index changed since the last one (KvIndex.changes): a heartbeat
    that only says the worker is alive changes nothing; a batch does; a restored index is what
    the file holds."""
    path = str(tmp_path / "ckpt")
    router = Router(make_policy("affinity"), GatewayMetrics())
    saver = IndexCheckpointer(router, path, 3600.0, "default", SPEC, 60.0)
    with router.lock:
        router.index.apply(_batch(0, 0, 1000))
    saver.save()
    written = os.stat(path).st_mtime_ns
    with router.lock:
        router.index.heartbeat(events_pb2.Heartbeat(pool_id="w0", epoch=0, head_seq=0))
    saver.save()
    assert (saver.writes, saver.skipped) == (1, 1) and os.stat(path).st_mtime_ns == written
    with router.lock:
        router.index.apply(_batch(1, 1000, 10))
    saver.save()
    assert (saver.writes, saver.skipped) == (2, 1)
    restarted = Router(make_policy("affinity"), GatewayMetrics())
    again = IndexCheckpointer(restarted, path, 3600.0, "default", SPEC, 60.0)
    assert again.restore() == ["w0"] and len(restarted.index) == 1010
    again.save()
    assert (again.writes, again.skipped) == (0, 1)
    os.unlink(path)  # gone meanwhile: written again whatever the count
    again.save()
    assert again.writes == 1 and os.path.exists(path)


def test_decisions_go_on_while_a_checkpoint_copies_the_index_and_ingest_waits(tmp_path, monkeypatch):
    """The copy holds `Router.writing` (every change of the index holds it), not `Router.lock`:
    a routing decision made while the copy runs completes before it ends; an ingest slice
    waits for it, and the copy holds the index as it was."""
    router = Router(make_policy("affinity"), GatewayMetrics())
    router.add(Worker("w0", "addr", "cache", None, pb.GetModelInfoResponse(worker="w0")))
    router.apply_stream_items([("w0", cpb.SubscribeResponse(batch=_batch(0, 0, 100)))])
    copying, go_on, applied = threading.Event(), threading.Event(), threading.Event()
    during_copy: list[bool] = []  # the slice applied while the copy ran?
    real_capture = index_checkpoint.capture

    def slow_capture(*args, **kwargs):
        copying.set()
        go_on.wait(5)
        during_copy.append(applied.is_set())
        return real_capture(*args, **kwargs)

    monkeypatch.setattr(index_checkpoint, "capture", slow_capture)
    saver = IndexCheckpointer(router, str(tmp_path / "ckpt"), 3600.0, "default", SPEC, 60.0)
    save = threading.Thread(target=saver.save)
    save.start()
    assert copying.wait(5)
    decided = threading.Thread(target=router.route,
                               args=(RouteRequest("r0", [b"\0" * 16], 65, 16),))
    decided.start()
    decided.join(2)
    assert not decided.is_alive(), "a decision waited for the copy"
    ingest = threading.Thread(target=lambda: (router.apply_stream_items(
        [("w0", cpb.SubscribeResponse(batch=_batch(1, 100, 10)))]), applied.set()))
    ingest.start()
    time.sleep(0.2)  # time enough for the slice, were it not held off
    go_on.set()
    save.join(5), ingest.join(5)
    assert during_copy == [False] and applied.is_set() and len(router.index) == 110
    restarted = Router(make_policy("affinity"), GatewayMetrics())
    IndexCheckpointer(restarted, str(tmp_path / "ckpt"), 3600.0, "default", SPEC, 60.0).restore()
    assert len(restarted.index) == 100  # the copy: before the slice that waited for it
