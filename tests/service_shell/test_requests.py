"""service_shell.requests: a request that does not parse is INVALID_ARGUMENT naming the field.
The walk over every field of every service is tests/bad_inputs/test_bad_inputs.py; here, how
the field is found, and the handler kinds the services' tests do not reach (client streaming:
reflection)."""
from __future__ import annotations

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2

from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import common_pb2
from prefixcache.v1 import compute_service_pb2 as pb
from service_shell.requests import bad_utf8_field, unparsable_reason
from tests.cache_service.grpc_harness import running_server

MARK, BAD = b"Q7xZ", b"\xc3\x28\xa0\xa1"


def _broken(message) -> bytes:
    data = message.SerializeToString()
    assert data.count(MARK) == 1
    return data.replace(MARK, BAD)


@pytest.mark.parametrize("message, path", [
    (pb.GenerateRequest(text=MARK.decode()), "prompt.text"),
    (pb.GenerateRequest(request_id="r", adapter=MARK.decode()), "adapter"),
    (cpb.StepRequest(matches=[cpb.MatchOp(request_id="a"), cpb.MatchOp(
        request_id="b", namespace=common_pb2.Namespace(salt=MARK.decode()))]),
     "matches[1].namespace.salt"),
    (cpb.StepRequest(renew_lease_ids=["x", "y", MARK.decode()]), "renew_lease_ids[2]"),
])
def test_the_first_string_that_is_not_utf8_is_named(message, path):
    assert bad_utf8_field(_broken(message), message.DESCRIPTOR) == path


def test_bytes_fields_and_unknown_fields_are_not_strings():
    message = cpb.MatchOp(packed_token_ids=BAD)  # bytes: anything goes
    assert bad_utf8_field(message.SerializeToString(), message.DESCRIPTOR) is None
    unknown = b"\xfa\x3e\x04" + BAD  # field 999, length-delimited: kept unparsed by protobuf
    assert bad_utf8_field(unknown, cpb.MatchOp.DESCRIPTOR) is None


@pytest.mark.parametrize("data", [b"\x0a\x05ab", b"\x80", b"\x0b", b"\x08" + b"\xff" * 11])
def test_broken_wire_bytes_are_reported_as_such(data):
    with pytest.raises(ValueError):
        bad_utf8_field(data, cpb.StepRequest.DESCRIPTOR)
    reason = unparsable_reason(data, cpb.StepRequest.DESCRIPTOR, Exception("protobuf says"))
    assert reason == "request is not a valid prefixcache.v1.StepRequest: protobuf says"


def test_a_client_streaming_handler_refuses_the_bad_message():
    """Reflection (stream-stream, on every server) reads its requests one by one."""
    request = reflection_pb2.ServerReflectionRequest(file_containing_symbol=MARK.decode())
    with running_server() as server, grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        call = ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/"
                                "ServerReflectionInfo")
        with pytest.raises(grpc.RpcError) as err:
            list(call(iter([_broken(request)]), timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.value.details() == ("field 'message_request.file_containing_symbol' is not "
                                   "valid UTF-8")
