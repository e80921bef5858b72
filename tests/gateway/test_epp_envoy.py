"""The Endpoint Picker behind a real Envoy (tests/gateway/envoy_proxy.py): gRPC clients call
Generate at Envoy, Envoy asks the gateway's EPP over ext_proc (request bodies FULL_DUPLEX_STREAMED,
as the EPP protocol asks, and BUFFERED) and sends the call to the worker it names, with the
headers it set."""
from __future__ import annotations

import threading

import grpc
import pytest

from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from tests.gateway.envoy_proxy import running_envoy
from tests.gateway.gateway_harness import DATAPLANE_TOKEN, request, wait_until
from tests.gateway.server_helpers import cached_on, fake_fleet, prompt, sample


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def through_envoy(request):
    with fake_fleet(epp_port=0) as fleet:
        gw = fleet[0]
        with running_envoy(gw.epp.port, request.param,
                           service_token=DATAPLANE_TOKEN) as address:
            channel = grpc.insecure_channel(address)
            try:
                yield fleet, pb_grpc.ComputeServiceStub(channel)
            finally:
                channel.close()


def call(stub, tokens, token: str | None = "tok-a", extra=(), request_id: str = ""):
    meta = ([("authorization", f"Bearer {token}")] if token else []) + list(extra)
    return list(stub.Generate(request(tokens, request_id=request_id), timeout=20,
                              metadata=meta))


def test_envoy_sends_generate_to_the_worker_holding_the_prefix(through_envoy):
    (gw, cache, workers, _, caller), stub = through_envoy
    for pool, start in (("w1", 11), ("w2", 12)):
        tokens = prompt(start)
        cached_on((gw, cache, workers, caller), pool, tokens)
        # A client's own salt never reaches the worker: the tenant's replaces it; nor does a
        # service token of its own: the worker sees the data plane's, which Envoy adds.
        out = call(stub, tokens, extra=[("x-prefixcache-salt", "salt-b"),
                                        ("x-prefixcache-service-token", "forged")])
        assert out[-1].stats.worker == pool
        assert [m.text for m in out[:-1]] == ["A", "B", "C"]
        assert workers[pool].seen[-1].salts == ["salt-a"]
        assert workers[pool].seen[-1].service_tokens == [DATAPLANE_TOKEN]
        assert workers[pool].seen[-1].request.token_ids.ids == tokens
    assert sample(gw, "prefixcache_gateway_epp_picks_total", worker="w2", outcome="picked") >= 1


def test_envoy_keeps_a_conversation_on_one_worker(through_envoy):
    _, stub = through_envoy
    first = prompt(21, 64)
    worker = call(stub, first)[-1].stats.worker
    for extra in (8, 32):
        assert call(stub, first + prompt(22, extra))[-1].stats.worker == worker


def test_envoy_answers_the_epp_refusals_with_grpc_statuses(through_envoy):
    (gw, *_), stub = through_envoy
    with pytest.raises(grpc.RpcError) as err:
        call(stub, prompt(31), token="not-a-token")
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "authorization" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        call(stub, [])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_generate_loads_its_worker_until_envoy_ends_the_exchange(through_envoy):
    (gw, _, workers, _, _), stub = through_envoy
    gate = threading.Event()  # the stream is still running when the first token arrives
    for w in workers.values():
        w.gate = gate
    try:
        stream = stub.Generate(request(prompt(41), max_tokens=3), timeout=20,
                               metadata=[("authorization", "Bearer tok-a")])
        assert next(stream).token_ids
        assert sum(gw.router.load.get(n).inflight_requests for n in gw.router.names()) == 1
        gate.set()
        assert list(stream)[-1].HasField("stats")
    finally:
        for w in workers.values():
            w.gate = None
        gate.set()
    wait_until(lambda: sum(gw.router.load.get(n).inflight_requests
                           for n in gw.router.names()) == 0, what="load released")
