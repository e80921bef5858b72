"""Generate over gRPC: streaming, cache reuse across requests and tenants, cancel and Abort."""
from __future__ import annotations

import grpc
import pytest

from compute_service.model import ByteTokenizer
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache_client.cache import CacheClient
from prefixcache_client.compute import ComputeClientError
from tests.cache_service.grpc_harness import running_server
from tests.compute_service.server_harness import (ABORT, LENGTH, INVALID, make_engine, running,
                                                  greedy, prompt, wait_until, sample, fails)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- Generate -----------------------------------------------------------------------------------

def test_generate_streams_tokens_then_stats(shared):
    """A message carries every token ready when the stream wakes, so a short generation on a
    fast engine can arrive whole (6 tokens took 27 ms once the CPU kernels came, and CI got one
    message); 48 decode steps outlast a wake-up of the stream many times over."""
    server, client = shared
    msgs = list(client.generate(prompt(1), greedy(48), request_id="stream-1"))
    assert len(msgs) > 1 and msgs[-1].HasField("stats")
    assert not any(m.HasField("stats") for m in msgs[:-1])
    stats = msgs[-1].stats
    assert sum(len(m.token_ids) for m in msgs) == stats.output_tokens == 48
    assert stats.request_id == "stream-1" and stats.worker == "worker-tiny-transformer"
    assert stats.prompt_tokens == 21 and stats.finish_reason == LENGTH
    assert stats.computed_prompt_tokens + stats.cached_tokens_device == 21
    assert 0 < stats.ttft_s <= stats.total_s and stats.preemptions == 0


def test_text_prompt_gives_text_and_max_tokens_0_means_16(shared):
    _, client = shared
    out = client.generate("The quick brown fox", greedy(0)).result()
    assert out.stats.prompt_tokens == len("The quick brown fox") + 1  # BOS first
    assert len(out.token_ids) == out.stats.output_tokens == 16
    assert out.text == ByteTokenizer().decode(out.token_ids)
    assert out.stats.request_id  # the server assigned one


def test_identical_request_hits_cache_with_identical_greedy_output(shared):
    _, client = shared
    first = client.generate(prompt(2), greedy(8)).result()
    second = client.generate(prompt(2), greedy(8)).result()
    assert first.stats.cached_tokens_device == 0
    assert second.stats.cached_tokens_device == 20  # 5 whole pages; the last token is computed
    assert second.stats.computed_prompt_tokens == 1
    assert second.token_ids == first.token_ids


def test_tenant_salts_never_share_cache(shared):
    _, client = shared
    a1 = client.generate(prompt(3), greedy(4), salt="tenant-a").result()
    a2 = client.generate(prompt(3), greedy(4), salt="tenant-a").result()
    b = client.generate(prompt(3), greedy(4), salt="tenant-b").result()
    unsalted = client.generate(prompt(3), greedy(4)).result()
    assert a1.stats.cached_tokens_device == 0 and a2.stats.cached_tokens_device == 20
    assert b.stats.cached_tokens_device == 0 and unsalted.stats.cached_tokens_device == 0
    assert a1.token_ids == a2.token_ids == b.token_ids == unsalted.token_ids


def test_concurrent_identical_requests_all_complete_alike(shared):
    _, client = shared
    streams = [client.generate(prompt(4, 33), greedy(6)) for _ in range(3)]
    outs = [s.result() for s in streams]
    assert outs[0].token_ids == outs[1].token_ids == outs[2].token_ids
    # Computed once between them (same-step dedup, or a plain hit for a later arrival).
    assert sum(o.stats.computed_prompt_tokens for o in outs) < 3 * 33


def test_remote_cache_service_hybrid_model():
    with running_server() as cache_server:
        cache = CacheClient(f"127.0.0.1:{cache_server.port}")
        try:
            with running(make_engine("tiny-hybrid", cache)) as (server, client):
                info = client.model_info()
                assert (info.architecture, info.num_attention_layers,
                        info.num_mamba_layers) == ("bamba", 2, 2)
                pools = cache_server.core.list_pools(cpb.ListPoolsRequest()).pools
                assert [p.pool_id for p in pools] == [info.worker]
                first = client.generate(prompt(5), greedy(6)).result()
                second = client.generate(prompt(5), greedy(6)).result()
                assert first.stats.cached_tokens_device == 0
                assert second.stats.cached_tokens_device == 20
                assert second.token_ids == first.token_ids
                pool = cache_server.core.get_stats(cpb.GetStatsRequest()).pools[0]
                assert pool.hit_tokens_device == 20
        finally:
            cache.close()


# ---- cancellation and Abort ----------------------------------------------------------------------

def test_client_cancel_and_deadline_abort_the_request(shared):
    server, client = shared
    aborted = sample(server, "prefixcache_compute_requests_total", finish_reason="abort")
    stream = client.generate(prompt(6, 4), greedy(240), request_id="cancel-me")
    next(stream)
    stream.cancel()
    wait_until(lambda: server.running.get("cancel-me") is None)
    assert not any(r.id == "cancel-me" for r in server.engine.running)
    # A deadline that passes mid-generation ends the request the same way.
    late = client.generate(prompt(7, 4), greedy(250), request_id="too-slow", timeout_s=0.2)
    fails(late, grpc.StatusCode.DEADLINE_EXCEEDED)
    wait_until(lambda: server.running.get("too-slow") is None)
    assert sample(server, "prefixcache_compute_requests_total",
                  finish_reason="abort") == aborted + 2


def test_abort_by_id(shared):
    _, client = shared
    stream = client.generate(prompt(8, 4), greedy(240), request_id="abort-me")
    next(stream)
    assert client.abort("abort-me") is True
    out = stream.result()
    assert out.stats.finish_reason == ABORT and out.stats.output_tokens < 240
    assert client.abort("abort-me") is False  # no longer running
    with pytest.raises(ComputeClientError) as err:
        client.abort("")
    assert err.value.status == INVALID and err.value.message.startswith("request_id")


def test_duplicate_running_request_id_is_already_exists(shared):
    _, client = shared
    stream = client.generate(prompt(9, 4), greedy(240), request_id="dup")
    next(stream)
    message = fails(client.generate(prompt(10, 4), greedy(2), request_id="dup"),
                    grpc.StatusCode.ALREADY_EXISTS)
    assert message.startswith("request_id")
    client.abort("dup")
    stream.result()
    # Once it finished, the id is free again.
    assert client.generate(prompt(10, 4), greedy(2), request_id="dup").result().stats
