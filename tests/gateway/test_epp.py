"""The gateway's Endpoint Picker (gateway/epp/) over loopback: a real gRPC channel to its
ext_proc port, Envoy's own messages (the xds-protos package), a gateway over a cache service and
two fake workers. What a data plane (Envoy) would do with the answers is done by hand: the
request goes to the named endpoint with the mutated headers."""
from __future__ import annotations

import queue
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from google.protobuf import struct_pb2
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from service_shell import request_scope
from service_shell.service_token import with_service_token
from tests.gateway.gateway_harness import DATAPLANE_TOKEN, wait_until
from tests.gateway.gateway_harness import request as generate_request
from tests.gateway.helpers import settles
from tests.gateway.server_helpers import SERVING, cached_on, fake_fleet, preview, prompt, sample

DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
GENERATE = "/prefixcache.v1.ComputeService/Generate"
DEST = "x-gateway-destination-endpoint"


@pytest.fixture
def fleet():
    with fake_fleet(epp_port=0) as f:
        gw = f[0]
        channel = grpc.insecure_channel(gw.epp.address)
        try:  # the data plane's own identity, as Envoy presents it
            yield (*f, ep_grpc.ExternalProcessorStub(with_service_token(channel, DATAPLANE_TOKEN)),
                   channel)
        finally:
            channel.close()


def cache_view(fleet):
    """The (gateway, cache, workers, caller) that server_helpers.cached_on takes."""
    gw, cache, workers, _, caller, _, _ = fleet
    return gw, cache, workers, caller


def grpc_body(message) -> bytes:
    data = message.SerializeToString()
    return b"\0" + len(data).to_bytes(4, "big") + data


def headers(path: str = GENERATE, token: str | None = "tok-a",
            extra: tuple[tuple[str, str], ...] = ()) -> list[tuple[str, str]]:
    out = [(":method", "POST"), (":path", path), (":authority", "pool.example"),
           ("content-type", "application/grpc"), ("te", "trailers")]
    if token:
        out.append(("authorization", f"Bearer {token}"))
    return out + list(extra)


def messages(hdrs, body: bytes | None, mode=DUPLEX, subset=None) -> list[ep.ProcessingRequest]:
    """What Envoy's ext_proc filter sends for one request: its headers (with the protocol
    configuration and the subset hint), then its body."""
    first = ep.ProcessingRequest(
        request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[
            base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in hdrs]),
            end_of_stream=body is None),
        protocol_config=ep.ProtocolConfiguration(request_body_mode=mode,
                                                 response_body_mode=mode))
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.fields["x-gateway-destination-endpoint-subset"].list_value.extend(subset)
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    out = [first]
    if body is not None:
        half = len(body) // 2  # in two chunks, as a data plane may stream it
        out += [ep.ProcessingRequest(request_body=ep.HttpBody(body=body[:half])),
                ep.ProcessingRequest(request_body=ep.HttpBody(body=body[half:],
                                                              end_of_stream=True))]
    return out


def process(stub, msgs) -> list[ep.ProcessingResponse]:
    return list(stub.Process(iter(msgs), timeout=10))


def picked(responses: list[ep.ProcessingResponse]) -> tuple[str, dict[str, str], list[str]]:
    """(endpoint, headers set, headers removed) of a picking answer; asserts the header and
    the dynamic metadata agree, as the EPP protocol requires."""
    answer = next(r for r in responses if r.HasField("dynamic_metadata"))
    common = (answer.request_headers.response if answer.HasField("request_headers")
              else answer.request_body.response)
    assert common.clear_route_cache
    set_headers = {h.header.key: h.header.raw_value.decode()
                   for h in common.header_mutation.set_headers}
    meta = answer.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    assert set_headers[DEST] == meta
    return meta, set_headers, list(common.header_mutation.remove_headers)


def returned_body(responses: list[ep.ProcessingResponse]) -> bytes:
    chunks = [r.request_body.response.body_mutation.streamed_response for r in responses
              if r.HasField("request_body")]
    assert chunks and chunks[-1].end_of_stream
    return b"".join(c.body for c in chunks)


def refusal(responses: list[ep.ProcessingResponse]) -> ep.ImmediateResponse:
    assert len(responses) == 1 and responses[0].HasField("immediate_response"), responses
    return responses[0].immediate_response


