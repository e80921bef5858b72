"""The Endpoint Picker refuses what the gateway's own Generate and Abort refuse, with the same
message, before it tokenizes, hashes or routes anything (design.md §8 "Bad input"): it routed a
10 MB text or adapter name in seconds that Generate refused at once, and took a 10 MB Abort id.
One parametrized id per bad input; each is an ImmediateResponse with the HTTP status and, for
the gRPC client, the gRPC status, and a message that starts with the field."""
from __future__ import annotations

import grpc
import pytest

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.limits import (MAX_NAME_BYTES, MAX_REQUEST_ID_BYTES, MAX_STOP_TOKEN_IDS,
                                      QUOTE_LIMIT, TEXT_BYTES_PER_TOKEN)
from service_shell.service_token import with_service_token
from tests.bad_inputs.stack import GATEWAY_CONTEXT, running_stack
from tests.gateway.gateway_harness import DATAPLANE_TOKEN
from tests.gateway.test_epp import GENERATE, grpc_body, headers, messages, process, refusal

ABORT = "/prefixcache.v1.ComputeService/Abort"
MB = 1 << 20
INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT.value[0], grpc.StatusCode.NOT_FOUND.value[0]


@pytest.fixture(scope="module")
def epp(one_torch_thread):
    with running_stack() as s:
        channel = grpc.insecure_channel(s.epp)
        try:
            # As the data plane calls it (Envoy's token, role dataplane: issue 25 finding 1).
            yield ep_grpc.ExternalProcessorStub(with_service_token(channel, DATAPLANE_TOKEN))
        finally:
            channel.close()


def _generate(**fields) -> pb.GenerateRequest:
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                                 sampling=pb.SamplingParams(max_tokens=1))
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def _stops(n: int) -> pb.GenerateRequest:
    request = _generate()
    request.sampling.stop_token_ids.extend([1] * n)
    return request


TEXT_OVER = GATEWAY_CONTEXT * TEXT_BYTES_PER_TOKEN + 1
# id: (path, request, HTTP status, gRPC status, what the message starts with)
CASES = {
    "epp-generate-adapter-1mb": (
        GENERATE, _generate(adapter="a" * MB), 400, INVALID,
        f"adapter: at least {MB} UTF-8 bytes exceed the limit of {MAX_NAME_BYTES} bytes"),
    "epp-generate-request-id-1mb": (
        GENERATE, _generate(request_id="a" * MB), 400, INVALID,
        f"request_id: at least {MB} UTF-8 bytes exceed the limit of {MAX_REQUEST_ID_BYTES}"),
    "epp-generate-text-just-over-limit": (
        GENERATE, _generate(text="a" * TEXT_OVER), 400, INVALID,
        f"prompt.text: at least {TEXT_OVER} bytes exceed"),
    "epp-generate-1m-token-prompt": (
        GENERATE, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 1_000_000)), 400,
        INVALID, "prompt.token_ids: 1000000 tokens leave no room"),
    "epp-generate-stop-token-ids-over-limit": (
        GENERATE, _stops(MAX_STOP_TOKEN_IDS + 1), 400, INVALID,
        f"sampling.stop_token_ids: {MAX_STOP_TOKEN_IDS + 1} stop token ids exceed"),
    "epp-abort-request-id-1mb": (
        ABORT, pb.AbortRequest(request_id="a" * MB), 400, INVALID,
        f"request_id: at least {MB} UTF-8 bytes exceed the limit of {MAX_REQUEST_ID_BYTES}"),
    "epp-abort-unknown-request-id-at-limit": (
        # Not running: 404, the id quoted and cut as every echo of a client's string is.
        ABORT, pb.AbortRequest(request_id="z" * MAX_REQUEST_ID_BYTES), 404, NOT_FOUND,
        f"request_id: '{'z' * QUOTE_LIMIT}'… (+{MAX_REQUEST_ID_BYTES - QUOTE_LIMIT} chars) is "
        "not running"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_epp_bad_input_gets_a_clear_refusal(epp, case):
    path, request, status, grpc_status, starts = CASES[case]
    answer = refusal(process(epp, messages(headers(path), grpc_body(request))))
    assert answer.status.code == status and answer.grpc_status.status == grpc_status, answer
    message = answer.body.decode()
    assert message.startswith(starts), message
    assert len(message) < 1000
