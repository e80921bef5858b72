"""Names, ids, stop sequences and text over prefixcache_client.limits, sent to the real services
over loopback (issue 25 findings 4, 5, 6; design.md §8 "Bad input"): one limit for every entry
point, refused at parse with the field first, and an untrusted string an error does echo comes
back quoted and cut (`quote_untrusted`), never whole. One parametrized id per bad input, checked
as test_bad_inputs.py checks its own (`check_grpc_case`, `check_http_case`).

- grpc-*: a 1 MB adapter name or request id (the issue's 10 MB, cut to the test gateway's 2 MB
  messages) at the gateway's Generate, RoutePreview and Abort and at the worker; stop token ids
  over the count; a 1M-token prompt that RoutePreview routed and Generate refuses.
- http-*: lone surrogates (JSON's "\\ud800", valid JSON but not text) in any string; stop
  strings over the count or the length (100,000 of them cost seconds of the event loop); model
  names over the limit, or unknown and echoed.
"""
from __future__ import annotations

import grpc
import pytest

from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.limits import (MAX_NAME_BYTES, MAX_REQUEST_ID_BYTES, MAX_STOP_STRING_CHARS,
                                      MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, QUOTE_LIMIT)
from tests.bad_inputs.stack import COMPUTE, GATEWAY, running_stack
from tests.bad_inputs.test_bad_inputs import (INVALID, _generate, _ids, _preview, check_grpc_case,
                                              check_http_case)


@pytest.fixture(scope="module")
def stack(one_torch_thread):
    with running_stack() as s:
        yield s


def _with(request: pb.GenerateRequest, **fields) -> pb.GenerateRequest:
    for name, value in fields.items():
        setattr(request, name, value)
    return request


MB = 1 << 20
BIG_NAME = "a" * MB  # the 10 MB name, cut to fit the test gateway's 2 MB messages
MANY_STOP_IDS = (1,) * (MAX_STOP_TOKEN_IDS + 1)


# id: (server, service, method, request, code, what the message starts with)
GRPC_CASES = {
    # Names and ids over prefixcache_client.limits: refused at parse, never echoed whole.
    "grpc-gateway-generate-adapter-1mb": (
        "gateway", COMPUTE, "Generate", _with(_generate(), adapter=BIG_NAME), INVALID,
        f"adapter: at least {MB} UTF-8 bytes exceed the limit of {MAX_NAME_BYTES} bytes"),
    "grpc-routepreview-adapter-1mb": (
        "gateway", GATEWAY, "RoutePreview", _preview(_with(_generate(), adapter=BIG_NAME)),
        INVALID, f"adapter: at least {MB} UTF-8 bytes exceed"),
    "grpc-worker-generate-adapter-1mb": (
        "compute", COMPUTE, "Generate", _with(_generate(), adapter=BIG_NAME), INVALID,
        f"adapter: at least {MB} UTF-8 bytes exceed the limit of {MAX_NAME_BYTES} bytes"),
    "grpc-gateway-generate-request-id-1mb": (
        "gateway", COMPUTE, "Generate", _with(_generate(), request_id=BIG_NAME), INVALID,
        f"request_id: at least {MB} UTF-8 bytes exceed the limit of {MAX_REQUEST_ID_BYTES}"),
    "grpc-worker-generate-request-id-1mb": (
        "compute", COMPUTE, "Generate", _with(_generate(), request_id=BIG_NAME), INVALID,
        f"request_id: at least {MB} UTF-8 bytes exceed the limit of {MAX_REQUEST_ID_BYTES}"),
    "grpc-gateway-abort-request-id-1mb": (
        "gateway", COMPUTE, "Abort", pb.AbortRequest(request_id=BIG_NAME), INVALID,
        f"request_id: at least {MB} UTF-8 bytes exceed"),
    "grpc-worker-abort-request-id-1mb": (
        "compute", COMPUTE, "Abort", pb.AbortRequest(request_id=BIG_NAME), INVALID,
        f"request_id: at least {MB} UTF-8 bytes exceed"),
    "grpc-routepreview-1m-token-prompt": (
        # Generate refuses it (no worker's context holds it); the preview did route it.
        "gateway", GATEWAY, "RoutePreview", _preview(_ids(*[1] * 1_000_000)),
        grpc.StatusCode.OUT_OF_RANGE, "prompt.token_ids: 1000000 tokens leave no room"),
    "grpc-gateway-generate-stop-token-ids-over-limit": (
        "gateway", COMPUTE, "Generate", _ids(1, 2, stop=MANY_STOP_IDS), INVALID,
        f"sampling.stop_token_ids: {MAX_STOP_TOKEN_IDS + 1} stop token ids exceed the limit"),
    "grpc-routepreview-stop-token-ids-over-limit": (
        "gateway", GATEWAY, "RoutePreview", _preview(_ids(1, 2, stop=MANY_STOP_IDS)), INVALID,
        f"sampling.stop_token_ids: {MAX_STOP_TOKEN_IDS + 1} stop token ids exceed the limit"),
    "grpc-worker-generate-stop-token-ids-over-limit": (
        "compute", COMPUTE, "Generate", _ids(1, 2, stop=MANY_STOP_IDS), INVALID,
        f"sampling.stop_token_ids: {MAX_STOP_TOKEN_IDS + 1} stop token ids exceed the limit"),
}


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_name_id_or_count_over_the_limit(stack, case):
    check_grpc_case(stack, *GRPC_CASES[case])


