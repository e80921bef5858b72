"""Requests that cannot be parsed answer INVALID_ARGUMENT naming the field, not INTERNAL.

gRPC Python parses a request in the handler's `request_deserializer`, before any servicer code
runs, and answers INTERNAL "Exception deserializing request!" when that raises: what a client
gets today for a string field that is not valid UTF-8 (proto3 requires it), on every service.
`RequestCheck` is a server interceptor (installed on every server by
`service_shell.grpc_server.new_server`) that wraps each handler's deserializer: a request that
fails to parse becomes a `_Unparsable` marker, and the wrapped behavior aborts the call with
INVALID_ARGUMENT and the reason, e.g. "field 'prompt.text' is not valid UTF-8".

Which field: protobuf's DecodeError does not say, so `bad_utf8_field` walks the wire bytes with
the message's descriptor (varints, fixed, length-delimited; nested messages recursively) and
names the first string field whose bytes are not UTF-8, as a path: `matches[0].namespace.salt`
(repeated fields indexed by occurrence, fields of a real oneof prefixed by its name, so
GenerateRequest.text is `prompt.text` as the servicers name it). Any other parse failure is
"request is not a valid <type>: <protobuf's reason>". Both are the client's fault, so
INVALID_ARGUMENT; nothing about the request is logged beyond its method (it may be huge).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from google.protobuf import descriptor_pool
from google.protobuf.descriptor import Descriptor, FieldDescriptor

from service_shell.logs import kv

log = logging.getLogger("service_shell.requests")

_WIRE_VARINT, _WIRE_FIXED64, _WIRE_LEN, _WIRE_SGROUP, _WIRE_EGROUP, _WIRE_FIXED32 = range(6)
_MAX_DEPTH = 100  # protobuf's own recursion limit


class _Unparsable:
    """What the wrapped deserializer returns for a request it could not parse."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message


class RequestCheck(grpc.ServerInterceptor):
    """Turns request parse failures into INVALID_ARGUMENT naming the field (see the module
    docstring). Handlers of every arity are wrapped; a handler without a deserializer (generic
    handlers that take bytes) is left alone."""

    def __init__(self) -> None:
        # method -> (the handler, its wrapped copy): the services' handlers are the same objects
        # call after call, so each is wrapped once (Step runs once per engine step). A handler
        # another interceptor builds anew per call is wrapped per call.
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def intercept_service(self, continuation: Callable, handler_call_details: Any):
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        wrapped = self._wrap(handler, method)
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrap(handler: Any, method: str) -> Any:
        deserializer = _checked(handler.request_deserializer, method)
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary), deserializer, handler.response_serializer)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _unary_stream(handler.unary_stream), deserializer, handler.response_serializer)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _streaming(handler.stream_unary), deserializer, handler.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            _streaming(handler.stream_stream), deserializer, handler.response_serializer)