def test_generate_goes_to_the_worker_the_policy_picks(fleet):
    gw, cache, workers, addresses, caller, stub, _ = fleet
    tokens = prompt(1)
    cached_on(cache_view(fleet), "w2", tokens)
    assert preview(caller, tokens).worker == "w2"
    body = grpc_body(generate_request(tokens, request_id="r-1"))
    spoofed = (("x-prefixcache-salt", "salt-b"), ("x-prefixcache-service-token", "forged"),
               ("x-prefixcache-request-scope", "someone-else"))
    responses = process(stub, messages(headers(extra=spoofed), body))
    endpoint, set_headers, removed = picked(responses)
    assert endpoint == workers["w2"].address
    # Duplex: the headers answer first (held until the body was read), then the body back.
    assert responses[0].HasField("request_headers")
    assert returned_body(responses) == body
    # The worker gets the tenant's salt (never the client's), no tenant token, no forged token.
    assert set_headers["x-prefixcache-salt"] == "salt-a"
    # ... and the tenant's request-id scope (never the client's): ids are unique per tenant.
    assert set_headers["x-prefixcache-request-scope"] == request_scope("tenant-a")
    assert {"authorization", "x-prefixcache-service-token"} <= set(removed)
    assert sample(gw, "prefixcache_gateway_epp_picks_total", worker="w2", outcome="picked") == 1
    # What the data plane then does: the call, with those headers, to that endpoint.
    with grpc.insecure_channel(endpoint) as channel:
        out = list(pb_grpc.ComputeServiceStub(channel).Generate(
            generate_request(tokens, request_id="r-1"), timeout=10,
            metadata=[("x-prefixcache-salt", set_headers["x-prefixcache-salt"])]))
    assert out[-1].stats.worker == "w2"
    assert workers["w2"].seen[-1].salts == ["salt-a"]


def test_a_shared_prefix_follows_the_first_request(fleet):
    _, _, workers, _, _, stub, _ = fleet
    first = prompt(7, 64)
    a, _, _ = picked(process(stub, messages(headers(), grpc_body(generate_request(first)))))
    for extra in (8, 24):  # same prefix, longer prompts: the policy's recent pages
        longer = first + prompt(9, extra)
        b, _, _ = picked(process(stub, messages(headers(), grpc_body(generate_request(longer)))))
        assert b == a
    assert a in {w.address for w in workers.values()}


def test_a_pick_applies_its_decisions_record_once_its_answer_is_sent(fleet):
    """The decision queues its record of the pages it routed (routed_prefixes.py); the picker
    applies it after answering, not the next decision."""
    gw, _, workers, _, _, stub, _ = fleet
    with settles(gw.router) as queued_after:
        endpoint, _, _ = picked(process(stub, messages(headers(),
                                                       grpc_body(generate_request(prompt(33))))))
    assert queued_after == [0]
    name = next(n for n, w in workers.items() if w.address == endpoint)
    assert gw.router.policy.recent.size(name) > 0


def test_buffered_mode_answers_the_headers_at_once_and_names_the_worker_with_the_body(fleet):
    _, _, workers, _, _, stub, _ = fleet
    tokens = prompt(3)
    cached_on(cache_view(fleet), "w1", tokens)
    responses = process(stub, messages(headers(), grpc_body(generate_request(tokens)),
                                       mode=BUFFERED))
    assert responses[0].HasField("request_headers")
    assert not responses[0].request_headers.response.header_mutation.set_headers
    assert responses[-1].HasField("request_body")
    assert picked(responses)[0] == workers["w1"].address


def test_the_subset_hint_limits_the_choice(fleet):
    _, _, workers, _, _, stub, _ = fleet
    tokens = prompt(4)
    cached_on(cache_view(fleet), "w2", tokens)
    body = grpc_body(generate_request(tokens))
    only_w1 = [workers["w1"].address]
    assert picked(process(stub, messages(headers(), body, subset=only_w1)))[0] == only_w1[0]
    refused = refusal(process(stub, messages(headers(), body, subset=["10.9.9.9:50052"])))
    assert refused.status.code == 503 and refused.grpc_status.status == 14
    assert "subset" in refused.body.decode()


def test_refusals_are_immediate_responses_with_the_grpc_status(fleet):
    gw, _, _, _, _, stub, _ = fleet
    tokens = prompt(5)
    bad = refusal(process(stub, messages(headers(), b"\0\0\0\0\x09garbage")))
    assert bad.status.code == 400 and bad.grpc_status.status == 3 and b"body" in bad.body
    unknown = refusal(process(stub, messages(headers(token="nope"),
                                             grpc_body(generate_request(tokens)))))
    assert unknown.status.code == 401 and unknown.grpc_status.status == 16
    assert b"authorization" in unknown.body
    for name in ("w1", "w2"):
        gw.router.set_up(name, False)
    down = refusal(process(stub, messages(headers(), grpc_body(generate_request(tokens)))))
    assert down.status.code == 503 and down.grpc_status.status == 14
    assert sample(gw, "prefixcache_gateway_epp_picks_total", worker="",
                  outcome="bad_request") == 1
    assert sample(gw, "prefixcache_gateway_epp_picks_total", worker="",
                  outcome="unavailable") == 1


