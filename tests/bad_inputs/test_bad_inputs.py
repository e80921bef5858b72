"""Every bad input we know of, sent to the real services over loopback, must get a clear answer:
a status code that says it is the caller's fault (INVALID_ARGUMENT, or RESOURCE_EXHAUSTED for a
message over the gRPC size limit; an HTTP 4xx with OpenAI's error JSON) and a message that
names the field. Each parametrized id below is one bad input: `pytest --collect-only -q
tests/bad_inputs` lists them all (design.md §8 "Bad input").

- utf8-*: every string field of every request message of every service each server answers
  (health included), from the descriptors, so a new field is covered without editing this file;
  sent with bytes that are not UTF-8 (gRPC Python used to answer INTERNAL "Exception
  deserializing request!" before any servicer code ran).
- float-*: every float/double field of the request messages, from the descriptors, with NaN,
  +-inf, a negative value and the values just outside its documented bounds.
- grpc-* and http-*: the vocabulary bound, prompts over the size limit, broken wire bytes, bad
  JSON numbers and bodies.
- flag-*: float flags and their environment variables (NaN, inf, negative).
- names, ids, stop sequences and lone surrogates: test_limits.py; the Endpoint Picker:
  test_epp_bad_inputs.py.
"""
from __future__ import annotations

import json
import math

import grpc
import httpx
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health_pb2

from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import common_pb2
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import gateway_pb2 as gpb
from prefixcache_client.limits import QUOTE_LIMIT, TEXT_BYTES_PER_TOKEN
from tests.bad_inputs.stack import (CACHE, COMPUTE, FLOAT_POOL, GATEWAY, GATEWAY_CONTEXT,
                                    GATEWAY_MAX_MESSAGE_MB, GATEWAY_VOCAB, SERVICES,
                                    WORKER_CONTEXT, field_paths, running_stack, set_along)
from tests.compute_service.server_harness import VOCAB as WORKER_VOCAB

INVALID = grpc.StatusCode.INVALID_ARGUMENT
HEALTH = health_pb2.DESCRIPTOR.services_by_name["Health"]
MARK = "Q7xZ"  # set in the field, then replaced by as many bytes that are not UTF-8
NOT_UTF8 = b"\xc3\x28\xa0\xa1"  # a lead byte without its continuation, then stray ones
TEXT_LIMIT = {"gateway": GATEWAY_CONTEXT * TEXT_BYTES_PER_TOKEN,
              "compute": WORKER_CONTEXT * TEXT_BYTES_PER_TOKEN}


@pytest.fixture(scope="module")
def stack(one_torch_thread):
    with running_stack() as s:
        yield s


def _new(descriptor):
    return message_factory.GetMessageClass(descriptor)()


# ----- invalid UTF-8 in every string field --------------------------------------------------

UTF8_CASES = [
    pytest.param(server, service, method.name, path, chain,
                 id=f"utf8-{server}-{service.name}.{method.name}-{path}")
    for server, services in SERVICES.items()
    for service in (*services, HEALTH)
    for method in service.methods
    for path, chain in field_paths(method.input_type, {FieldDescriptor.TYPE_STRING})]


@pytest.mark.parametrize("server, service, method, path, chain", UTF8_CASES)
def test_invalid_utf8_names_the_field(stack, server, service, method, path, chain):
    request = _new(service.methods_by_name[method].input_type)
    set_along(request, chain, MARK)
    data = request.SerializeToString()
    assert data.count(MARK.encode()) == 1
    error = stack.call(server, service, method, data.replace(MARK.encode(), NOT_UTF8))
    assert error is not None and error.code() == INVALID, error
    assert error.details() == f"field '{path}' is not valid UTF-8"


def test_every_service_has_string_fields_covered():
    """The walk found the fields the issue reported (and more): a broken walk would pass the
    parametrized test vacuously."""
    paths = {(c.values[0], c.values[2], c.values[3]) for c in UTF8_CASES}
    for expected in [("cache", "Step", "matches[0].namespace.salt"),
                     ("cache", "Subscribe", "pool_id"),
                     ("compute", "Generate", "prompt.text"),
                     ("gateway", "Generate", "prompt.text"),
                     ("gateway", "RoutePreview", "request.prompt.text"),
                     ("gateway", "Check", "service")]:
        assert expected in paths
    assert len(UTF8_CASES) >= 40


# ----- every float field: NaN, infinities, negatives, out of bounds -----------------------

def _generate() -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 2, 3]),
                              sampling=pb.SamplingParams(max_tokens=1))


