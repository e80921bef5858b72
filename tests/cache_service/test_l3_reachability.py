"""A wrong or unreachable --redis-url (issue 16) is loud at start and harmless: the service logs
`event=l3_unreachable` with the URL (password redacted) and the cause, reports health "l3"
NOT_SERVING and `prefixcache_cache_l3_up 0` while readiness stays SERVING (lookups miss), and
recovers by itself when Redis comes up, without traffic."""
from __future__ import annotations

import time
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from stack.launcher import free_port
from tests.cache_service.grpc_harness import server_process

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " "))


def started(redis_url: str):
    """The cache service with its metrics port (`--metrics-port 0` means none)."""
    port = free_port()
    return server_process(0, "--redis-url", redis_url, "--metrics-port", str(port)), port


def wait_for(predicate, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_the_service_starts_ready_without_l3_and_reports_it(redis_server):
    redis_server.stop()
    url = f"redis://:s3cret@127.0.0.1:{redis_server.port}/0"
    ctx, metrics_port = started(url)
    with ctx as proc:
        assert health(proc.target, "readiness") == SERVING  # serving, lookups miss
        assert health(proc.target, "l3") == NOT_SERVING
        assert metric(metrics_port, "prefixcache_cache_l3_up") == 0
        log = proc.log()
        assert "event=l3_unreachable" in log and ":***@127.0.0.1" in log and "s3cret" not in log
        assert "refused" in log
    # Redis up at start: SERVING and l3_up 1.
    redis_server.start()
    ctx, metrics_port = started(redis_server.url)
    with ctx as proc:
        assert health(proc.target, "l3") == SERVING
        assert metric(metrics_port, "prefixcache_cache_l3_up") == 1
        redis_server.stop()
        redis_server.start()  # a restart is not a down state to report: no call failed
        assert health(proc.target, "l3") == SERVING


def test_a_redis_that_comes_up_after_the_service_is_seen_without_traffic(redis_server):
    redis_server.stop()
    ctx, metrics_port = started(redis_server.url)
    with ctx as proc:
        assert health(proc.target, "l3") == NOT_SERVING
        redis_server.start()
        assert wait_for(lambda: health(proc.target, "l3") == SERVING)
        assert metric(metrics_port, "prefixcache_cache_l3_up") == 1
        assert "event=l3_reachable" in proc.log()
