"""One trace across the real services: the gateway (HTTP and gRPC fronts), a compute worker, its
cache Step calls and its L3 load, all over real gRPC on loopback with a real Redis, exported to
the OpenTelemetry SDK's in-memory exporter. Also X-Request-Id (accepted, used, echoed) and the
gateway's access-log line."""
from __future__ import annotations

import logging

import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.core.discovery import WorkerAddress
from service_shell import tracing
from tests.compute_service.server_harness import greedy, prompt
from tests.gateway.gateway_harness import Caller
from tests.observed_stack import cache_service, gateway, worker

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT:016x}-01"


@pytest.fixture
def spans():
    """The process's tracer provider with an in-memory exporter (a provider can be set once per
    process: a later test adds its exporter to the same one), tracing on for the test."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.enable(True)
    try:
        yield exporter
    finally:
        tracing.enable(False)
        exporter.shutdown()


def test_one_trace_from_the_gateway_to_the_cache_step_and_the_l3_load(spans, redis_server,
                                                                        caplog):
    words = prompt(11, 33)
    with cache_service(redis_server.url) as cache:
        cache_address = f"127.0.0.1:{cache.port}"
        # Worker 1 computes the prompt and writes its pages through to Redis (untraced).
        with worker("t-one", cache_address, redis_server.url) as (one, client):
            client.generate(words, greedy(2)).result()
            assert one.engine.flush_l3()
        spans.clear()
        with worker("t-two", cache_address, redis_server.url) as (two, _):
            address = WorkerAddress(f"127.0.0.1:{two.port}", cache_address)
            with gateway([address]) as gw:
                caller = Caller(gw.address)
                base = f"http://127.0.0.1:{gw.http_port}"
                # For the rest of the test: the line is written once the response has gone
                # out (request_log.py), which may be after the client has it.
                caplog.set_level(logging.INFO, logger="gateway.access")
                r = httpx.post(base + "/v1/completions", timeout=60, json={
                    "prompt": words, "max_tokens": 3, "temperature": 0},
                    headers={"traceparent": TRACEPARENT, "X-Request-Id": "trace-me-1"})
                assert r.status_code == 200, r.text
                body = r.json()
                # The gRPC front: its own span, the same propagation.
                caller.generate(prompt(90, 9), None, extra=(("traceparent", TRACEPARENT),))
                caller.close()
    assert r.headers["x-request-id"] == "trace-me-1" and body["id"] == "cmpl-trace-me-1"
    assert body["usage"]["prefixcache"]["cached_tokens_remote"] == 32  # loaded from L3

    by_name: dict[str, list] = {}
    for s in spans.get_finished_spans():
        by_name.setdefault(s.name, []).append(s)
    http = by_name["gateway.http POST /v1/completions"]
    assert len(http) == 1 and http[0].parent.span_id == PARENT
    assert http[0].attributes["prefixcache.request_id"] == "trace-me-1"
    assert http[0].attributes["http.response.status_code"] == 200
    assert http[0].attributes["prefixcache.worker"] == "t-two"
    generate = by_name["gateway.Generate"]
    assert len(generate) == 1 and generate[0].parent.span_id == PARENT
    workers = by_name["worker.Generate"]
    parents = sorted(w.parent.span_id for w in workers)
    assert parents == sorted([http[0].context.span_id, generate[0].context.span_id])
    traced = next(w for w in workers if w.parent.span_id == http[0].context.span_id)
    assert traced.attributes["prefixcache.cached_tokens_remote"] == 32
    steps = [s for s in by_name["cache.Step"] if s.parent.span_id == traced.context.span_id]
    assert steps and all(s.attributes["rpc.method"] == "Step" for s in steps)
    # The cache service's side of those calls, each under the worker's span of it.
    step_ids = {s.context.span_id for s in by_name["cache.Step"]}
    served = [s for s in by_name["cache_service.Step"] if s.parent.span_id in step_ids]
    assert served and {s.attributes["prefixcache.pool_id"] for s in served} == {"t-two"}
    [load] = by_name["l3.load"]
    assert load.parent.span_id == traced.context.span_id
    assert load.attributes["prefixcache.pages_loaded"] == 8
    # Every span of both calls is in the caller's trace.
    assert {s.context.trace_id for s in spans.get_finished_spans()} == {TRACE_ID}

    [line] = [r.getMessage() for r in caplog.records if r.name == "gateway.access"
              and "path=/v1/completions" in r.getMessage()]
    for field in ("event=http_request", "method=POST", "status=200", "tenant=anonymous",
                  "request_id=trace-me-1", "prompt_tokens=33", "cached_tokens=32",
                  "completion_tokens=3", "duration_ms="):
        assert field in line, line


def test_tracing_off_sends_no_trace_context_and_makes_no_span():
    """Off (the default): inject adds nothing, extract reads nothing, start makes no span."""
    tracing.enable(False)
    assert tracing.inject((("a", "b"),)) == (("a", "b"),)
    assert tracing.extract([("traceparent", TRACEPARENT)]) is None
    assert tracing.start(tracing.tracer("t"), "x", None) is None


@pytest.mark.parametrize("flag, env, want", [
    (None, {}, False), (True, {}, True), (None, {"OTEL_TRACES_EXPORTER": "otlp"}, True),
    (False, {"OTEL_TRACES_EXPORTER": "otlp"}, False), (None, {"OTEL_TRACES_EXPORTER": "none"}, False),
    (True, {"OTEL_SDK_DISABLED": "true"}, False)])
def test_tracing_is_wanted_by_the_flag_or_the_standard_variables(flag, env, want):
    assert tracing.wanted(flag, env) is want


def test_request_ids_from_headers_over_grpc_and_http(redis_server):
    """gRPC: `x-request-id` metadata names a request that sets no id, and the id comes back as
    initial metadata. HTTP: an unusable X-Request-Id is replaced, never refused, and echoed."""
    with cache_service(redis_server.url) as cache:
        cache_address = f"127.0.0.1:{cache.port}"
        with worker("ids", cache_address, redis_server.url) as (server, _):
            address = WorkerAddress(f"127.0.0.1:{server.port}", cache_address)
            with gateway([address]) as gw:
                caller = Caller(gw.address)
                call = caller.stream(prompt(3, 9), None, extra=(("x-request-id", "grpc-id-7"),))
                messages = list(call)
                assert dict(call.initial_metadata())["x-request-id"] == "grpc-id-7"
                assert messages[-1].stats.request_id == "grpc-id-7"
                call = caller.stream(prompt(4, 9), None, request_id="own-id",
                                     extra=(("x-request-id", "ignored"),))
                list(call)  # the field wins over the header
                assert dict(call.initial_metadata())["x-request-id"] == "own-id"
                caller.close()
                base = f"http://127.0.0.1:{gw.http_port}"
                for sent in ("x" * 200, "has space\u00e9"):
                    r = httpx.post(base + "/v1/completions", timeout=60,
                                   json={"prompt": prompt(5, 9), "max_tokens": 2},
                                   headers={"X-Request-Id": sent.encode("utf-8")})
                    assert r.status_code == 200, r.text
                    echoed = r.headers["x-request-id"]
                    assert echoed != sent and len(echoed) == 32 and r.json()["id"].endswith(echoed)
                r = httpx.get(base + "/v1/models", headers={"X-Request-Id": "models-1"})
                assert r.headers["x-request-id"] == "models-1"