def _checked(deserialize: Callable[[bytes], Any], method: str) -> Callable[[bytes], Any]:
    message_type = _message_descriptor(deserialize, method)

    def parse(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # DecodeError, or whatever a custom deserializer raises
            reason = unparsable_reason(data, message_type, exc)
            log.info(kv("request_unparsable", method=method, reason=reason))
            return _Unparsable(reason)
    return parse


def _message_descriptor(deserialize: Callable, method: str) -> Descriptor | None:
    """The request type: `Message.FromString` is bound to its class; else the method's input
    type in the default descriptor pool ("/pkg.Service/Method")."""
    cls = getattr(deserialize, "__self__", None)
    if isinstance(getattr(cls, "DESCRIPTOR", None), Descriptor):
        return cls.DESCRIPTOR
    try:
        return descriptor_pool.Default().FindMethodByName(
            method.lstrip("/").replace("/", ".")).input_type
    except (KeyError, AttributeError):
        return None


def unparsable_reason(data: bytes, message_type: Descriptor | None, exc: Exception) -> str:
    """Why `data` is not a valid request, naming the field when a string is not UTF-8."""
    if message_type is None:
        return f"request could not be parsed: {exc}"
    try:
        field = bad_utf8_field(data, message_type)
    except ValueError:  # the wire format itself is broken: protobuf's reason says how
        field = None
    if field is not None:
        return f"field '{field}' is not valid UTF-8"
    return f"request is not a valid {message_type.full_name}: {exc}"


def bad_utf8_field(data: bytes, message_type: Descriptor, _prefix: str = "",
                   _depth: int = 0) -> str | None:
    """The path of the first string field of `data` (a serialized `message_type`) whose bytes
    are not UTF-8; None when there is none. ValueError when the wire format is broken."""
    if _depth > _MAX_DEPTH:
        raise ValueError("message nested too deeply")
    seen: dict[int, int] = {}
    view = memoryview(data)
    pos, end = 0, len(data)
    while pos < end:
        key, pos = _varint(view, pos)
        number, wire = key >> 3, key & 7
        if wire == _WIRE_VARINT:
            _, pos = _varint(view, pos)
        elif wire == _WIRE_FIXED64:
            pos += 8
        elif wire == _WIRE_FIXED32:
            pos += 4
        elif wire == _WIRE_LEN:
            size, pos = _varint(view, pos)
            if pos + size > end:
                raise ValueError("truncated length-delimited field")
            found = _check_len_field(view[pos:pos + size], message_type, number, seen, _prefix,
                                     _depth)
            if found is not None:
                return found
            pos += size
        else:  # groups (proto2 only) and invalid wire types: nothing of ours uses them
            raise ValueError(f"unsupported wire type {wire}")
        if pos > end:
            raise ValueError("truncated field")
    return None


def _check_len_field(chunk: memoryview, message_type: Descriptor, number: int,
                     seen: dict[int, int], prefix: str, depth: int) -> str | None:
    field = message_type.fields_by_number.get(number)
    if field is None:  # unknown fields are kept as bytes, never decoded
        return None
    index = seen.get(number, 0)
    seen[number] = index + 1
    path = _path(prefix, field, index)
    if field.type == FieldDescriptor.TYPE_STRING:
        try:
            str(chunk, "utf-8")
        except UnicodeDecodeError:
            return path
    elif field.type == FieldDescriptor.TYPE_MESSAGE:
        return bad_utf8_field(chunk, field.message_type, path, depth + 1)
    return None


def _path(prefix: str, field: FieldDescriptor, index: int) -> str:
    name = field.name
    oneof = field.containing_oneof
    if oneof is not None and not _synthetic(oneof):
        name = f"{oneof.name}.{name}"
    if _repeated(field) and not _is_map(field):
        name = f"{name}[{index}]"
    return f"{prefix}.{name}" if prefix else name


def _repeated(field: FieldDescriptor) -> bool:
    is_repeated = getattr(field, "is_repeated", None)  # protobuf >= 5.x; `label` is deprecated
    return bool(is_repeated) if is_repeated is not None else (
        field.label == FieldDescriptor.LABEL_REPEATED)


def _is_map(field: FieldDescriptor) -> bool:
    return field.message_type is not None and field.message_type.GetOptions().map_entry


def _synthetic(oneof: Any) -> bool:
    """proto3 `optional` fields sit in a synthetic oneof named `_<field>`: not a real one."""
    fields = oneof.fields
    return len(fields) == 1 and oneof.name == f"_{fields[0].name}"


def _varint(view: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(view):
            raise ValueError("truncated varint")
        byte = view[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ValueError("varint too long")


def _abort_if_unparsable(request: Any, context: grpc.ServicerContext) -> None:
    if isinstance(request, _Unparsable):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)


def _unary(behavior: Callable) -> Callable:
    def checked(request: Any, context: grpc.ServicerContext) -> Any:
        _abort_if_unparsable(request, context)
        return behavior(request, context)
    return checked


def _unary_stream(behavior: Callable) -> Callable:
    def checked(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        _abort_if_unparsable(request, context)
        yield from behavior(request, context)
    return checked


def _streaming(behavior: Callable) -> Callable:
    """Client-streaming handlers: a bad message aborts the call when the servicer reads it."""
    def checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        def each() -> Iterator[Any]:
            for request in requests:
                _abort_if_unparsable(request, context)
                yield request
        return behavior(each(), context)
    return checked
