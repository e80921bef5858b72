"""Gateway event streams: resyncs (gap, new epoch), restarts, workers joining and leaving."""
from __future__ import annotations

import time

import pytest

from gateway.core.discovery import WorkerAddress
from gateway.core.index_table import page_keys
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from service_shell import new_server
from tests.cache_service.grpc_harness import running_server
from tests.gateway.gateway_harness import (MODEL, Caller, FakeWorker, cache_prompt, register_pool,
                                           running_gateway, settings, wait_until)
from tests.gateway.helpers import batch, cleared, heartbeat, pages, stored
from tests.gateway.server_helpers import list_workers, preview, prompt, sample


# ---- the event streams: resyncs and restarts --------------------------------------------------

class ScriptedCache(cpb_grpc.CacheServiceServicer):
    """Subscribe answers the n-th subscription with scripts[n], then idles until cancelled."""

    def __init__(self, scripts: list[list[cpb.SubscribeResponse]]):
        self.scripts, self.requests = scripts, []
        self.server = new_server(8, "scripted-cache", [])
        cpb_grpc.add_CacheServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Subscribe(self, request, context):
        self.requests.append(request)
        yield from self.scripts[min(len(self.requests), len(self.scripts)) - 1]
        while context.is_active():
            time.sleep(0.02)


def items(*batches) -> list[cpb.SubscribeResponse]:
    return [cpb.SubscribeResponse(batch=b) if b.DESCRIPTOR.name == "EventBatch"
            else cpb.SubscribeResponse(heartbeat=b) for b in batches]


def snapshot(pool: str, seq: int, hashes: list[bytes], epoch: int = 1):
    return batch(pool, seq, cleared(), stored(hashes), epoch=epoch, snapshot=True,
                 snapshot_end=True)


@pytest.mark.parametrize("feed_process", [False, True], ids=["own_feeds", "feed_process"])
@pytest.mark.parametrize("case", ["gap", "new_epoch"])
def test_resync_resubscribes_where_the_index_says(case, feed_process):
    pool = "ws"
    if case == "gap":  # seq 0 applied, then seq 3: replay from 0
        first = items(snapshot(pool, 0, pages(0, 4)), batch(pool, 3, stored(pages(9, 10))))
        second = items(*(batch(pool, s, stored(pages(s * 10, s * 10 + 2))) for s in (1, 2, 3)))
        want_request, want_pages, want_epoch, want_seq = (1, 0), {*pages(0, 4), *pages(10, 12),
                                                                  *pages(20, 22), *pages(30, 32)}, 1, 3
    else:  # a live batch of epoch 2 without a snapshot: a fresh snapshot of epoch 2
        first = items(snapshot(pool, 0, pages(0, 4)), batch(pool, 5, stored(pages(9, 10)),
                                                             epoch=2))
        second = items(snapshot(pool, 5, pages(50, 53), epoch=2), heartbeat(pool, 5, epoch=2))
        want_request, want_pages, want_epoch, want_seq = (2, -1), set(pages(50, 53)), 2, 5
    cache, worker = ScriptedCache([first, second]), FakeWorker(pool)
    try:
        with running_gateway(lambda: [WorkerAddress(worker.address, cache.address)],
                             worker=settings(feed_process=feed_process)) as gw:
            def resynced() -> bool:  # the second subscription's batches applied, not only sent
                with gw.router.lock:
                    info = gw.router.index.info(pool)
                return (len(cache.requests) == 2 and gw.router.ready() and info is not None
                        and (info.epoch, info.last_seq) == (want_epoch, want_seq))
            wait_until(resynced, what="resync")
            assert (cache.requests[0].epoch, cache.requests[0].after_seq) == (0, -1)
            assert (cache.requests[1].epoch, cache.requests[1].after_seq) == want_request
            with gw.router.lock:
                assert gw.router.index.pages(pool, 1) == page_keys(want_pages)
                assert gw.router.index.info(pool).epoch == want_epoch
            assert sample(gw, "prefixcache_gateway_resyncs_total", worker=pool) == 1
    finally:
        worker.stop()
        cache.server.stop(0)


