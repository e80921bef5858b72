"""The compute service over real gRPC on loopback: streaming, cache reuse across requests and
tenants, a remote cache service, cancellation and Abort, the status code and field of every bad
input, model info, health, reflection, metrics, drain, LoRA adapters (LoadAdapter, UnloadAdapter,
GetModelInfo.adapters, Generate under an adapter), the L3 tier against a real Redis, and
`python -m compute_service` with its flags (two workers sharing one Redis)."""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cache_service.client import CacheClient
from cache_service.core import CacheCore
from cache_service.l3 import L3Client, L3Config
from compute_service.client import ComputeClient, ComputeClientError
from compute_service.engine import Engine, EngineConfig
from compute_service.lora import merged_model, read_adapter, write_random_adapter
from compute_service.model import ByteTokenizer, PagedDriver, build_preset
from compute_service.__main__ import open_cache, parse_args
from compute_service.server import SERVICE_NAME, ComputeServer, ServerConfig, serve
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from service_shell import TlsConfig
from tests.cache_service.grpc_harness import REPO, running_server
from tests.service_shell.certs import make_pki

PAGE = 4
CONTEXT = 256  # device_pages * PAGE below
VOCAB = 320  # the tiny presets'
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ABORT, LENGTH = pb.FINISH_REASON_ABORT, pb.FINISH_REASON_LENGTH
INVALID, OUT_OF_RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # The tests share two cores with other workers; torch's default thread count oversubscribes
    # them and makes an engine step ~20x slower.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@functools.cache
def model(name: str):
    return build_preset(name, seed=3)


def make_engine(name: str = "tiny-transformer", cache=None, **cfg) -> Engine:
    settings = dict(page_size=PAGE, device_pages=CONTEXT // PAGE, token_budget=64, max_running=4,
                    max_context=CONTEXT, model_id=name, pool_id=f"worker-{name}")
    settings.update(cfg)
    return Engine(model(name), ByteTokenizer(), cache or CacheCore(), EngineConfig(**settings))


@contextlib.contextmanager
def running(engine: Engine, **config) -> Iterator[tuple[ComputeServer, ComputeClient]]:
    """An in-process server on 127.0.0.1 over `engine` and a client of it; drained on exit."""
    config.setdefault("grace_s", 0.0)
    server = serve(engine, ServerConfig(host="127.0.0.1", port=0, **config))
    client = ComputeClient(f"127.0.0.1:{server.port}", timeout_s=10, generate_timeout_s=60)
    try:
        yield server, client
    finally:
        client.close()
        server.drain()


@pytest.fixture(scope="module")
def shared():
    """One tiny-transformer worker for the tests that use prompts of their own."""
    with running(make_engine(), metrics_port=0) as pair:
        yield pair


def greedy(max_tokens: int, **fields) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **fields)


def prompt(start: int, n: int = 21) -> list[int]:
    """n tokens; distinct `start`s give prompts that share no page."""
    return [(start + 7 * i) % 256 for i in range(n)]


def wait_until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.02)


def sample(server: ComputeServer, name: str, **labels: str) -> float:
    return server.metrics.registry.get_sample_value(name, labels) or 0.0


def health(target: str, service: str) -> int:
    with grpc.insecure_channel(target) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5).status


def fails(stream, code: grpc.StatusCode) -> str:
    with pytest.raises(ComputeClientError) as err:
        stream.result()
    assert err.value.status == code, err.value
    return err.value.message


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


# ---- validation ----------------------------------------------------------------------------------

def _request(prompt_ids: list[int] | str | None = (1, 2, 3), **fields) -> pb.GenerateRequest:
    req = pb.GenerateRequest(**fields)
    if isinstance(prompt_ids, str):
        req.text = prompt_ids
    elif prompt_ids is not None:
        req.token_ids.ids.extend(prompt_ids)
    return req


