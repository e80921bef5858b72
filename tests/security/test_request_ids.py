"""Issue 25 finding 3: request ids were shared across tenants on a worker. The gateway keys calls
per tenant but forwarded the client's id unchanged into the worker's one registry, so Bob reusing
Alice's running id got `ALREADY_EXISTS "request_id: 'order-1' is already running"` (learning
that Alice runs it), and an Abort that reached the worker with Alice's id ended Alice's request
whoever sent it.

Now a worker keys running requests by (request-id scope, id): the gateway (and its Endpoint
Picker, through the data plane) sends the tenant's scope as `x-prefixcache-request-scope`
metadata, and answers name the client's own id. Real gateway, real worker, real cache service."""
from __future__ import annotations

import contextlib
import time

import grpc
import pytest

from cache_service.core import CacheCore
from gateway.core.discovery import WorkerAddress
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.compute import ComputeClient
from service_shell import request_scope
from tests.cache_service.grpc_harness import running_server
from tests.compute_service.server_harness import greedy, make_engine, prompt, running
from tests.gateway.gateway_harness import Caller, running_gateway, wait_until

pytestmark = pytest.mark.usefixtures("one_torch_thread")
ALICE, BOB = request_scope("tenant-a"), request_scope("tenant-b")


@pytest.fixture(scope="module")
def stack():
    """(gateway caller, worker server, worker address): a gateway over one real worker whose
    engine steps slowly enough that a request is still running when the next call comes."""
    core = CacheCore()
    with running_server(core) as cache:
        engine = make_engine(cache=core, pool_id="w1")
        with running(engine) as (server, _):
            servicer = server._servicer
            sink = servicer._sink

            def slow_sink(stream, out):  # ~25 ms a token: a 100-token answer runs ~2.5 s
                time.sleep(0.025)
                sink(stream, out)
            servicer._sink = slow_sink
            address = f"127.0.0.1:{server.port}"
            with running_gateway(lambda: [WorkerAddress(address, f"127.0.0.1:{cache.port}")]
                                 ) as gw:
                caller = Caller(gw.address)
                wait_until(lambda: gw.router.ready(), timeout_s=30, what="worker routable")
                try:
                    yield caller, server, address
                finally:
                    caller.close()


def gateway_stream(caller, token: str, request_id: str, max_tokens: int = 100):
    req = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt(5)), sampling=greedy(max_tokens),
                             request_id=request_id)
    return caller.compute.Generate(req, timeout=60, metadata=caller.meta(token))


def test_attack_a_second_tenant_reuses_a_running_request_id(stack):
    """Bob sends Alice's running id: both run (no ALREADY_EXISTS that would tell Bob what
    Alice runs), and each answer names the id its client sent."""
    caller, _, _ = stack
    alice = gateway_stream(caller, "tok-a", "order-1")
    assert next(alice).token_ids  # running on the worker
    bob = list(gateway_stream(caller, "tok-b", "order-1", max_tokens=4))
    assert bob[-1].stats.request_id == "order-1"
    assert bob[-1].stats.finish_reason == pb.FINISH_REASON_LENGTH
    rest = list(alice)
    assert rest[-1].stats.request_id == "order-1"
    assert rest[-1].stats.finish_reason == pb.FINISH_REASON_LENGTH
    # Within one tenant an id is still unique while it runs.
    again = gateway_stream(caller, "tok-a", "order-2")
    try:
        assert next(again).token_ids
        with pytest.raises(grpc.RpcError) as err:
            list(gateway_stream(caller, "tok-a", "order-2", max_tokens=2))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    finally:
        again.cancel()


def test_attack_another_tenants_abort_ends_nothing_of_alices(stack):
    """An Abort of Alice's running id with Bob's scope (what the gateway or the data plane
    sends for Bob), straight at the worker, and Bob's Abort through the gateway: Alice's stream
    runs to its end; Alice's own Abort still works."""
    caller, _, address = stack
    alice = gateway_stream(caller, "tok-a", "order-3")
    assert next(alice).token_ids
    with contextlib.closing(ComputeClient(address, timeout_s=10)) as worker:
        assert worker.abort("order-3", scope=BOB) is False
        abort = caller.compute.Abort(pb.AbortRequest(request_id="order-3"), timeout=10,
                                     metadata=caller.meta("tok-b"))
        assert abort.aborted is False
        rest = list(alice)
        assert rest[-1].stats.finish_reason == pb.FINISH_REASON_LENGTH
        assert rest[-1].stats.request_id == "order-3"
        # The owner's scope reaches it.
        direct = worker.generate(prompt(6), greedy(100), request_id="order-4", scope=ALICE)
        assert next(direct).token_ids
        assert worker.abort("order-4", scope=ALICE) is True
        final = direct.result().stats
        assert final.finish_reason == pb.FINISH_REASON_ABORT and final.request_id == "order-4"
