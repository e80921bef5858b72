"""Routing during a cold warm-up (issue 31): a worker whose event stream is live but whose
snapshot is not complete is routed to, balanced by load with the warm ones and scored by what
the index holds of it so far; a worker whose stream went down mid-snapshot is not, nor one whose
cache service never answered. The cache side is the real CacheCore over gRPC, behind a servicer
that holds back the end of some pools' snapshots and can take a pool's stream down."""
from __future__ import annotations

import socket
import threading
from collections import Counter

import grpc

from cache_service.core import CacheCore
from gateway.core.discovery import WorkerAddress
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from service_shell import new_server
from tests.gateway.gateway_harness import (Caller, FakeWorker, cache_prompt, register_pool,
                                           running_gateway, wait_until)
from tests.gateway.server_helpers import preview, prompt


class HeldSnapshotCache(cpb_grpc.CacheServiceServicer):
    """Serves CacheCore.subscribe, except that a pool in `held` gets its snapshot without its end
    (a warm-up under way) and then heartbeats only, and a pool in `down` has its stream ended
    with UNAVAILABLE at its next item and every resubscription refused."""

    def __init__(self, core: CacheCore, held: set[str]):
        self.core, self.held, self.down = core, held, set()
        self.server = new_server(8, "held-snapshot-cache", [])
        cpb_grpc.add_CacheServiceServicer_to_server(self, self.server)
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        self.server.start()

    def Subscribe(self, request, context):
        pool = request.pool_id
        for item in self.core.subscribe(request, context.is_active):
            if pool in self.down:
                context.abort(grpc.StatusCode.UNAVAILABLE, "stream down (test)")
            if pool in self.held and item.WhichOneof("item") == "batch":
                if not item.batch.snapshot:
                    continue  # live batches would come after the snapshot's end
                item.batch.snapshot_end = False
            yield item


def _eligible(caller: Caller) -> set[str]:
    return {c.worker for c in preview(caller, prompt(99)).candidates if c.eligible}


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_a_worker_mid_snapshot_is_routed_to_and_one_whose_stream_is_down_is_not():
    core = CacheCore()
    names = ("warm", "warming", "broken", "unreached")
    for name in names:
        register_pool(core, name)
    held_prompt = prompt(7)
    cache_prompt(core, "warming", held_prompt, salt="salt-a")  # in its unfinished snapshot
    cache = HeldSnapshotCache(core, held={"warming", "broken"})
    workers = {name: FakeWorker(name) for name in names}
    addresses = [WorkerAddress(w.address, _closed_port() if n == "unreached" else cache.address)
                 for n, w in workers.items()]
    try:
        # dead_after_s as deployed (30 s): the broken stream leaves the candidates because it
        # broke, not because it went stale.
        with running_gateway(lambda: addresses) as gw:
            caller = Caller(gw.address)

            def views() -> dict[str, tuple[bool, bool]]:
                with gw.router.lock:
                    return {n: (w.synced, gw.router.index.info(n).in_snapshot)
                            for n, w in gw.router._workers.items()}
            want = {"warm": (True, False), "warming": (False, True), "broken": (False, True),
                    "unreached": (False, False)}
            wait_until(lambda: views() == want, what="one warm worker, two mid-snapshot")
            # Live streams, snapshots under way; the worker up whose stream never delivered is
            # not a candidate.
            assert _eligible(caller) == {"warm", "warming", "broken"}

            # Scored by what the index holds of it so far: the partly applied snapshot has it.
            chosen = preview(caller, held_prompt)
            assert chosen.worker == "warming"
            assert chosen.candidates[[c.worker for c in chosen.candidates].index(
                "warming")].device_tokens == 60
            assert caller.generate(held_prompt)[-1].stats.worker == "warming"

            cache.down.add("broken")
            wait_until(lambda: _eligible(caller) == {"warm", "warming"},
                       what="the broken stream leaves the candidates")

            # New prompts, held in flight: spread by load over the warm and the warming worker.
            # The gate holds each after its first token until all 8 are routed, so no request
            # ends (and frees its load) while the others are being routed, however slow the
            # machine is.
            gate = threading.Event()
            for w in workers.values():
                w.gate = gate
            streams = []
            for i in range(8):
                stream = caller.stream(prompt(20 + i))
                next(stream)  # routed and started
                streams.append(stream)
            gate.set()
            for stream in streams:
                assert list(stream)[-1].stats.worker in {"warm", "warming"}
            routed = Counter(w.name for w in workers.values() for s in w.seen
                             if list(s.request.token_ids.ids) != held_prompt)
            assert routed == {"warm": 4, "warming": 4}, routed
            caller.close()
    finally:
        for w in workers.values():
            w.stop()
        cache.server.stop(0)