@pytest.mark.parametrize("req, metadata, code, field", [
    pytest.param(_request([1, VOCAB]), (), INVALID, "prompt.token_ids", id="token-too-big"),
    pytest.param(_request([1, -1]), (), INVALID, "prompt.token_ids", id="token-negative"),
    pytest.param(_request(None), (), INVALID, "prompt", id="no-prompt"),
    pytest.param(_request([]), (), INVALID, "prompt", id="empty-token-ids"),
    pytest.param(_request(""), (), INVALID, "prompt", id="empty-text"),
    pytest.param(_request([1] * CONTEXT), (), OUT_OF_RANGE, "prompt", id="prompt-too-long"),
    pytest.param(_request([1] * 200, sampling=greedy(57)), (), OUT_OF_RANGE,
                 "sampling.max_tokens", id="max-tokens-too-many"),
    pytest.param(_request([1] * 250), (), OUT_OF_RANGE, "sampling.max_tokens",
                 id="default-16-does-not-fit"),
    pytest.param(_request(sampling=pb.SamplingParams(temperature=-1)), (), INVALID,
                 "sampling.temperature", id="temperature-negative"),
    pytest.param(_request(sampling=pb.SamplingParams(temperature=101)), (), INVALID,
                 "sampling.temperature", id="temperature-too-high"),
    pytest.param(_request(sampling=pb.SamplingParams(temperature=math.nan)), (), INVALID,
                 "sampling.temperature", id="temperature-nan"),
    pytest.param(_request(sampling=pb.SamplingParams(top_k=VOCAB + 1)), (), INVALID,
                 "sampling.top_k", id="top-k-over-vocab"),
    pytest.param(_request(sampling=pb.SamplingParams(top_p=1.5)), (), INVALID,
                 "sampling.top_p", id="top-p-over-1"),
    pytest.param(_request(sampling=pb.SamplingParams(max_tokens=4, min_tokens=5)), (), INVALID,
                 "sampling.min_tokens", id="min-over-max-tokens"),
    pytest.param(_request(sampling=pb.SamplingParams(min_tokens=17)), (), INVALID,
                 "sampling.min_tokens", id="min-over-default-16"),
    pytest.param(_request(sampling=pb.SamplingParams(stop_token_ids=[5, VOCAB])), (), INVALID,
                 "sampling.stop_token_ids", id="stop-token-out-of-vocab"),
    pytest.param(_request(adapter="my-lora"), (), grpc.StatusCode.NOT_FOUND, "adapter",
                 id="unknown-adapter"),
    pytest.param(_request(request_id="r" * 129), (), INVALID, "request_id",
                 id="request-id-too-long"),
    pytest.param(_request(), (("x-prefixcache-salt", "s" * 257),), INVALID,
                 "x-prefixcache-salt", id="salt-too-long"),
    pytest.param(_request(), (("x-prefixcache-salt", "a"), ("x-prefixcache-salt", "b")), INVALID,
                 "x-prefixcache-salt", id="two-salts"),
])
def test_bad_input_gets_its_code_and_names_the_field(shared, req, metadata, code, field):
    server, client = shared
    # An earlier test's request may still be retiring (its release goes out with the next step).
    wait_until(lambda: len(server.running) == 0 and not server.engine.has_work())
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        with pytest.raises(grpc.RpcError) as err:
            next(pb_grpc.ComputeServiceStub(ch).Generate(req, metadata=metadata, timeout=10))
    assert err.value.code() == code, err.value.details()
    assert err.value.details().startswith(f"{field}:"), err.value.details()
    assert len(server.running) == 0 and not server.engine.has_work()  # nothing was queued


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


# ---- python -m compute_service -------------------------------------------------------------------

@contextlib.contextmanager
def compute_process(*args: str) -> Iterator[tuple[subprocess.Popen, str, Callable[[], str]]]:
    """`python -m compute_service` on 127.0.0.1, any port: (process, target, its log)."""
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [sys.executable, "-m", "compute_service", "--host", "127.0.0.1", "--port", "0",
         "--threads", "1", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=log, text=True,
        env={**os.environ, "PREFIXCACHE_LOG_LEVEL": "INFO"})

    def read_log() -> str:
        log.seek(0)
        return log.read()

    try:
        line = proc.stdout.readline()  # the first line, printed before the model loads
        assert line.startswith("listening on "), f"{line!r}\n{read_log()}"
        yield proc, f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}", read_log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        log.close()


