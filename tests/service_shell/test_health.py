"""The dedicated health port: the same probes as the service port, through a drain, then closed.
Over real gRPC on loopback, with the cache service as the service under the shell."""
from __future__ import annotations

import socket
import threading

import grpc
import prometheus_client
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cache_service.server import SERVICE_NAME
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache.v1 import cache_service_pb2_grpc as pb_grpc
from service_shell import ServiceShell, server_options
from tests.cache_service.grpc_harness import running_server

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
PROBES = ("", "liveness", "readiness", SERVICE_NAME)


def check(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def listed_services(port: int) -> set[str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        reply = next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    return {s.name for s in reply.list_services_response.service}


def test_no_health_port_unless_asked():
    with running_server() as server:
        assert server.health_port is None


def test_health_port_serves_the_same_probes_and_nothing_else():
    with running_server(health_port=0) as server:
        assert server.health_port not in (None, 0, server.port)
        for name in PROBES:
            assert check(server.health_port, name) == check(server.port, name) == SERVING, name
        # grpcurl works on it without .proto files; the service itself is not there.
        assert listed_services(server.health_port) == {
            "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.CacheServiceStub(ch).ListPools(pb.ListPoolsRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_health_port_reports_the_drain_then_closes():
    with running_server(health_port=0, drain_delay_s=0.5) as server:
        port = server.health_port
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            watch = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=10)
            assert next(watch).status == SERVING
            drainer = threading.Thread(target=server.drain)
            drainer.start()
            assert next(watch).status == NOT_SERVING  # during the drain delay
            assert check(port, "liveness") == SERVING  # not restarted for being slow to drain
            watch.cancel()
            drainer.join(10)
        assert server.wait(0)
        with pytest.raises(grpc.RpcError) as err:
            check(port, "liveness")
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_taken_health_port_fails_the_start_and_leaves_nothing_open():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        shell = ServiceShell("test.Service", host="127.0.0.1", port=0, max_workers=2,
                             thread_name_prefix="t", options=server_options(1),
                             registry=prometheus_client.CollectorRegistry(), metrics_port=0,
                             health_port=busy)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{busy}"):
            shell.start()
    assert shell.metrics_port is not None  # was opened before the failure ...
    with socket.socket() as s:  # ... and closed again
        s.bind(("127.0.0.1", shell.metrics_port))