# A valid request of each method with a float field, so that the float is what is refused.
BASE = {
    ("cache", "RegisterPool"): lambda: cpb.RegisterPoolRequest(
        pool_id="float-register", epoch=1, page_size=4, device_pages=16, model_id="m"),
    ("cache", "Step"): lambda: cpb.StepRequest(
        pool_id=FLOAT_POOL, epoch=1, matches=[cpb.MatchOp(request_id="r", token_ids=[1, 2, 3])],
        load=common_pb2.LoadReport(timestamp=1.0)),
    ("cache", "Subscribe"): lambda: cpb.SubscribeRequest(pool_id=FLOAT_POOL, after_seq=-1),
    ("compute", "Generate"): _generate,
    ("gateway", "Generate"): _generate,
    ("gateway", "RoutePreview"): lambda: gpb.RoutePreviewRequest(request=_generate()),
}
# Beyond NaN, +-inf and -1: the values just outside each field's documented bounds.
EXTRA_BAD = {"heartbeat_interval_s": [0.01, 61.0], "temperature": [101.0], "top_p": [1.5],
             "lease_ttl_s": [1e9], "presence_penalty": [2.5, -2.5],
             "frequency_penalty": [2.5, -2.5], "repetition_penalty": [0.0, 101.0],
             "min_p": [1.5], "bias": [101.0, -101.0]}
# Fields for which -1 is a valid value (penalties and biases may be negative).
NEGATIVE_OK = {"presence_penalty", "frequency_penalty", "bias"}
FLOAT_FIELDS = [(server, service, method.name, path, chain)
                for server, services in SERVICES.items() for service in services
                for method in service.methods
                for path, chain in field_paths(method.input_type, {FieldDescriptor.TYPE_FLOAT,
                                                                   FieldDescriptor.TYPE_DOUBLE})]
FLOAT_CASES = [
    pytest.param(server, service, method, path, chain, value,
                 id=f"float-{server}-{method}-{path}={value!r}")
    for server, service, method, path, chain in FLOAT_FIELDS
    for value in [math.nan, math.inf, -math.inf,
                  *([] if chain[-1].name in NEGATIVE_OK else [-1.0]),
                  *EXTRA_BAD.get(chain[-1].name, [])]]


def test_every_float_field_has_a_valid_request():
    assert {(s, m) for s, _, m, _, _ in FLOAT_FIELDS} == set(BASE)
    assert len(FLOAT_FIELDS) >= 10


@pytest.mark.parametrize("server, service, method, path, chain, value", FLOAT_CASES)
def test_bad_float_names_the_field(stack, server, service, method, path, chain, value):
    request = BASE[(server, method)]()
    set_along(request, chain, value)
    error = stack.call(server, service, method, request.SerializeToString())
    assert error is not None and error.code() == INVALID, error
    # RoutePreview names the fields of the request it previews as Generate does.
    assert error.details().startswith(path.removeprefix("request.") + ":"), error.details()


def test_the_base_requests_are_valid(stack):
    """Each BASE request is accepted as it is (so the float cases test the float)."""
    for (server, method), build in BASE.items():
        service = {"Generate": COMPUTE, "RoutePreview": GATEWAY}.get(method, CACHE)
        if method == "Subscribe":
            continue  # a valid stream never ends; its refusal is immediate, as the cases show
        request = build()
        if method == "RegisterPool":
            request.pool_id = "float-register-ok"
        assert stack.call(server, service, method, request.SerializeToString()) is None, method


# ----- other gRPC inputs ---------------------------------------------------------------------

