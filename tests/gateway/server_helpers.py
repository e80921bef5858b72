"""Helpers of the gateway's server tests (test_server_*.py): prompts, the fleet's workers,
RoutePreview, caching a prompt on a pool, RPC errors and metric samples."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from prefixcache.v1 import gateway_pb2 as gpb
from tests.gateway.gateway_harness import Caller, cache_prompt, request, wait_until

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