# id: (server, request) whose error echoes a name the client sent: quoted and cut.
ECHO_CASES = {
    "grpc-worker-generate-unknown-adapter-at-limit": (
        "compute", _with(_generate(), adapter="z" * MAX_NAME_BYTES)),
}


@pytest.mark.parametrize("case", list(ECHO_CASES))
def test_an_unknown_name_is_quoted_and_cut(stack, case):
    """NOT_FOUND naming the adapter, shown as quote_untrusted shows it: QUOTE_LIMIT characters
    and the size of the rest (a 10 MB name went into the trailing metadata whole, over gRPC's
    limit, and the gateway took the RESOURCE_EXHAUSTED for load and retried)."""
    server, request = ECHO_CASES[case]
    error = stack.call(server, COMPUTE, "Generate", request.SerializeToString())
    assert error is not None and error.code() == grpc.StatusCode.NOT_FOUND, error
    cut = MAX_NAME_BYTES - QUOTE_LIMIT
    assert error.details() == (f"adapter: '{'z' * QUOTE_LIMIT}'… (+{cut} chars) is not loaded "
                               "on this worker"), error.details()


# id: (path, body: a dict sent as JSON or raw bytes, status, param)
HTTP_CASES = {
    # A lone surrogate (valid JSON, not valid text): any string field names itself.
    "http-completions-prompt-lone-surrogate": (
        "/v1/completions", b'{"prompt": "\\ud800 hi", "max_tokens": 1}', 400, "prompt"),
    "http-completions-second-prompt-lone-surrogate": (
        "/v1/completions", b'{"prompt": ["hi", "a\\udc00"]}', 400, "prompt[1]"),
    "http-chat-content-lone-surrogate": (
        "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
        400, "messages[0].content"),
    "http-chat-content-part-lone-surrogate": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
        400, "messages[0].content[0].text"),
    "http-stop-lone-surrogate": (
        "/v1/completions", b'{"prompt": "hi", "stop": ["a", "\\ud800"]}', 400, "stop[1]"),
    "http-model-lone-surrogate": (
        "/v1/completions", b'{"prompt": "hi", "model": "\\ud800"}', 400, "model"),
    "http-user-lone-surrogate": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "user": "\\ud800"}', 400, "user"),
    # Stop strings and stop ids over prefixcache_client.limits.
    "http-stop-100000-strings": (
        "/v1/completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(100_000)]}, 400,
        "stop"),
    "http-stop-one-over-the-count": (
        "/v1/completions", {"prompt": "hi", "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, 400,
        "stop"),
    "http-stop-string-over-the-length": (
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                 "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, 400, "stop"),
    "http-stop-token-ids-over-the-count": (
        "/v1/completions", {"prompt": "hi", "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)},
        400, "stop_token_ids"),
    # Names: refused at parse, never echoed whole (the 404 body was the name's size).
    "http-model-1mb": ("/v1/completions", {"prompt": "hi", "model": BIG_NAME}, 400, "model"),
    "http-chat-model-1mb": (
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                 "model": BIG_NAME}, 400, "model"),
    "http-unknown-model-at-limit": (
        "/v1/completions", {"prompt": "hi", "model": "z" * MAX_NAME_BYTES}, 404, "model"),
}


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_http_text_stop_or_name_gets_a_clear_error(stack, case):
    check_http_case(stack, *HTTP_CASES[case])
