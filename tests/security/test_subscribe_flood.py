"""The subscription flood of issue 16: 48 idle Subscribe streams held by an unauthenticated client
kept a restarted gateway from becoming ready for 25 s (every slot of the cache service taken).
With auth on, unauthenticated streams never take a slot, and one identity holds at most
--max-subscriptions-per-identity of them; a real gateway started during the flood becomes ready
and indexes the victim's pool at once."""
from __future__ import annotations

import time

import grpc

from gateway.core.discovery import WorkerAddress
from prefixcache.v1 import cache_service_pb2 as pb
from tests.gateway.gateway_harness import Caller, FakeWorker, running_gateway, settings, wait_until
from tests.gateway.server_helpers import list_workers
from tests.security import harness
from tests.security.harness import (MODEL, PAGE, TOKENS, UNAUTHENTICATED, VICTIM_POOL,
                                    VICTIM_PROMPT, secure_cache)

FLOOD = 48  # the cache service's max_subscriptions
PER_IDENTITY = 4  # secure_cache's limit
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


def _open(stub, n: int) -> tuple[list, list[grpc.StatusCode]]:
    """n Subscribe streams, each read up to its first message: (the open ones, codes of the
    refused ones)."""
    held, codes = [], []
    for _ in range(n):
        call = stub.Subscribe(pb.SubscribeRequest(pool_id=VICTIM_POOL, after_seq=-1,
                                                  heartbeat_interval_s=30), timeout=60)
        try:
            next(call)
            held.append(call)
        except grpc.RpcError as err:
            codes.append(err.code())
            harness.PROBES.setdefault(harness.CURRENT_TEST[0], []).append(err.code().name)
    return held, codes


def test_attack_idle_subscribe_flood_keeps_a_restarted_gateway_from_becoming_ready(tmp_path):
    with secure_cache(tmp_path) as cache:
        held = []
        try:
            with cache.stub(None) as anonymous, cache.stub(TOKENS["subscriber"]) as subscriber:
                opened, codes = _open(anonymous, FLOOD)
                assert opened == [] and codes == [UNAUTHENTICATED] * FLOOD
                held, codes = _open(subscriber, FLOOD)  # a real identity, flooding
                assert len(held) == PER_IDENTITY
                assert codes == [EXHAUSTED] * (FLOOD - PER_IDENTITY)
                assert cache.refusals("Subscribe", "identity_subscriptions") == FLOOD - PER_IDENTITY
                # The gateway, (re)started in the middle of the flood, is ready at once.
                worker = FakeWorker(VICTIM_POOL, model_id=MODEL, page_size=PAGE)
                address = WorkerAddress(worker.address, cache.address)
                started = time.monotonic()
                try:
                    with running_gateway(lambda: [address], worker=settings(
                            service_token=TOKENS["gateway"])) as gw:
                        caller = Caller(gw.address)
                        cached = (len(VICTIM_PROMPT) - 1) // PAGE
                        wait_until(lambda: gw.router.ready() and list_workers(caller).get(
                            VICTIM_POOL) is not None and list_workers(caller)[
                            VICTIM_POOL].device_pages == cached, timeout_s=10)
                        assert time.monotonic() - started < 10
                        caller.close()
                finally:
                    worker.stop()
        finally:
            for call in held:
                call.cancel()


def test_a_gateway_without_its_token_is_refused_and_not_ready(tmp_path):
    """The other side of the same check: a gateway that presents no service token gets nothing
    from the cache service (and says why in its log), so it never routes on stolen events."""
    with secure_cache(tmp_path) as cache:
        worker = FakeWorker(VICTIM_POOL, model_id=MODEL, page_size=PAGE)
        try:
            with running_gateway(lambda: [WorkerAddress(worker.address, cache.address)]) as gw:
                wait_until(lambda: cache.refusals("Subscribe", "missing_credentials") >= 1,
                           timeout_s=10)
                caller = Caller(gw.address)
                workers = list_workers(caller)
                assert VICTIM_POOL not in workers or workers[VICTIM_POOL].device_pages == 0
                caller.close()
        finally:
            worker.stop()