def test_cli_serves_until_sigterm_then_drains_and_exits_0():
    with compute_process("--model", "tiny-hybrid", "--cache-service", "embedded",
                         "--page-size", str(PAGE), "--device-pages", "64",
                         "--grace-s", "0") as (proc, target, read_log):
        wait_until(lambda: health(target, "readiness") == SERVING, timeout_s=60)
        with ComputeClient(target) as client:
            info = client.model_info()
            assert info.model_id == "tiny-hybrid-seed0" and info.architecture == "bamba"
            assert info.worker.endswith(f"-{target.rsplit(':', 1)[1]}")  # HOSTNAME-PORT
            first = client.generate("a prompt long enough for pages", greedy(4)).result()
            second = client.generate("a prompt long enough for pages", greedy(4)).result()
            assert second.stats.cached_tokens_device > 0 and second.token_ids == first.token_ids
            running = client.generate([1, 2, 3], greedy(200))
            next(running)
            proc.send_signal(signal.SIGTERM)
            assert running.result().stats.finish_reason == ABORT
        assert proc.wait(timeout=30) == 0, read_log()
        log = read_log()
        for event in ("event=worker_ready", "event=signal_received", "event=drain_started",
                      "event=request_finished", "event=server_stopped"):
            assert event in log, event


# ---- LoRA adapters -------------------------------------------------------------------------------