def test_a_generate_loads_its_worker_until_the_stream_ends(fleet):
    gw, _, workers, _, _, stub, _ = fleet
    q: queue.Queue = queue.Queue()
    for m in messages(headers(), grpc_body(generate_request(prompt(6), request_id="r-9"))):
        q.put(m)
    call = stub.Process(iter(q.get, None), timeout=10)
    first = next(call)
    assert first.HasField("request_headers")
    endpoint = first.request_headers.response.header_mutation.set_headers[0].header.raw_value
    name = next(n for n, w in workers.items() if w.address == endpoint.decode())
    inflight = lambda: gw.router.load.get(name).inflight_requests  # noqa: E731
    assert inflight() == 1
    # An Abort of that request through the data plane goes to the worker that runs it.
    abort = process(stub, messages(headers(path="/prefixcache.v1.ComputeService/Abort"),
                                   grpc_body(pb.AbortRequest(request_id="r-9"))))
    assert picked(abort)[0] == endpoint.decode()
    q.put(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"\0\0\0\0\0",
                                                         end_of_stream=True)))
    q.put(None)
    rest = list(call)
    assert rest[-1].response_body.response.body_mutation.streamed_response.end_of_stream
    assert inflight() == 0


def test_epp_health_follows_readiness(fleet):
    _, _, _, _, _, _, channel = fleet
    health = health_pb2_grpc.HealthStub(channel)
    status = lambda name: health.Check(health_pb2.HealthCheckRequest(service=name),  # noqa: E731
                                       timeout=5).status
    wait_until(lambda: status("readiness") == SERVING, what="EPP readiness")
    for name in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert status(name) == SERVING, name


def test_abort_goes_only_to_the_worker_running_the_tenants_request(fleet):
    gw, _, workers, _, _, stub, _ = fleet
    abort = lambda rid, token="tok-a": process(stub, messages(  # noqa: E731
        headers(path="/prefixcache.v1.ComputeService/Abort", token=token),
        grpc_body(pb.AbortRequest(request_id=rid))))
    # Nothing of this tenant runs as r-x: no worker gets an Abort that could end another
    # tenant's request of the same id.
    missing = refusal(abort("r-x"))
    assert missing.status.code == 404 and missing.grpc_status.status == 5
    # A request running through the gateway itself is found there.
    gate = threading.Event()  # the request runs until the test ends it
    for w in workers.values():
        w.gate = gate
    stream = fleet[4].stream(prompt(8), request_id="r-gw")
    try:
        first = next(stream)
        assert first.token_ids
        where = gw.running.get(gw.config.tenants.authenticate(
            [("authorization", "Bearer tok-a")]), "r-gw").worker.address
        assert picked(abort("r-gw"))[0] == where
        assert refusal(abort("r-gw", token="tok-b")).status.code == 404  # not tenant b's
    finally:
        for w in workers.values():
            w.gate = None
        gate.set()
        stream.cancel()


def test_calls_the_gateway_would_not_make_are_not_routed(fleet):
    _, _, _, _, _, stub, _ = fleet
    # GetModelInfo and GetTokenizer too: the data plane's identity may not call them on a
    # worker (they are the gateway's own calls).
    for path in ("/prefixcache.v1.ComputeService/LoadAdapter", "/v1/chat/completions",
                 "/prefixcache.v1.ComputeService/GetModelInfo",
                 "/prefixcache.v1.ComputeService/GetTokenizer"):
        out = refusal(process(stub, messages(headers(path=path), b"{}")))
        assert out.status.code == 404 and b"not routed here" in out.body, path


def test_the_flag_and_its_variable_turn_the_epp_on(monkeypatch, tmp_path, capsys):
    from gateway.__main__ import config_from_args, parse_args
    identities = tmp_path / "ids.json"
    identities.write_text('{"identities": [{"name": "envoy", "role": "dataplane", '
                          f'"token": "{DATAPLANE_TOKEN}"}}]}}')
    base = ["--workers", "127.0.0.1:50052", "--allow-anonymous"]
    assert config_from_args(parse_args(base)).epp_port is None
    with pytest.raises(SystemExit):  # the EPP authenticates its callers, or does not start
        parse_args([*base, "--epp-port", "9002"])
    assert "--epp-port needs --service-identities-file" in capsys.readouterr().err
    base.append(f"--service-identities-file={identities}")
    config = config_from_args(parse_args([*base, "--epp-port", "9002"]))
    assert config.epp_port == 9002 and len(config.epp_callers) == 1
    monkeypatch.setenv("PREFIXCACHE_EPP_PORT", "9003")
    assert config_from_args(parse_args(base)).epp_port == 9003


def test_the_drain_closes_the_epp_port(fleet):
    gw, _, _, _, _, stub, channel = fleet
    health = health_pb2_grpc.HealthStub(channel)
    gw.drain()
    with pytest.raises(grpc.RpcError) as err:
        health.Check(health_pb2.HealthCheckRequest(service="readiness"), timeout=5)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
