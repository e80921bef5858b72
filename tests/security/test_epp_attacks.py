"""Issue 25 finding 1: the Endpoint Picker handed the gateway's service token to any tenant. A
client that opened an ext_proc stream to --epp-port with its own tenant bearer got back a header
mutation carrying `x-prefixcache-service-token` = the gateway's token, and with it read another
tenant's cached prompt from a cache service and followed a worker's event stream.

Now the EPP serves only the data plane's identity (role `dataplane`, a token in the ext_proc
gRPC metadata or a named client certificate): a tenant's bearer, an unknown token or another
role's token is refused before anything is read; and no answer to any caller, the data plane
included, carries a credential: the data plane reaches workers with its own token, which Envoy
adds itself (tests/gateway/envoy_proxy.py)."""
from __future__ import annotations

import grpc
import pytest

from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from prefixcache.v1 import compute_service_pb2 as pb
from service_shell.auth import ServiceIdentities
from service_shell.service_token import with_service_token
from tests.gateway.gateway_harness import DATAPLANE_TOKEN
from tests.gateway.gateway_harness import TOKENS as TENANT_TOKENS
from tests.gateway.gateway_harness import request as generate_request
from tests.gateway.gateway_harness import settings
from tests.gateway.server_helpers import fake_fleet, prompt
from tests.gateway.test_epp import grpc_body, headers, messages
from tests.security.harness import (DENIED, TOKENS, UNAUTHENTICATED, UNKNOWN_TOKEN, refused,
                                    write_identities)

GATEWAY_TOKEN = TOKENS["gateway"]
assert TOKENS["dataplane"] == DATAPLANE_TOKEN
COMPUTE = "/prefixcache.v1.ComputeService/"
# Every credential configured anywhere in this fleet: none may come back to an EPP caller.
SECRETS = sorted({GATEWAY_TOKEN, DATAPLANE_TOKEN, *TOKENS.values(), *TENANT_TOKENS})


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    """A gateway with a service token of its own (the one the old EPP handed out) and its EPP,
    which knows every identity of the security suite (one per role)."""
    callers = ServiceIdentities.from_file(write_identities(tmp_path_factory.mktemp("epp")))
    with fake_fleet(epp_port=0, epp_callers=callers,
                    worker=settings(service_token=GATEWAY_TOKEN)) as f:
        yield f


def epp(gw, token: str | None):
    channel = grpc.insecure_channel(gw.epp.address)
    return channel, ep_grpc.ExternalProcessorStub(with_service_token(channel, token))


def generate_messages(token: str = "tok-a"):
    return messages(headers(token=token, extra=(("x-prefixcache-service-token", "forged"),)),
                    grpc_body(generate_request(prompt(3), request_id="r-1")))


def test_attack_a_tenant_opens_an_ext_proc_stream_to_get_the_gateways_token(fleet):
    """The tenant calls the EPP as the data plane would, with its bearer (and, failing that,
    with whatever token it can think of): refused before its request is read."""
    gw, *_ = fleet
    for token in (None, UNKNOWN_TOKEN, "tok-a", "Bearer tok-a"):
        channel, stub = epp(gw, token)
        with channel:
            refused(lambda: list(stub.Process(iter(generate_messages()), timeout=10)),
                    UNAUTHENTICATED)
    # A service identity of another role is not the data plane either.
    for role in ("gateway", "worker-1", "subscriber", "operator"):
        channel, stub = epp(gw, TOKENS[role])
        with channel:
            assert "allowed: dataplane" in refused(
                lambda: list(stub.Process(iter(generate_messages()), timeout=10)), DENIED)
    refusals = gw.metrics.registry.get_sample_value(
        "prefixcache_service_auth_refusals_total", {"rpc": "Process", "reason": "role"})
    assert refusals == 4


def test_attack_no_epp_answer_carries_a_secret(fleet):
    """Every answer the EPP gives the data plane (a pick, an Abort's pick, each refusal) is
    scanned, every byte, for every token configured in the fleet."""
    gw, _, workers, _, caller = fleet
    channel, stub = epp(gw, DATAPLANE_TOKEN)
    answers = []
    with channel:
        def run(msgs):
            out = list(stub.Process(iter(msgs), timeout=10))
            answers.extend(out)
            return out
        picked = run(generate_messages())
        assert any(r.HasField("dynamic_metadata") for r in picked)  # it did pick
        removed = [h for r in picked if r.HasField("request_headers")
                   for h in r.request_headers.response.header_mutation.remove_headers]
        assert "x-prefixcache-service-token" in removed  # the client's own is dropped
        for w in workers.values():
            w.delay_s = 0.5
        stream = caller.stream(prompt(9), request_id="r-run")
        try:
            next(stream)
            run(messages(headers(path=COMPUTE + "Abort"),
                         grpc_body(pb.AbortRequest(request_id="r-run"))))
        finally:
            for w in workers.values():
                w.delay_s = 0.0
            stream.cancel()
        for path, body in ((COMPUTE + "GetModelInfo", grpc_body(pb.GetModelInfoRequest())),
                           (COMPUTE + "GetTokenizer", grpc_body(pb.GetTokenizerRequest())),
                           (COMPUTE + "LoadAdapter", b"{}"), (COMPUTE + "Generate", b"\1junk")):
            run(messages(headers(path=path), body))
        run(generate_messages(token="not-a-tenant"))
        run(messages(headers(path=COMPUTE + "Abort"), grpc_body(pb.AbortRequest(request_id="x"))))
    assert len(answers) >= 8
    wire = b"".join(a.SerializeToString() for a in answers)
    for secret in SECRETS:
        assert secret.encode() not in wire, f"an EPP answer carries {secret!r}"
