"""Helpers of the gateway's server tests (test_server_*.py, test_http_fleet.py): a fleet of
fake workers behind a gateway, prompts, the fleet's workers, RoutePreview, caching a prompt on a
pool, RPC errors and metric samples."""
from __future__ import annotations

import contextlib

import grpc
import pytest
from grpc_health.v1 import health_pb2

from gateway.core.discovery import WorkerAddress
from prefixcache.v1 import gateway_pb2 as gpb
from tests.cache_service.grpc_harness import running_server
from tests.gateway.gateway_harness import (Caller, FakeWorker, cache_prompt, register_pool,
                                           request, running_gateway, wait_until)

SERVING = health_pb2.HealthCheckResponse.SERVING


def prompt(start: int, n: int = 64) -> list[int]:
    """n tokens; distinct `start`s share no page."""
    return [(start * 31 + 7 * i) % 256 for i in range(n)]


def list_workers(caller: Caller, token: str = "tok-a") -> dict[str, gpb.WorkerInfo]:
    resp = caller.gateway.ListWorkers(gpb.ListWorkersRequest(), metadata=caller.meta(token))
    return {w.worker: w for w in resp.workers}


def preview(caller: Caller, tokens: list[int], token: str = "tok-a",
            adapter: str = "") -> gpb.RoutePreviewResponse:
    return caller.gateway.RoutePreview(gpb.RoutePreviewRequest(request=request(tokens, adapter)),
                                       metadata=caller.meta(token))


def cached_on(fleet, pool: str, tokens: list[int], salt: str = "salt-a", adapter: str = ""):
    """Caches `tokens` on `pool` and waits until the gateway's index shows it."""
    gw, cache, _, caller = fleet
    before = list_workers(caller)[pool].device_pages
    cache_prompt(cache.core, pool, tokens, salt=salt, adapter=adapter)
    wait_until(lambda: list_workers(caller)[pool].device_pages > before, what="index update")


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value


def sample(gw, name: str, **labels: str) -> float:
    return gw.metrics.registry.get_sample_value(name, labels) or 0.0


@contextlib.contextmanager
def fake_fleet(**gateway_config):
    """A cache service with pools w1 and w2, their fake workers, and a gateway over both
    (`gateway_config` goes to running_gateway), once both workers are routable: yields
    (gateway, cache server, workers by name, worker addresses, a Caller of the gateway)."""
    with running_server() as cache:
        workers = {name: FakeWorker(name) for name in ("w1", "w2")}
        for name in workers:
            register_pool(cache.core, name)
        cache_addr = f"127.0.0.1:{cache.port}"
        addresses = [WorkerAddress(w.address, cache_addr) for w in workers.values()]
        try:
            with running_gateway(lambda: addresses, **gateway_config) as gw:
                caller = Caller(gw.address)
                wait_until(lambda: len(list_workers(caller)) == 2 and gw.router.ready())
                try:
                    yield gw, cache, workers, addresses, caller
                finally:
                    caller.close()
        finally:
            for w in workers.values():
                w.stop()