NOT_FOUND, EXISTS = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
# Adapters for tiny-transformer: name -> write_random_adapter arguments.
ADAPTERS = {
    "a": dict(rank=8, seed=1, strength=0.5),
    "b": dict(rank=4, seed=2, strength=0.5, targets=("q_proj", "v_proj")),
    "c": dict(rank=8, seed=3, strength=0.5),
    "r16": dict(rank=16, seed=4),  # above the workers' max_lora_rank of 8
}


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory) -> dict[str, str]:
    """The ADAPTERS in PEFT format, plus broken ones: name -> directory."""
    root = tmp_path_factory.mktemp("adapters")
    dirs = {}
    for name, kwargs in ADAPTERS.items():
        write_random_adapter(root / name, "tiny-transformer", **kwargs)
        dirs[name] = str(root / name)
    corrupt = root / "corrupt"
    write_random_adapter(corrupt, "tiny-transformer", rank=4, seed=5)
    (corrupt / "adapter_model.safetensors").write_bytes(b"\x00" * 7)
    dirs["corrupt"] = str(corrupt)
    dora = root / "dora"
    write_random_adapter(dora, "tiny-transformer", rank=4, seed=6)
    config = json.loads((dora / "adapter_config.json").read_text())
    (dora / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    dirs["dora"] = str(dora)
    dirs["missing"] = str(root / "no-such-dir")
    return dirs


@functools.cache
def merged_reference(adapter_dir: str, prompt_ids: tuple[int, ...], n: int) -> list[int]:
    """Greedy tokens of tiny-transformer with the adapter at `adapter_dir` merged in."""
    base = model("tiny-transformer")
    ref = merged_model(base, read_adapter(adapter_dir, base.config))
    return PagedDriver(ref, num_pages=80, page_size=PAGE, num_slots=2).generate_greedy(
        list(prompt_ids), n)


def rpc(server: ComputeServer, method: str, req):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        return getattr(pb_grpc.ComputeServiceStub(ch), method)(req, timeout=10)


def rpc_fails(server: ComputeServer, method: str, req, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        rpc(server, method, req)
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def load(server: ComputeServer, name: str, path: str) -> pb.LoadAdapterResponse:
    return rpc(server, "LoadAdapter", pb.LoadAdapterRequest(name=name, path=path))


def lora_engine(**cfg) -> Engine:
    cfg = {"max_loaded_adapters": 2, "max_lora_rank": 8, "max_loras": 2, **cfg}
    return make_engine(pool_id="worker-lora", **cfg)


def test_load_adapter_generate_with_it_then_unload(adapter_dirs):
    with running(lora_engine(), metrics_port=0) as (server, client):
        resp = load(server, "a", adapter_dirs["a"])
        assert resp.rank == 8
        assert list(resp.target_modules) == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                             "q_proj", "up_proj", "v_proj"]
        resp = load(server, "b.v2", adapter_dirs["b"])
        assert (resp.rank, list(resp.target_modules)) == (4, ["q_proj", "v_proj"])
        assert list(client.model_info().adapters) == ["a", "b.v2"]
        assert sample(server, "prefixcache_compute_adapters_loaded") == 2

        p = prompt(40)
        base = client.generate(p, greedy(8)).result()
        first = client.generate(p, greedy(8), adapter="a").result()
        second = client.generate(p, greedy(8), adapter="a").result()
        other = client.generate(p, greedy(8), adapter="b.v2").result()
        # The adapter's output is the merged-weights model's, from cache too.
        assert first.token_ids == second.token_ids == merged_reference(adapter_dirs["a"],
                                                                        tuple(p), 8)
        assert other.token_ids == merged_reference(adapter_dirs["b"], tuple(p), 8)
        assert first.token_ids != base.token_ids
        # Namespaces: only the same adapter hits.
        assert first.stats.cached_tokens_device == 0 and other.stats.cached_tokens_device == 0
        assert second.stats.cached_tokens_device == 20

        resp = rpc(server, "UnloadAdapter", pb.UnloadAdapterRequest(name="a"))
        # Prompt + output pages of "a", published at release, none pinned any more.
        assert resp.removed_pages == (21 + 8) // PAGE and resp.deferred_pages == 0
        assert list(client.model_info().adapters) == ["b.v2"]
        message = fails(client.generate(p, greedy(2), adapter="a"), NOT_FOUND)
        assert message.startswith("adapter:")
        # The freed slot takes another adapter; the name can be loaded again, as new weights.
        load(server, "a", adapter_dirs["c"])
        again = client.generate(p, greedy(8), adapter="a").result()
        assert again.stats.cached_tokens_device == 0  # "a"'s old pages are gone
        assert again.token_ids == merged_reference(adapter_dirs["c"], tuple(p), 8)
        assert sample(server, "prefixcache_compute_rpcs_total", method="LoadAdapter",
                      code="OK") == 3
        assert sample(server, "prefixcache_compute_rpcs_total", method="UnloadAdapter",
                      code="OK") == 1


@pytest.mark.parametrize("name, path, code, field", [
    pytest.param("", "a", INVALID, "name", id="empty-name"),
    pytest.param("has space", "a", INVALID, "name", id="name-with-space"),
    pytest.param("x" * 257, "a", INVALID, "name", id="name-too-long"),
    pytest.param("caf\u00e9", "a", INVALID, "name", id="name-not-ascii"),
    pytest.param("new", "", INVALID, "path", id="empty-path"),
    pytest.param("new", "missing", INVALID, "path", id="no-such-directory"),
    pytest.param("new", "corrupt", INVALID, "path", id="corrupt-weights"),
    pytest.param("new", "r16", INVALID, "r", id="rank-over-max"),
    pytest.param("new", "dora", INVALID, "use_dora", id="dora"),
    pytest.param("a", "c", EXISTS, "name", id="name-loaded"),
    pytest.param("x" * 256, "c", EXHAUSTED, "name", id="slots-full"),
])
def test_load_adapter_errors_name_the_field_and_change_nothing(adapter_dirs, name, path, code,
                                                              field):
    with running(lora_engine()) as (server, client):
        load(server, "a", adapter_dirs["a"])
        if code == EXHAUSTED:
            load(server, "b", adapter_dirs["b"])
        before = list(client.model_info().adapters)
        message = rpc_fails(server, "LoadAdapter",
                            pb.LoadAdapterRequest(name=name, path=adapter_dirs.get(path, path)),
                            code)
        assert message.startswith(f"{field}:"), message
        assert list(client.model_info().adapters) == before
        if code != EXISTS:  # nothing was loaded under the name
            fails(client.generate([1, 2], greedy(1), adapter=name or "x"), NOT_FOUND)
        # The adapter already loaded is untouched.
        out = client.generate(prompt(41), greedy(4), adapter="a").result()
        assert out.token_ids == merged_reference(adapter_dirs["a"], tuple(prompt(41)), 4)


def test_unload_adapter_errors():
    with running(lora_engine()) as (server, _):
        message = rpc_fails(server, "UnloadAdapter", pb.UnloadAdapterRequest(name="nope"),
                            NOT_FOUND)
        assert message.startswith("name:") and "nope" in message
        message = rpc_fails(server, "UnloadAdapter", pb.UnloadAdapterRequest(name="a b"), INVALID)
        assert message.startswith("name:")
        message = rpc_fails(server, "UnloadAdapter", pb.UnloadAdapterRequest(), INVALID)
        assert message.startswith("name:")


def test_worker_without_adapter_slots(adapter_dirs):
    with running(lora_engine(max_loaded_adapters=0)) as (server, client):
        message = rpc_fails(server, "LoadAdapter",
                            pb.LoadAdapterRequest(name="a", path=adapter_dirs["a"]), EXHAUSTED)
        assert message.startswith("name:") and "max_loaded_adapters=0" in message
        rpc_fails(server, "LoadAdapter", pb.LoadAdapterRequest(name="a b", path="x"), INVALID)
        assert list(client.model_info().adapters) == []


def test_unload_while_a_request_runs_with_the_adapter(adapter_dirs):
    with running(lora_engine()) as (server, client):
        load(server, "a", adapter_dirs["a"])
        p = prompt(42)
        stream = client.generate(p, greedy(200), adapter="a", request_id="long")
        # Two tokens: the first is sampled in one engine step and the prompt's pages are only
        # published by the next step's cache call, which precedes the second token.
        head = [next(stream), next(stream)]  # running: its prompt pages are published and pinned
        resp = rpc(server, "UnloadAdapter", pb.UnloadAdapterRequest(name="a"))
        assert resp.deferred_pages >= len(p) // PAGE
        assert fails(client.generate(p, greedy(2), adapter="a"), NOT_FOUND).startswith("adapter")
        out = stream.result()
        assert out.stats.finish_reason == LENGTH and out.stats.output_tokens == 200
        tokens = [t for msg in head for t in msg.token_ids] + list(out.token_ids)
        assert tokens == merged_reference(adapter_dirs["a"], tuple(p), 200)
        # Once it ended, its deferred pages are freed and its slot is free.
        cache = server.engine.cache

        def released() -> bool:
            pool = cache.get_stats(cpb.GetStatsRequest()).pools[0]
            return pool.active_leases == 0 and all(m.pinned_pages == 0 for m in pool.media)
        wait_until(released)
        pool = cache.get_stats(cpb.GetStatsRequest()).pools[0]
        assert pool.media[0].cached_pages == 0 and pool.media[0].used_pages == 0
        load(server, "b", adapter_dirs["b"])
        load(server, "c", adapter_dirs["c"])  # both slots free again: nothing leaked


# ---- L3 (Redis) ----------------------------------------------------------------------------------

def test_l3_pages_shared_through_redis_and_writer_closed_on_drain(redis_server):
    """In-process: worker 1 writes through, worker 2 (another pool, same Redis) loads them;
    the L3 counters are exported, and drain closes the engine (the writer has flushed)."""
    def worker(pool_id: str) -> Engine:
        l3 = L3Client(L3Config(redis_server.url, prefix="t1", timeout_s=1.0))
        return make_engine(pool_id=pool_id, cache=CacheCore(remote=l3), l3=l3,
                           l3_write_policy="write-through", l3_lookup=True)

    p = prompt(43, 33)
    with running(worker("l3-one"), metrics_port=0) as (one, client):
        first = client.generate(p, greedy(4)).result()
        assert first.stats.cached_tokens_remote == 0
    assert not one.engine.l3._thread.is_alive()  # closed on drain, after its queue
    assert sample(one, "prefixcache_compute_l3_write_pages_ok_total") >= 8
    assert sample(one, "prefixcache_compute_l3_breaker_open") == 0
    with running(worker("l3-two")) as (two, client):
        second = client.generate(p, greedy(4)).result()
        assert second.stats.cached_tokens_remote == 32  # 8 whole pages; the last token computed
        assert second.token_ids == first.token_ids
        assert sample(two, "prefixcache_compute_cached_prompt_tokens_total", medium="remote") == 32
        assert sample(two, "prefixcache_compute_engine_remote_loaded_tokens_total") == 32
        assert sample(two, "prefixcache_compute_l3_load_pages_ok_total") == 8


def test_no_l3_metrics_without_l3(shared):
    server, _ = shared
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics",
                                  timeout=5).read().decode()
    assert "prefixcache_compute_l3_" not in text
    assert "prefixcache_compute_adapters_loaded 0.0" in text