def _text(n_bytes: int, char: str = "a") -> pb.GenerateRequest:
    request = _generate()
    request.text = char * (n_bytes // len(char.encode()))
    return request


def _ids(*ids: int, stop: tuple[int, ...] = ()) -> pb.GenerateRequest:
    request = _generate()
    request.token_ids.ids[:] = ids
    request.sampling.stop_token_ids.extend(stop)
    return request


def _preview(request: pb.GenerateRequest) -> gpb.RoutePreviewRequest:
    return gpb.RoutePreviewRequest(request=request)


GATEWAY_OVER = TEXT_LIMIT["gateway"] + 1
WORKER_OVER = TEXT_LIMIT["compute"] + 1
# id: (server, service, method, request bytes, code, what the message starts with)
GRPC_CASES = {
    "grpc-routepreview-token-id-equal-to-vocab": (
        "gateway", GATEWAY, "RoutePreview", _preview(_ids(1, GATEWAY_VOCAB)), INVALID,
        f"prompt.token_ids: {GATEWAY_VOCAB} is outside the vocabulary"),
    "grpc-routepreview-stop-token-id-equal-to-vocab": (
        "gateway", GATEWAY, "RoutePreview", _preview(_ids(1, stop=(GATEWAY_VOCAB,))), INVALID,
        f"sampling.stop_token_ids: {GATEWAY_VOCAB} is outside"),
    "grpc-gateway-generate-token-id-equal-to-vocab": (
        "gateway", COMPUTE, "Generate", _ids(1, GATEWAY_VOCAB), INVALID,
        f"prompt.token_ids: {GATEWAY_VOCAB} is outside the vocabulary"),
    "grpc-worker-generate-token-id-equal-to-vocab": (
        "compute", COMPUTE, "Generate", _ids(1, WORKER_VOCAB), INVALID,
        f"prompt.token_ids: {WORKER_VOCAB} is outside the vocabulary"),
    "grpc-gateway-generate-text-just-over-limit": (
        "gateway", COMPUTE, "Generate", _text(GATEWAY_OVER), INVALID,
        f"prompt.text: at least {GATEWAY_OVER} bytes exceed the limit of "
        f"{TEXT_LIMIT['gateway']} bytes"),
    "grpc-routepreview-text-just-over-limit": (
        "gateway", GATEWAY, "RoutePreview", _preview(_text(GATEWAY_OVER)), INVALID,
        "prompt.text: at least"),
    "grpc-worker-generate-text-just-over-limit": (
        "compute", COMPUTE, "Generate", _text(WORKER_OVER), INVALID,
        f"prompt.text: at least {WORKER_OVER} bytes exceed the limit of "
        f"{TEXT_LIMIT['compute']} bytes"),
    "grpc-worker-generate-multibyte-text-just-over-limit": (
        # Fewer characters than the limit, more bytes: the byte count decides.
        "compute", COMPUTE, "Generate", _text(TEXT_LIMIT["compute"] + 2, "é"), INVALID,
        f"prompt.text: {TEXT_LIMIT['compute'] + 2} bytes exceed"),
    "grpc-gateway-generate-over-max-message-size": (
        "gateway", COMPUTE, "Generate", _text((GATEWAY_MAX_MESSAGE_MB << 20) + 1),
        grpc.StatusCode.RESOURCE_EXHAUSTED, "SERVER: Received message larger than max"),
    "grpc-worker-generate-truncated-message": (
        "compute", COMPUTE, "Generate", b"\x12\xff\x01abc", INVALID,
        "request is not a valid prefixcache.v1.GenerateRequest"),
    "grpc-cache-step-garbage-bytes": (
        "cache", CACHE, "Step", b"\xff\xff\xff\xff", INVALID,
        "request is not a valid prefixcache.v1.StepRequest"),
    "grpc-gateway-routepreview-garbage-bytes": (
        "gateway", GATEWAY, "RoutePreview", b"\x0a\x05\x12\x09", INVALID,
        "request is not a valid prefixcache.v1.RoutePreviewRequest"),
}


@pytest.mark.parametrize("case", list(GRPC_CASES))
def test_grpc_bad_input_gets_a_clear_error(stack, case):
    check_grpc_case(stack, *GRPC_CASES[case])


def check_grpc_case(stack, server, service, method, request, code, starts) -> None:
    """The call gets `code` and a message that starts with `starts` (the field)."""
    data = request if isinstance(request, bytes) else request.SerializeToString()
    error = stack.call(server, service, method, data)
    assert error is not None and error.code() == code, error
    assert error.details().startswith(starts), error.details()
    assert len(error.details()) < 1000  # nothing the client sent is echoed whole


def test_a_prompt_at_the_limit_is_not_refused_for_its_size(stack):
    """At the limit the text is tokenized and judged by its tokens (too many for the context:
    OUT_OF_RANGE), not refused unread."""
    error = stack.call("compute", COMPUTE, "Generate",
                       _text(TEXT_LIMIT["compute"]).SerializeToString())
    assert error is not None and error.code() == grpc.StatusCode.OUT_OF_RANGE, error


# ----- HTTP ----------------------------------------------------------------------------------

def _chunks(size: int):
    yield b'{"prompt": "'
    sent = 0
    while sent < size:
        yield b"a" * 65536
        sent += 65536
    yield b'"}'


HTTP_MAX_BODY = GATEWAY_MAX_MESSAGE_MB << 20
# id: (path, body: a dict sent as JSON or raw bytes / an iterator of bytes, status, param)
HTTP_CASES = {
    "http-completions-text-just-over-limit": (
        "/v1/completions", {"prompt": "a" * GATEWAY_OVER, "max_tokens": 1}, 400, "prompt"),
    "http-completions-second-prompt-over-limit": (
        "/v1/completions", {"prompt": ["hi", "a" * GATEWAY_OVER]}, 400, "prompt[1]"),
    "http-chat-messages-over-limit": (
        "/v1/chat/completions", {"messages": [{"role": "system", "content": "hi"}, {
            "role": "user", "content": "a" * GATEWAY_OVER}]}, 400, "messages"),
    "http-completions-token-id-equal-to-vocab": (
        "/v1/completions", {"prompt": [1, GATEWAY_VOCAB]}, 400, "prompt"),
    "http-body-over-limit-content-length": (
        "/v1/completions", b'{"prompt": "' + b"a" * HTTP_MAX_BODY + b'"}', 413, "body"),
    "http-body-over-limit-chunked": ("/v1/completions", _chunks, 413, "body"),
    "http-temperature-nan": (
        "/v1/completions", b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    "http-top-p-infinity": (
        "/v1/completions", b'{"prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    "http-temperature-minus-infinity": (
        "/v1/chat/completions",
        b'{"messages": [{"role": "user", "content": "hi"}], "temperature": -Infinity}', 400,
        "temperature"),
    "http-temperature-over-100": (
        "/v1/completions", {"prompt": "hi", "temperature": 101.0}, 400, "temperature"),
    "http-body-not-utf8": ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "body"),
}


@pytest.mark.parametrize("case", list(HTTP_CASES))
def test_http_bad_input_gets_a_clear_error(stack, case):
    check_http_case(stack, *HTTP_CASES[case])


def check_http_case(stack, path, body, status, param) -> None:
    """The POST gets `status` and OpenAI's error JSON naming `param`."""
    headers = {"Authorization": "Bearer tok-a", "Content-Type": "application/json"}
    if isinstance(body, dict):
        content = json.dumps(body).encode()
    elif callable(body):
        content = body(HTTP_MAX_BODY)  # an iterator: sent chunked, no Content-Length
    else:
        content = body
    r = httpx.post(stack.http + path, content=content, headers=headers, timeout=60.0)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param, error
    # The message starts with the field: the API's name, or the worker's (prompt.token_ids).
    assert error["message"].split(":")[0] in (param, "prompt.token_ids"), error
    assert len(r.content) < 1000, len(r.content)  # nothing the client sent is echoed whole
    assert "z" * (QUOTE_LIMIT + 1) not in r.text, r.text  # an echoed name is cut


# ----- float flags ---------------------------------------------------------------------------

FLAG_CASES = {
    "flag-cache-grace-nan": ("cache_service", ["--grace-s", "nan"], {}, "--grace-s"),
    "flag-cache-max-lease-ttl-inf": ("cache_service", ["--max-lease-ttl-s", "inf"], {},
                                     "--max-lease-ttl-s"),
    "flag-cache-drain-delay-env-negative": ("cache_service", [], {"DRAIN_DELAY_S": "-1"},
                                            "--drain-delay-s"),
    "flag-compute-lease-ttl-nan": ("compute_service", ["--lease-ttl-s", "nan"], {},
                                   "--lease-ttl-s"),
    "flag-compute-grace-env-inf": ("compute_service", [], {"GRACE_S": "inf"}, "--grace-s"),
    "flag-gateway-heartbeat-nan": ("gateway", ["--heartbeat-interval-s", "nan"], {},
                                   "--heartbeat-interval-s"),
    "flag-gateway-heartbeat-below-bound": ("gateway", ["--heartbeat-interval-s", "0.001"], {},
                                           "--heartbeat-interval-s"),
    "flag-gateway-generate-timeout-inf": ("gateway", ["--generate-timeout-s", "inf"], {},
                                          "--generate-timeout-s"),
}


@pytest.mark.parametrize("case", list(FLAG_CASES))
def test_bad_float_flag_is_a_usage_error(case, monkeypatch, capsys):
    import importlib

    module, argv, env, flag = FLAG_CASES[case]
    for name, value in env.items():
        monkeypatch.setenv(f"PREFIXCACHE_{name}", value)
    main = importlib.import_module(f"{module}.__main__")
    base = {"gateway": ["--workers", "127.0.0.1:1", "--allow-anonymous"]}.get(module, [])
    with pytest.raises(SystemExit) as exit_:
        main.parse_args([*base, *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: must be a finite number" in err, err
