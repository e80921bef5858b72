"""Drain hands back what its clients have not seen: requests that sent no token yet end with
UNAVAILABLE (which the gateway retries on another worker, before the first token) instead of
waiting behind the running ones or ending aborted; requests that sent tokens finish (or, past
the grace, end with FINISH_REASON_ABORT and their tokens)."""
from __future__ import annotations

import threading

import grpc
import pytest

from prefixcache_client.compute import ComputeClientError
from tests.compute_service.server_harness import (ABORT, LENGTH, greedy, make_engine, prompt,
                                                  running, wait_until)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _handed_back(stream) -> bool:
    with pytest.raises(ComputeClientError) as err:
        stream.result()
    assert err.value.status == grpc.StatusCode.UNAVAILABLE, err.value
    assert "handed back" in err.value.message
    return True


def test_queued_requests_are_handed_back_at_once_running_ones_finish():
    engine = make_engine(max_running=1, device_pages=512, max_context=2048)
    with running(engine, grace_s=30.0) as (server, client):
        first = client.generate(prompt(1, 8), greedy(60))
        next(first)  # running, the only one that may
        queued = [client.generate(prompt(20 + i, 8), greedy(4)) for i in range(2)]
        wait_until(lambda: len(engine.waiting) == 2)
        drainer = threading.Thread(target=server.drain)
        drainer.start()
        assert all(_handed_back(q) for q in queued)
        assert first.result().stats.finish_reason == LENGTH
        drainer.join(30)
        assert server.wait(0)
        unavailable = server.metrics.registry.get_sample_value(
            "prefixcache_compute_rpcs_total", {"method": "Generate", "code": "UNAVAILABLE"})
        assert unavailable == 2


def test_past_the_grace_a_request_without_tokens_is_handed_back_one_with_tokens_aborted():
    engine = make_engine(max_running=2, token_budget=8, device_pages=512, max_context=2048)
    with running(engine, grace_s=0.0) as (server, client):
        decoding = client.generate(prompt(1, 8), greedy(2000))
        next(decoding)
        # A long prefill in small chunks: running, and no token yet when the drain starts.
        prefill = client.generate(prompt(3, 1500), greedy(4))
        wait_until(lambda: any(r.computed > 0 and not r.output for r in list(engine.running)))
        server.drain()
        assert _handed_back(prefill)
        assert decoding.result().stats.finish_reason == ABORT