# ---- python -m compute_service: flags ------------------------------------------------------------

def test_l3_and_lora_flags_defaults_and_env(monkeypatch):
    for var in [v for v in os.environ if v.startswith("PREFIXCACHE_")]:
        monkeypatch.delenv(var)
    args = parse_args(["--model", "tiny-transformer"])
    assert (args.redis_url, args.l3_write_policy, args.l3_lookup) == ("", "none", False)
    assert (args.max_loaded_adapters, args.max_lora_rank, args.max_loras) == (4, 16, 4)
    assert args.adapters == [] and args.lease_ttl_s == 0
    args = parse_args(["--model", "tiny-transformer", "--redis-url", "redis://r:6379/0"])
    assert (args.l3_write_policy, args.l3_lookup, args.l3_key_prefix) == ("write-through", True,
                                                                          "pc")
    args = parse_args(["--model", "tiny-transformer", "--redis-url", "redis://r:6379/0",
                       "--no-l3-lookup", "--l3-write-policy", "hot", "--l3-min-hits", "3",
                       "--adapter", "a=/x", "--adapter", "b=/y=z"])
    assert (args.l3_write_policy, args.l3_lookup, args.l3_min_hits) == ("hot", False, 3)
    assert args.adapters == [("a", "/x"), ("b", "/y=z")]
    env = {"REDIS_URL": "redis://r:6379/0", "L3_LOOKUP": "off", "L3_WRITE_POLICY": "write-back",
           "L3_TIMEOUT_S": "0.5", "L3_PREFIX": "shared", "L3_TTL_S": "60",
           "L3_WRITE_QUEUE_MB": "8", "L3_BATCH_PAGES": "4", "LEASE_TTL_S": "90",
           "MAX_LOADED_ADAPTERS": "6", "MAX_LORA_RANK": "32", "MAX_LORAS": "3",
           "ADAPTERS": "a=/x, b=/y"}
    for key, value in env.items():
        monkeypatch.setenv(f"PREFIXCACHE_{key}", value)
    args = parse_args(["--model", "tiny-transformer"])
    assert (args.l3_lookup, args.l3_write_policy, args.l3_timeout_s) == (False, "write-back", 0.5)
    assert (args.l3_key_prefix, args.l3_ttl_s, args.l3_write_queue_mb, args.l3_batch_pages) == (
        "shared", 60, 8, 4)  # the cache service's PREFIXCACHE_L3_PREFIX is the fallback
    monkeypatch.setenv("PREFIXCACHE_L3_KEY_PREFIX", "mine")
    args = parse_args(["--model", "tiny-transformer"])
    assert args.l3_key_prefix == "mine" and args.lease_ttl_s == 90
    assert (args.max_loaded_adapters, args.max_lora_rank, args.max_loras) == (6, 32, 3)
    assert args.adapters == [("a", "/x"), ("b", "/y")]


