"""The three services on loopback for the bad-input tests: a real cache service, a real compute
worker (tiny-transformer, byte tokenizer) and a real gateway (gRPC and HTTP) over fake workers,
and raw calls that send request bytes as they are (so a test can send what no stub would)."""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor, ServiceDescriptor

from prefixcache.v1 import cache_service_pb2, compute_service_pb2, gateway_pb2
from tests.compute_service.server_harness import CONTEXT as WORKER_CONTEXT  # noqa: F401
from tests.compute_service.server_harness import make_engine, running
from tests.gateway.gateway_harness import Caller, register_pool
from tests.gateway.server_helpers import fake_fleet

CACHE = cache_service_pb2.DESCRIPTOR.services_by_name["CacheService"]
COMPUTE = compute_service_pb2.DESCRIPTOR.services_by_name["ComputeService"]
GATEWAY = gateway_pb2.DESCRIPTOR.services_by_name["GatewayService"]
# Which services each server answers (the gateway serves the workers' API too).
SERVICES: dict[str, tuple[ServiceDescriptor, ...]] = {
    "cache": (CACHE,), "compute": (COMPUTE,), "gateway": (COMPUTE, GATEWAY)}
FLOAT_POOL = "float-pool"
# The gateway's fake workers: context 1024 (tests/gateway/gateway_harness.py), vocabulary 320.
GATEWAY_CONTEXT, GATEWAY_VOCAB = 1024, 320
GATEWAY_MAX_MESSAGE_MB = 2
AUTH = tuple(Caller.meta("tok-a"))


@dataclass
class Stack:
    addresses: dict[str, str]  # "cache" / "compute" / "gateway" -> gRPC address
    http: str  # the gateway's HTTP base URL
    epp: str  # the gateway's Endpoint Picker (ext_proc) address
    channels: dict[str, grpc.Channel]

    def call(self, server: str, service: ServiceDescriptor, method: str, data: bytes,
             timeout: float = 20.0) -> grpc.RpcError | None:
        """Sends `data` as the request of `service`/`method` on `server`; the error it gets,
        None when it succeeds (a stream is read to its end)."""
        m = service.methods_by_name[method]
        path = f"/{service.full_name}/{method}"
        channel = self.channels[server]
        try:
            if m.server_streaming:
                for _ in channel.unary_stream(path)(data, metadata=AUTH, timeout=timeout):
                    pass
            else:
                channel.unary_unary(path)(data, metadata=AUTH, timeout=timeout)
        except grpc.RpcError as exc:
            return exc
        return None


@contextlib.contextmanager
def running_stack() -> Iterator[Stack]:
    engine = make_engine()
    with fake_fleet(http_port=0, epp_port=0,
                                       max_message_mb=GATEWAY_MAX_MESSAGE_MB) as (
            gw, cache, _workers, _, _caller), running(engine) as (worker, _client):
        register_pool(cache.core, FLOAT_POOL)
        addresses = {"cache": f"127.0.0.1:{cache.port}", "compute": f"127.0.0.1:{worker.port}",
                     "gateway": gw.address}
        channels = {k: grpc.insecure_channel(a) for k, a in addresses.items()}
        try:
            yield Stack(addresses, f"http://127.0.0.1:{gw.http_port}", gw.epp.address, channels)
        finally:
            for c in channels.values():
                c.close()


# ----- the request messages' fields, from their descriptors ------------------------------------

def _repeated(field: FieldDescriptor) -> bool:
    return field.is_repeated


def field_paths(message: Descriptor, kinds: set[int], prefix: str = "",
                seen: tuple[str, ...] = ()) -> list[tuple[str, tuple[FieldDescriptor, ...]]]:
    """(path as the servers name it, the fields along it) of every field of a type in `kinds`
    in `message`, nested messages included: a repeated field is named with index [0], a field
    of a real oneof with the oneof's name first (GenerateRequest.text is `prompt.text`)."""
    out = []
    for field in message.fields:
        name = field.name
        oneof = field.containing_oneof
        if oneof is not None and oneof.name != f"_{field.name}":  # not proto3 `optional`
            name = f"{oneof.name}.{name}"
        if _repeated(field):
            name += "[0]"
        path = f"{prefix}.{name}" if prefix else name
        if field.type in kinds:
            out.append((path, (field,)))
        elif field.type == FieldDescriptor.TYPE_MESSAGE and \
                field.message_type.full_name not in seen:
            for sub, chain in field_paths(field.message_type, kinds, path,
                                          (*seen, message.full_name)):
                out.append((sub, (field, *chain)))
    return out


def set_along(message, chain: tuple[FieldDescriptor, ...], value) -> None:
    """Sets the last field of `chain` to `value` in `message`, creating (or reusing element 0
    of) the messages on the way."""
    for field in chain[:-1]:
        if _repeated(field):
            items = getattr(message, field.name)
            message = items[0] if len(items) else items.add()
        else:
            message = getattr(message, field.name)
    last = chain[-1]
    if _repeated(last):
        items = getattr(message, last.name)
        if len(items):
            items[0] = value
        else:
            items.append(value)
    else:
        setattr(message, last.name, value)
