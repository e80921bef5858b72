"""The gateway's GetModelInfo and GetTokenizer answered without a token (issue 16). Decision: they
are a tenant's calls, like HTTP GET /v1/models (GetModelInfo names the model, the loaded adapters
and a worker), so a caller without a tenant token gets UNAUTHENTICATED unless the gateway runs
with --allow-anonymous."""
from __future__ import annotations

import pytest

from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.server_helpers import fake_fleet
from tests.security.harness import UNAUTHENTICATED, refused


@pytest.fixture(scope="module")
def fleet():
    with fake_fleet() as f:
        yield f


def test_attack_model_info_and_tokenizer_without_a_tenant_token(fleet):
    _, _, _, _, caller = fleet
    for call in (lambda meta: caller.compute.GetModelInfo(pb.GetModelInfoRequest(), timeout=10,
                                                           metadata=meta),
                 lambda meta: caller.compute.GetTokenizer(pb.GetTokenizerRequest(), timeout=10,
                                                          metadata=meta)):
        assert "authorization: missing" in refused(lambda: call([]), UNAUTHENTICATED)
        refused(lambda: call(caller.meta("not-a-tenant")), UNAUTHENTICATED)
        call(caller.meta())  # a tenant gets its answer
