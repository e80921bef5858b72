"""A worker's error over gRPC's metadata limit (16 KB) reaches its client as RESOURCE_EXHAUSTED
from gRPC itself ("received metadata size exceeds hard limit"): about this request, not the
worker's load, so the gateway passes it on instead of retrying it on another worker, which
would answer the same (issue 25 finding 6: a 10 MB adapter name, echoed by each worker in
turn). The workers no longer produce such errors (names are bounded at parse and echoed
through quote_untrusted); this keeps the gateway right about an older or foreign worker."""
from __future__ import annotations

import grpc
import pytest

from tests.gateway.server_helpers import fake_fleet, prompt


@pytest.mark.parametrize("case", ["grpc-gateway-worker-error-over-metadata-limit-not-retried"])
def test_an_oversized_worker_error_is_not_retried(case):
    with fake_fleet() as (gw, _cache, workers, _, caller):
        for w in workers.values():
            w.fail, w.fail_code = "before", grpc.StatusCode.NOT_FOUND
            w.fail_message = "adapter: '" + "a" * 40_000 + "' is not loaded on this worker"
        with pytest.raises(grpc.RpcError) as err:
            caller.generate(prompt(9))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "metadata size exceeds" in err.value.details()
    assert sum(len(w.seen) for w in workers.values()) == 1  # one worker asked, not both
