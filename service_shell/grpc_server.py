"""Building blocks of a gRPC server: its thread pool, binding a port (plaintext or TLS) with an
error that names the address, and reflection."""
from __future__ import annotations

from collections.abc import Sequence
from concurrent import futures

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection

from service_shell.requests import RequestCheck

HEALTH_SERVICE_NAME = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name


def new_server(max_workers: int, thread_name_prefix: str,
               options: list[tuple[str, int | str]],
               interceptors: Sequence[grpc.ServerInterceptor] = ()) -> grpc.Server:
    """A server whose every handler first goes through `RequestCheck` (a request that does not
    parse, e.g. a string that is not UTF-8, is INVALID_ARGUMENT naming the field, not INTERNAL),
    then through `interceptors`, in order."""
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers,
                                                  thread_name_prefix=thread_name_prefix),
                       options=options, interceptors=(RequestCheck(), *interceptors))


def bind(server: grpc.Server, host: str, port: int,
         credentials: grpc.ServerCredentials | None = None) -> int:
    """Adds a listening port (0 = any free one) and returns the bound port; OSError when the
    address cannot be bound."""
    address = f"{host}:{port}"
    try:
        bound = (server.add_secure_port(address, credentials) if credentials is not None
                 else server.add_insecure_port(address))
    except RuntimeError as exc:  # grpc raises on bind failure in recent versions
        raise OSError(f"cannot listen on {address}: {exc}") from exc
    if bound == 0:  # ... and returns 0 in older ones
        raise OSError(f"cannot listen on {address}")
    return bound


def enable_reflection(server: grpc.Server, *service_names: str) -> None:
    """Reflection over `service_names`, health and reflection itself (so grpcurl needs no
    .proto files)."""
    reflection.enable_server_reflection(
        (*service_names, HEALTH_SERVICE_NAME, reflection.SERVICE_NAME), server)
