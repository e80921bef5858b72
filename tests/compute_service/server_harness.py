"""Helpers of the compute service's server tests: tiny engines served on loopback, a client,
sampling and prompt shorthands, health checks and `python -m compute_service` as a child."""
from __future__ import annotations

import contextlib
import functools
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig
from compute_service.model import ByteTokenizer, build_preset
from compute_service.server import ComputeServer, ServerConfig, serve
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.compute import ComputeClient, ComputeClientError
from tests.cache_service.grpc_harness import REPO

PAGE = 4
CONTEXT = 256  # device_pages * PAGE below
VOCAB = 320  # the tiny presets'
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
ABORT, LENGTH = pb.FINISH_REASON_ABORT, pb.FINISH_REASON_LENGTH
INVALID, OUT_OF_RANGE = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE


@functools.cache
def model(name: str):
    return build_preset(name, seed=3)


def make_engine(name: str = "tiny-transformer", cache=None, **cfg) -> Engine:
    settings = dict(page_size=PAGE, device_pages=CONTEXT // PAGE, token_budget=64, max_running=4,
                    max_context=CONTEXT, model_id=name, pool_id=f"worker-{name}")
    settings.update(cfg)
    return Engine(model(name), ByteTokenizer(), cache or CacheCore(), EngineConfig(**settings))


@contextlib.contextmanager
def running(engine: Engine, defaults=None,
            **config) -> Iterator[tuple[ComputeServer, ComputeClient]]:
    """An in-process server on 127.0.0.1 over `engine` (with the checkpoint's sampling
    `defaults`, if any) and a client of it; drained on exit."""
    config.setdefault("grace_s", 0.0)
    server = serve(engine, ServerConfig(host="127.0.0.1", port=0, **config), defaults)
    client = ComputeClient(f"127.0.0.1:{server.port}", timeout_s=10, generate_timeout_s=60)
    try:
        yield server, client
    finally:
        client.close()
        server.drain()


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
