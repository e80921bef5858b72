"""The compute service over real gRPC: model info, health, reflection, mTLS, metrics and drain."""
from __future__ import annotations

import threading
import urllib.request

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from compute_service.model import ByteTokenizer
from compute_service.__main__ import open_cache
from compute_service.server import SERVICE_NAME, ComputeServer, ServerConfig
from prefixcache_client.compute import ComputeClient, ComputeClientError
from service_shell import TlsConfig
from tests.cache_service.grpc_harness import running_server
from tests.compute_service.server_harness import (PAGE, CONTEXT, VOCAB, SERVING, NOT_SERVING,
                                                  ABORT, LENGTH, make_engine, running, greedy,
                                                  prompt, wait_until, sample, health, fails)
from tests.service_shell.certs import make_pki

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- model info, health, reflection, metrics -----------------------------------------------------

def test_get_model_info(shared):
    _, client = shared
    info = client.model_info()
    assert info.model_id == "tiny-transformer" and info.architecture == "llama"
    assert (info.vocab_size, info.max_context_tokens, info.page_size) == (VOCAB, CONTEXT, PAGE)
    assert (info.num_attention_layers, info.num_mamba_layers) == (4, 0)
    assert list(info.eos_token_ids) == [ByteTokenizer.EOS]
    assert info.worker == "worker-tiny-transformer" and list(info.adapters) == []


def test_health_and_reflection(shared):
    server, _ = shared
    target = f"127.0.0.1:{server.port}"
    for name in ("", "liveness", "readiness", SERVICE_NAME):
        assert health(target, name) == SERVING
    with grpc.insecure_channel(target) as ch:
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
        reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol=SERVICE_NAME)]), timeout=5))
        assert reply.file_descriptor_response.file_descriptor_proto


def test_not_ready_until_an_engine_is_attached():
    server = ComputeServer(ServerConfig(host="127.0.0.1", port=0, grace_s=0)).start()
    target = f"127.0.0.1:{server.port}"
    try:
        assert health(target, "liveness") == SERVING
        assert health(target, "readiness") == NOT_SERVING
        with ComputeClient(target) as client:
            assert "loading" in fails(client.generate([1, 2]), grpc.StatusCode.UNAVAILABLE)
    finally:
        server.drain()


def test_health_port_and_mtls(tmp_path):
    """The worker's own port requires client certificates, its health port stays plaintext, and
    its channel to a cache service uses the same certificates."""
    pki = make_pki(tmp_path)
    server_tls = TlsConfig(pki.server.cert, pki.server.key, pki.ca)
    client_tls = TlsConfig(pki.client.cert, pki.client.key, pki.ca)
    server = ComputeServer(ServerConfig(host="127.0.0.1", port=0, health_port=0, grace_s=0,
                                        tls=server_tls)).start()
    try:
        assert health(f"127.0.0.1:{server.health_port}", "liveness") == SERVING
        assert health(f"127.0.0.1:{server.health_port}", "readiness") == NOT_SERVING
        target = f"127.0.0.1:{server.port}"
        with ComputeClient(target, timeout_s=2, tls=client_tls) as client:
            with pytest.raises(ComputeClientError, match="still loading"):  # got through
                client.model_info()
        with ComputeClient(target, timeout_s=2) as client:
            with pytest.raises(ComputeClientError) as err:
                client.model_info()
            assert err.value.status == grpc.StatusCode.UNAVAILABLE
            assert "loading" not in err.value.message  # refused at the handshake
    finally:
        server.drain()
    with running_server(tls=server_tls) as cache_server:
        cache = open_cache(f"127.0.0.1:{cache_server.port}", 5, client_tls)
        try:
            assert cache.list_pools().pools == []
        finally:
            cache.close()


def test_metrics_text(shared):
    server, client = shared
    client.generate(prompt(11), greedy(3)).result()
    url = f"http://127.0.0.1:{server.metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    for line in ('prefixcache_compute_requests_total{finish_reason="length"}',
                 "prefixcache_compute_prompt_tokens_total",
                 'prefixcache_compute_cached_prompt_tokens_total{medium="device"}',
                 "prefixcache_compute_computed_prompt_tokens_total",
                 "prefixcache_compute_twin_first_tokens_total",
                 "prefixcache_compute_ttft_seconds_count",
                 'prefixcache_compute_rpcs_total{code="OK",method="Generate"}',
                 "prefixcache_compute_running_requests 0.0",
                 "prefixcache_compute_waiting_requests 0.0",
                 "prefixcache_compute_engine_steps_total"):
        assert line in text, line
    assert sample(server, "prefixcache_compute_engine_steps_total") > 0
    assert sample(server, "prefixcache_compute_ttft_seconds_count") > 0


# ---- drain ---------------------------------------------------------------------------------------

def test_drain_lets_running_requests_finish_within_grace_then_aborts_the_rest():
    engine = make_engine(device_pages=512, max_context=2048)
    with running(engine, grace_s=2.0) as (server, client):
        long = client.generate(prompt(12, 4), greedy(2000))
        short = client.generate(prompt(13, 4), greedy(12))
        next(long), next(short)  # both running before the drain starts
        drainer = threading.Thread(target=server.drain)
        drainer.start()

        def refused() -> bool:
            try:
                client.generate([1, 2], greedy(1)).result()
            except ComputeClientError as exc:
                assert exc.status == grpc.StatusCode.UNAVAILABLE and "draining" in exc.message
                return True
            return False

        wait_until(refused)
        assert health(f"127.0.0.1:{server.port}", "readiness") == NOT_SERVING
        assert short.result().stats.finish_reason == LENGTH
        assert long.result().stats.finish_reason == ABORT
        drainer.join(10)
        assert server.wait(0)