@pytest.mark.parametrize("argv, message", [
    (["--l3-lookup"], "need --redis-url"),
    (["--l3-write-policy", "write-through"], "need --redis-url"),
    (["--redis-url", "redis://r/0", "--l3-write-policy", "sometimes"], "invalid choice"),
    (["--redis-url", "redis://r/0", "--l3-timeout-s", "0"], "--l3-timeout-s"),
    (["--redis-url", "redis://r/0", "--l3-key-prefix", "a b"], "--l3-key-prefix"),
    (["--adapter", "noequals"], "NAME=PATH"),
    (["--adapter", "bad name=/x"], "name"),
    (["--adapter", "a=/x", "--adapter", "a=/y"], "twice"),
    (["--max-loaded-adapters", "1", "--adapter", "a=/x", "--adapter", "b=/y"],
     "--max-loaded-adapters"),
    (["--max-loras", "0"], "--max-loras"),
])
def test_bad_l3_and_lora_flags_are_usage_errors(monkeypatch, capsys, argv, message):
    for var in [v for v in os.environ if v.startswith("PREFIXCACHE_")]:
        monkeypatch.delenv(var)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "tiny-transformer", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_cli_two_workers_share_pages_through_redis(redis_server, adapter_dirs):
    """Two `python -m compute_service` workers, embedded cache services, one Redis: what the
    first computed under adapter "a" the second loads from L3 (and not under the base model);
    --adapter loads at start; the L3 counters reach the metrics endpoint."""
    flags = ["--model", "tiny-transformer", "--cache-service", "embedded", "--page-size",
             str(PAGE), "--device-pages", "64", "--grace-s", "0", "--redis-url",
             redis_server.url, "--l3-key-prefix", "cli", "--l3-timeout-s", "1",
             "--l3-batch-pages", "4", "--max-lora-rank", "8", "--max-loaded-adapters", "2",
             "--adapter", f"a={adapter_dirs['a']}"]
    text = "a shared prompt, long enough for several pages"
    metrics_one = _free_port()  # --metrics-port 0 means none
    with compute_process(*flags, "--metrics-port", str(metrics_one)) as (one, target_one,
                                                                         log_one), \
            compute_process(*flags) as (two, target_two, log_two):
        assert one.stdout.readline().strip() == f"metrics on 127.0.0.1:{metrics_one}"
        for target in (target_one, target_two):
            wait_until(lambda t=target: health(t, "readiness") == SERVING, timeout_s=90)
        with ComputeClient(target_one) as c1, ComputeClient(target_two) as c2:
            assert list(c1.model_info().adapters) == list(c2.model_info().adapters) == ["a"]
            first = c1.generate(text, greedy(4), adapter="a").result()
            assert first.stats.cached_tokens_remote == 0
            pages = first.stats.prompt_tokens // PAGE
            # Write-through is asynchronous: wait until the first worker's pages are in Redis.
            import redis
            db = redis.Redis.from_url(redis_server.url)
            wait_until(lambda: len(db.keys("cli:tiny-transformer-seed0:*")) >= pages)
            base = c2.generate(text, greedy(4)).result()
            assert base.stats.cached_tokens_remote == 0  # another namespace, other keys
            second = c2.generate(text, greedy(4), adapter="a").result()
            assert second.stats.cached_tokens_remote > 0
            assert second.stats.cached_tokens_remote + second.stats.computed_prompt_tokens == \
                second.stats.prompt_tokens
            assert second.token_ids == first.token_ids
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_one}/metrics",
                                         timeout=5).read().decode()
        assert "prefixcache_compute_l3_write_pages_ok_total" in scraped
        assert "prefixcache_compute_adapters_loaded 1.0" in scraped
        for proc in (one, two):
            proc.send_signal(signal.SIGTERM)
        assert one.wait(timeout=30) == 0, log_one()
        assert two.wait(timeout=30) == 0, log_two()
        assert "event=adapter_loaded" in log_one()


def test_cli_remote_cache_service_without_l3_refuses_lookup():
    """The lookup is the cache service's: a worker asking for it from a cache service without
    Redis exits 1 and says how to fix it."""
    with running_server() as cache_server:
        with compute_process("--model", "tiny-transformer", "--cache-service",
                             f"127.0.0.1:{cache_server.port}", "--page-size", str(PAGE),
                             "--device-pages", "16", "--redis-url",
                             "redis://127.0.0.1:1/0") as (proc, _, read_log):
            assert proc.wait(timeout=60) == 1
            log = read_log()
            assert "event=startup_failed" in log and "--no-l3-lookup" in log, log[-3000:]
