"""The real services in one process, each with its Prometheus endpoint, for the observability
tests (tests/gateway/test_tracing.py, tests/deploy/test_observability.py): a cache service with
an L3 on Redis, workers whose Step calls go to it over gRPC and whose L3 is the same Redis, and a
gateway (gRPC and HTTP) over the workers."""
from __future__ import annotations

import contextlib
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from cache_service.core import CacheCore
from compute_service.__main__ import open_cache
from gateway.core.discovery import WorkerAddress
from pagestore.client import L3Client, L3Config
from tests.cache_service.grpc_harness import running_server
from tests.compute_service.server_harness import make_engine, running
from tests.gateway.gateway_harness import running_gateway, wait_until


def l3(url: str) -> L3Client:
    client = L3Client(L3Config(url, prefix="observed", timeout_s=1.0, mac_key=b"k" * 16))
    assert client.check(1.0)
    return client


@contextlib.contextmanager
def cache_service(redis_url: str):
    with running_server(CacheCore(remote=l3(redis_url)), metrics_port=0) as cache:
        yield cache


@contextlib.contextmanager
def worker(pool: str, cache_address: str, redis_url: str, **config):
    """A worker whose cache service is the remote one (Step over gRPC) and whose L3 is Redis:
    yields (server, client)."""
    engine = make_engine(pool_id=pool, cache=open_cache(cache_address, 5, None),
                         l3=l3(redis_url), l3_write_policy="write-through", l3_lookup=True)
    with running(engine, **config) as pair:
        yield pair


@contextlib.contextmanager
def gateway(workers: list[WorkerAddress], **config):
    """An anonymous-friendly gateway with its HTTP API, once a worker is routable."""
    with running_gateway(lambda: workers, anonymous=True, http_port=0, **config) as gw:
        wait_until(lambda: gw.router.ready(), what="worker routable")
        yield gw


def scrape(port: int) -> str:
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()


def exported(ports: list[int]) -> dict[str, set[str]]:
    """Sample name (as Prometheus stores it: counters with _total, histograms' _bucket/_sum/
    _count) -> the label names its samples carry, over every endpoint's live scrape."""
    out: dict[str, set[str]] = {}
    for port in ports:
        for family in text_string_to_metric_families(scrape(port)):
            for s in family.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return out


def stack_ports(cache, worker_server, gw) -> list[int]:
    return [cache.metrics_port, worker_server.metrics_port, gw.metrics_port]

