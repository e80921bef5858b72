"""Helpers for the gRPC tests: in-process servers on loopback, `python -m cache_service`
subprocesses, and short-hand for the requests the tests repeat."""
from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator

import grpc

from cache_service.core import CacheCore
from cache_service.server import CacheServer, ServerConfig
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache.v1 import cache_service_pb2_grpc as pb_grpc
from prefixcache_client.hash import chain_hashes, namespace_seed, token_bytes

REPO = pathlib.Path(__file__).resolve().parents[2]
PAGE = 4
MODEL = "test-model"
# 3 full pages + 1 token: the last prompt token is always computed, so all 3 pages can hit.
PROMPT = list(range(100, 100 + 3 * PAGE + 1))


@contextlib.contextmanager
def running_server(core: CacheCore | None = None, **config) -> Iterator[CacheServer]:
    """A started server on 127.0.0.1, any free port; drained (without grace) on exit."""
    config.setdefault("grace_s", 0.0)
    config.setdefault("port", 0)
    server = CacheServer(core or CacheCore(), ServerConfig(host="127.0.0.1", **config))
    server.start()
    try:
        yield server
    finally:
        server.drain()


@contextlib.contextmanager
def stub_for(server: CacheServer) -> Iterator[pb_grpc.CacheServiceStub]:
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield pb_grpc.CacheServiceStub(channel)


def register(pool_id: str = "pool-a", epoch: int = 1, **fields) -> pb.RegisterPoolRequest:
    fields.setdefault("device_pages", 16)
    return pb.RegisterPoolRequest(pool_id=pool_id, epoch=epoch, page_size=PAGE, model_id=MODEL,
                                  **fields)


def match_op(tokens: list[int] = PROMPT, request_id: str = "r", **fields) -> pb.MatchOp:
    return pb.MatchOp(request_id=request_id, token_ids=tokens, **fields)


def expected_hashes(tokens: list[int], adapter: str = "", salt: str = "") -> list[bytes]:
    return chain_hashes(namespace_seed(MODEL, adapter, salt), token_bytes(tokens), PAGE)


def cache_prompt(step, pool_id: str = "pool-a", epoch: int = 1,
                 tokens: list[int] = PROMPT) -> None:
    """Match, allocate, publish and release `tokens` through `step` (a client's or a core's), so
    that the pool caches its full pages."""
    lease = step(pb.StepRequest(pool_id=pool_id, epoch=epoch,
                                matches=[match_op(tokens)])).matches[0].lease_id
    pages = len(tokens) // PAGE
    step(pb.StepRequest(pool_id=pool_id, epoch=epoch,
                        allocations=[pb.AllocateOp(lease_id=lease, num_pages=pages)]))
    step(pb.StepRequest(pool_id=pool_id, epoch=epoch,
                        publishes=[pb.PublishOp(lease_id=lease, computed_pages=pages)],
                        releases=[pb.ReleaseOp(lease_id=lease)]))


class ServerProcess:
    """`python -m cache_service` on 127.0.0.1 as a child process; `port` is the one it prints."""

    def __init__(self, port: int | None = 0, *args: str, env: dict[str, str] | None = None):
        self._log = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, "-m", "cache_service", "--host", "127.0.0.1", *args]
        if port is not None:
            cmd += ["--port", str(port)]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=self._log,
                                     text=True, env={**os.environ, **(env or {})})
        self.port = self._read_port()

    def _read_port(self, timeout_s: float = 20.0) -> int:
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()),
                                  daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0].startswith("listening on "):
            self.kill()
            raise RuntimeError(f"server did not start: {line!r}\n{self.log()}")
        return int(line[0].rsplit(":", 1)[1])

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def exit_code(self, timeout_s: float = 40.0) -> int:
        """The exit code, waiting up to `timeout_s` (by default past the ExitGuard's 30 s bound on a
        drain, so only a process that ignores it times out); on a timeout, fails with its log."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"no exit within {timeout_s} s:\n{self.log()}") from None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.kill()
        self.proc.stdout.close()
        self._log.close()


@contextlib.contextmanager
def server_process(port: int | None = 0, *args: str, **kwargs) -> Iterator[ServerProcess]:
    proc = ServerProcess(port, *args, **kwargs)
    try:
        yield proc
    finally:
        proc.close()

