"""A broken event stream resumes from the last applied batch (the cache service's replay
buffer), and falls back to a snapshot only when the buffer has moved past it. The cache side is
the real CacheCore.subscribe behind a servicer that can break a stream on demand.

Two ways a stream breaks: a transient code (UNAVAILABLE), which the client's Subscription
resubscribes from its own resume point, and a code it gives up on (PERMISSION_DENIED: a token
being rotated, say), which ends the subscription and is the gateway feed's to resume
(gateway/core/workers.py; it used to start over from a snapshot)."""
from __future__ import annotations

import threading

import grpc
import pytest

from cache_service.core import CacheCore
from gateway.core.discovery import WorkerAddress
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from prefixcache.v1 import common_pb2
from service_shell import new_server
from tests.gateway.gateway_harness import (FakeWorker, cache_prompt, register_pool, running_gateway,
                                           settings, wait_until)


class BreakableCache(cpb_grpc.CacheServiceServicer):
    """Serves CacheCore.subscribe; `drop` ends the current stream with UNAVAILABLE at its next item,
    and a subscription waits for `open` before it is served (the pool moves on meanwhile).
    `sent[n]`: the batches (seq, snapshot) subscription n delivered; `packed[n]`: whether it
    asked for packed hashes and every event it delivered came packed."""

    def __init__(self, core: CacheCore, code: grpc.StatusCode):
        self.core, self.code, self.requests, self.sent, self.packed = core, code, [], [], []
        self.drop, self.open = threading.Event(), threading.Event()
        self.open.set()
        self.server = new_server(8, "breakable-cache", [])
        cpb_grpc.add_CacheServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Subscribe(self, request, context):
        self.requests.append((request.epoch, request.after_seq))
        sent = []
        self.sent.append(sent)
        self.packed.append(request.packed_hashes)
        self.open.wait(10)
        for item in self.core.subscribe(request, context.is_active):
            if self.drop.is_set():
                self.drop.clear()
                context.abort(self.code, "stream dropped by the test")
            if item.WhichOneof("item") == "batch":
                sent.append((item.batch.seq, item.batch.snapshot))
                if any(e.stored.block_hashes or e.removed.block_hashes for e in item.batch.events):
                    self.packed[-1] = False
            yield item


def _prompt(i: int) -> list[int]:
    return list(range(1000 * i, 1000 * i + 9))  # 2 full pages of 4 (and the last token)


CODES = pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE,
                                          grpc.StatusCode.PERMISSION_DENIED], ids=lambda c: c.name)
# The gateway's own feeds, and a feed process of their own (gateway/core/feed_process.py).
FEEDS = pytest.mark.parametrize("feed_process", [False, True], ids=["own_feeds", "feed_process"])


def _run(core: CacheCore, pool: str, prompts_while_down: int, code: grpc.StatusCode,
         feed_process: bool) -> tuple[BreakableCache, set]:
    cache, worker = BreakableCache(core, code), FakeWorker(pool)
    try:
        with running_gateway(lambda: [WorkerAddress(worker.address, cache.address)],
                             worker=settings(feed_process=feed_process)) as gw:
            def held() -> set:
                with gw.router.lock:
                    return set(gw.router.index.pages(pool, common_pb2.MEDIUM_DEVICE))
            cache_prompt(core, pool, _prompt(0))
            wait_until(lambda: len(held()) == 2, what="first pages indexed")
            cache.open.clear()
            cache.drop.set()
            wait_until(lambda: len(cache.requests) == 2, what="resubscription")
            for i in range(1, 1 + prompts_while_down):  # missed while the stream is down
                cache_prompt(core, pool, _prompt(i))
            cache.open.set()
            want = 2 * (1 + prompts_while_down)
            wait_until(lambda: len(held()) == want, what="missed pages indexed")
            return cache, held()
    finally:
        worker.stop()
        cache.server.stop(0)


@CODES
@FEEDS
def test_a_dropped_stream_resumes_from_its_last_seq_without_a_snapshot(code, feed_process):
    core = CacheCore()
    register_pool(core, "wr")
    cache, _ = _run(core, "wr", prompts_while_down=3, code=code, feed_process=feed_process)
    assert cache.requests[0] == (0, -1)  # a new worker: from a snapshot
    assert cache.sent[0][0][1] is True
    last_applied = max(seq for seq, _ in cache.sent[0])
    assert last_applied >= 0 and cache.requests[1] == (1, last_applied)
    assert cache.sent[1] and not any(snap for _, snap in cache.sent[1])  # replayed, no snapshot
    assert [seq for seq, _ in cache.sent[1]] == list(range(last_applied + 1, cache.sent[1][-1][0] + 1))
    assert cache.packed == [True, True]  # the gateway's feeds ask for packed hashes, and get them


@CODES
@FEEDS
def test_a_snapshot_when_the_replay_buffer_moved_past_the_resume_point(code, feed_process):
    core = CacheCore(replay_events=4)  # a buffer far shorter than what is missed
    register_pool(core, "ws")
    cache, held = _run(core, "ws", prompts_while_down=12, code=code,
                        feed_process=feed_process)
    last_applied = max(seq for seq, _ in cache.sent[0])
    assert cache.requests[1] == (1, last_applied)  # it asked to resume ...
    assert cache.sent[1][0][1] is True  # ... and was sent a snapshot instead
    assert len(held) == 26