def test_worker_restart_and_gateway_restart_keep_routing():
    """A worker's new epoch replaces its index entries; a new gateway starts from snapshots
    and routes as the old one did."""
    with running_server() as cache:
        workers = [FakeWorker("w1"), FakeWorker("w2")]
        cache_addr = f"127.0.0.1:{cache.port}"
        for w in workers:
            register_pool(cache.core, w.name)
        tokens, old = prompt(11), prompt(12)
        cache_prompt(cache.core, "w1", old, salt="salt-a")
        addresses = [WorkerAddress(w.address, cache_addr) for w in workers]
        try:
            with running_gateway(lambda: addresses) as gw:
                caller = Caller(gw.address)
                wait_until(lambda: len(list_workers(caller)) == 2, what="both workers")
                wait_until(lambda: preview(caller, old).worker == "w1", what="old prefix")
                register_pool(cache.core, "w1", epoch=2)  # w1 restarted: its cache is empty
                cache_prompt(cache.core, "w1", tokens, salt="salt-a", epoch=2)
                wait_until(lambda: list_workers(caller)["w1"].epoch == 2
                           and list_workers(caller)["w1"].device_pages == 15, what="epoch 2")
                before = preview(caller, tokens)
                assert all(c.device_tokens == 0 for c in preview(caller, old).candidates)
                caller.close()
            with running_gateway(lambda: addresses) as gw2:
                caller = Caller(gw2.address)
                # Ready once any worker is routable: wait for w1's snapshot itself.
                wait_until(lambda: gw2.router.ready() and len(list_workers(caller)) == 2
                           and list_workers(caller)["w1"].epoch == 2
                           and list_workers(caller)["w1"].device_pages == 15, what="snapshots")
                after = preview(caller, tokens)
                assert after.worker == before.worker == "w1"
                assert after.reason == before.reason
                assert after.candidates[0].device_tokens == 60
                caller.close()
        finally:
            for w in workers:
                w.stop()


def test_workers_join_and_leave_at_runtime(caplog):
    with running_server() as cache:
        workers = {n: FakeWorker(n) for n in ("w1", "w2", "w3")}
        other = FakeWorker("odd", model_id="another-model")
        for n in (*workers, "odd"):
            register_pool(cache.core, n, model_id="another-model" if n == "odd" else MODEL)
        cache_addr = f"127.0.0.1:{cache.port}"
        current = [WorkerAddress(workers["w1"].address, cache_addr),
                   WorkerAddress(other.address, cache_addr)]
        try:
            with running_gateway(lambda: list(current), model_id=MODEL) as gw:
                caller = Caller(gw.address)
                wait_until(lambda: set(list_workers(caller)) == {"w1"}, what="w1 only")
                current.append(WorkerAddress(workers["w3"].address, cache_addr))
                wait_until(lambda: set(list_workers(caller)) == {"w1", "w3"}, what="w3 joins")
                # w1 leaves while streaming (a pod draining after its DNS record went): its
                # running call still ends normally.
                workers["w1"].delay_s, workers["w1"].tokens = 0.1, 10
                cached = prompt(17)
                cache_prompt(cache.core, "w1", cached, salt="salt-a")
                wait_until(lambda: preview(caller, cached).worker == "w1", what="w1 holds it")
                draining = caller.stream(cached)
                next(draining)
                del current[0]
                wait_until(lambda: set(list_workers(caller)) == {"w3"}, what="w1 leaves")
                assert list(draining)[-1].stats.worker == "w1"
                with gw.router.lock:
                    assert gw.router.index.workers() == ["w3"]
                assert caller.generate(prompt(13))[-1].stats.worker == "w3"
                assert "odd" not in list_workers(caller)
                wait_until(lambda: "event=worker_refused" in caplog.text)
                assert "another-model" in caplog.text
                caller.close()
        finally:
            for w in (*workers.values(), other):
                w.stop()
