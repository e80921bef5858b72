"""The Endpoint Picker protocol on Envoy's ext_proc messages (the official generated code of
envoyproxy/data-plane-api, shipped by the `xds-protos` package).

What the Gateway API Inference Extension's EPP protocol (its docs/proposals/004-endpoint-picker-
protocol) asks, and how this module answers it:
- The chosen endpoint goes back twice with the same value: the request header
  `x-gateway-destination-endpoint` and the dynamic metadata `envoy.lb` /
  `x-gateway-destination-endpoint` ("ip:port", the InferencePool's podIP:targetPort).
- The data plane may restrict the choice with filter metadata `envoy.lb.subset_hint` /
  `x-gateway-destination-endpoint-subset` (a list, or a comma-separated string, of "ip:port");
  nothing eligible in it is an ImmediateResponse 503, as is no ready endpoint at all.
- Requests this EPP routes are gRPC `prefixcache.v1.ComputeService` calls (the workers' own API,
  served over h2c): the body is the gRPC length-prefixed GenerateRequest; and, where the pool's
  workers run model servers (`python -m gateway --model-server`), OpenAI HTTP requests: the
  body is their JSON (gateway/epp/openai_body.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.type.v3 import http_status_pb2
from prefixcache.v1 import compute_service_pb2 as pb

DESTINATION_HEADER = "x-gateway-destination-endpoint"
DESTINATION_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
EXT_PROC_SERVICE = ep.DESCRIPTOR.services_by_name["ExternalProcessor"].full_name
COMPUTE_PREFIX = "/" + pb.DESCRIPTOR.services_by_name["ComputeService"].full_name + "/"
GENERATE_PATH = COMPUTE_PREFIX + "Generate"
ABORT_PATH = COMPUTE_PREFIX + "Abort"
# Envoy's ext_proc filter caps one streamed body chunk at 64 KiB; the reference EPP stays below
# it with 62,000 bytes.
MAX_CHUNK = 62_000
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
# HTTP status -> the gRPC status a gRPC client gets in Envoy's local reply.
_GRPC_STATUS = {400: 3, 401: 16, 404: 12, 413: 8, 429: 8, 503: 14}
GRPC_NOT_FOUND = 5


class Refusal(Exception):
    """A request the EPP answers itself (ImmediateResponse): `status` is the HTTP status,
    `grpc_status` the gRPC one when it is not the usual match of `status`."""

    def __init__(self, status: int, message: str, grpc_status: int | None = None) -> None:
        super().__init__(status, message)
        self.status, self.message, self.grpc_status = status, message, grpc_status


def header_map(headers: ep.HttpHeaders) -> dict[str, list[str]]:
    """Lower-cased names -> values (Envoy sends `raw_value` bytes, older ones `value`)."""
    out: dict[str, list[str]] = {}
    for h in headers.headers.headers:
        value = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
        out.setdefault(h.key.lower(), []).append(value)
    return out


def subset_hint(request: ep.ProcessingRequest) -> set[str] | None:
    """The endpoints the data plane allows, or None when it sets no subset (the whole pool)."""
    ns = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET_KEY not in ns.fields:
        return None
    value = ns.fields[SUBSET_KEY]
    items: Iterable[str]
    if value.HasField("list_value"):
        items = [v.string_value for v in value.list_value.values]
    else:
        items = [value.string_value]
    return {e.strip() for item in items for e in item.split(",") if e.strip()}


def generate_request(body: bytes) -> pb.GenerateRequest:
    """The GenerateRequest of a gRPC request body: one uncompressed length-prefixed message."""
    if len(body) < 5:
        raise Refusal(400, f"body: {len(body)} bytes is not a gRPC message (5-byte prefix)")
    if body[0] != 0:
        raise Refusal(400, "grpc-encoding: compressed messages cannot be routed; send them "
                           "uncompressed")
    size = int.from_bytes(body[1:5], "big")
    if len(body) != 5 + size:
        raise Refusal(400, f"body: one GenerateRequest expected, the prefix says {size} bytes "
                           f"and {len(body) - 5} came")
    request = pb.GenerateRequest()
    try:
        request.ParseFromString(body[5:])
    except DecodeError as exc:
        raise Refusal(400, f"body: not a prefixcache.v1.GenerateRequest: {exc}") from None
    return request


def abort_request(body: bytes) -> pb.AbortRequest:
    if len(body) < 5 or body[0] != 0 or len(body) != 5 + int.from_bytes(body[1:5], "big"):
        raise Refusal(400, "body: one uncompressed AbortRequest expected")
    request = pb.AbortRequest()
    try:
        request.ParseFromString(body[5:])
    except DecodeError as exc:
        raise Refusal(400, f"body: not a prefixcache.v1.AbortRequest: {exc}") from None
    return request


def destination(endpoint: str, set_headers: Mapping[str, str | None]) -> ep.CommonResponse:
    """Headers that name `endpoint` and set (str) or remove (None) `set_headers`, and have the
    data plane re-evaluate the route with them (clear_route_cache)."""
    mutation = ep.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=DESTINATION_HEADER,
                                                               raw_value=endpoint.encode()),
                                   append_action=_OVERWRITE)])
    for key, value in set_headers.items():
        if value is None:
            mutation.remove_headers.append(key)
        else:
            mutation.set_headers.append(base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=key, raw_value=value.encode()),
                append_action=_OVERWRITE))
    return ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)


def destination_metadata(endpoint: str) -> struct_pb2.Struct:
    meta = struct_pb2.Struct()
    meta.fields[DESTINATION_NAMESPACE].struct_value.fields[DESTINATION_HEADER].string_value = \
        endpoint
    return meta


def headers_response(common: ep.CommonResponse | None = None,
                     metadata: struct_pb2.Struct | None = None) -> ep.ProcessingResponse:
    out = ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common))
    if metadata is not None:
        out.dynamic_metadata.CopyFrom(metadata)
    return out


def body_response(common: ep.CommonResponse | None = None,
                  metadata: struct_pb2.Struct | None = None) -> ep.ProcessingResponse:
    out = ep.ProcessingResponse(request_body=ep.BodyResponse(response=common))
    if metadata is not None:
        out.dynamic_metadata.CopyFrom(metadata)
    return out


def streamed_body(body: bytes, end_of_stream: bool, response: bool = False
                  ) -> list[ep.ProcessingResponse]:
    """`body` handed back in FULL_DUPLEX_STREAMED mode (where the data plane forwards only what
    the processor returns), in chunks under Envoy's limit."""
    chunks = [body[i:i + MAX_CHUNK] for i in range(0, len(body), MAX_CHUNK)] or [b""]
    out = []
    for i, chunk in enumerate(chunks):
        common = ep.CommonResponse(body_mutation=ep.BodyMutation(
            streamed_response=ep.StreamedBodyResponse(
                body=chunk, end_of_stream=end_of_stream and i == len(chunks) - 1)))
        body_msg = ep.BodyResponse(response=common)
        out.append(ep.ProcessingResponse(response_body=body_msg) if response
                   else ep.ProcessingResponse(request_body=body_msg))
    return out


def immediate(status: int, message: str, grpc: bool, grpc_status: int | None = None,
              json_body: bytes | None = None) -> ep.ProcessingResponse:
    """The data plane answers the client itself: `status` with `message`, and for a gRPC client
    the matching gRPC status; `json_body` (an OpenAI error object) replaces the text body."""
    # Envoy's local reply to a gRPC request turns the body into grpc-message.
    resp = ep.ImmediateResponse(status=http_status_pb2.HttpStatus(code=status),
                                body=json_body or message.encode(), details=message)
    if grpc:
        resp.grpc_status.status = grpc_status or _GRPC_STATUS.get(status, 2)
    elif json_body is not None:
        resp.headers.set_headers.append(base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
            append_action=_OVERWRITE))
    return ep.ProcessingResponse(immediate_response=resp)
