"""A live fleet for the end-to-end tests: one real cache service (in-process), two real compute
workers (`python -m compute_service --model tiny-hybrid`, pools w1 and w2) and the gateway as
`python -m gateway` with its HTTP API, all on loopback. Tests that kill workers mark the stack broken; the next
`LiveStacks.get()` starts a fresh one."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.core import CacheCore
from cache_service.server import CacheServer, ServerConfig
from prefixcache.v1 import gateway_pb2 as gpb
from stack.launcher import free_port
from tests.cache_service.grpc_harness import REPO
from tests.gateway.gateway_harness import TOKENS, Caller, wait_until

PAGE = 4
DEVICE_PAGES = 256  # context 1024 tokens
WORKERS = ("w1", "w2")
# Worker readiness waits on torch's import and the model build (~5 s each on a busy CPU).
_START_TIMEOUT_S = 90.0


def _spawn(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """Starts `python -m ...` and returns it with the address of its `listening on` line."""
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", *args], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=err,
                                env={**os.environ, "PREFIXCACHE_LOG_LEVEL": "INFO"})
    line = proc.stdout.readline()
    assert line.startswith("listening on "), f"{args[0]}: {line!r}\n{log.read_text()}"
    return proc, line.split()[-1]


class LiveStack:
    """`model`: the workers' --model (a preset or a checkpoint directory); `gateway_args`: more
    flags for the gateway. The gateway always serves its HTTP API too (`http_url`)."""

    def __init__(self, workdir: Path, model: str = "tiny-hybrid",
                 gateway_args: tuple[str, ...] = ()):
        self.dir, self.model = workdir, model
        self.broken = False
        self.cache = CacheServer(CacheCore(), ServerConfig(host="127.0.0.1", port=0,
                                                           grace_s=0.0)).start()
        cache_addr = f"127.0.0.1:{self.cache.port}"
        self.workers: dict[str, tuple[subprocess.Popen, str]] = {}
        self.gateway: subprocess.Popen | None = None
        try:
            for name in WORKERS:  # started together: their torch imports overlap
                self.workers[name] = _spawn(
                    ["compute_service", "--model", model, "--cache-service", cache_addr,
                     "--pool-id", name, "--host", "127.0.0.1", "--port", "0", "--page-size",
                     str(PAGE), "--device-pages", str(DEVICE_PAGES), "--threads", "1",
                     "--grace-s", "0"], workdir / f"{name}.log")
            tenants = workdir / "tenants.json"
            tenants.write_text(json.dumps({"tokens": {
                t: {"tenant": v.name, "salt": v.salt} for t, v in TOKENS.items()}}))
            spec = ",".join(f"{addr}@{cache_addr}" for _, addr in self.workers.values())
            # A long probe interval: a killed worker is found out by the request that hits it.
            self.gateway, self.address = _spawn(
                ["gateway", "--host", "127.0.0.1", "--port", "0", "--workers", spec,
                 "--tenants-file", str(tenants), "--metrics-port", str(free_port()), "--probe-interval-s",
                 "60", "--heartbeat-interval-s", "0.2", "--grace-s", "0",
                 "--http-port", str(free_port()), *gateway_args],
                workdir / "gateway.log")
            self.metrics_port = int(self.gateway.stdout.readline().rsplit(":", 1)[1])
            http_port = int(self.gateway.stdout.readline().rsplit(":", 1)[1])
            self.http_url = f"http://127.0.0.1:{http_port}"
            self.caller = Caller(self.address)
            wait_until(self._ready, timeout_s=_START_TIMEOUT_S, what="stack ready")
        except BaseException:
            self.close()
            raise

    def _ready(self) -> bool:
        try:
            with grpc.insecure_channel(self.address) as ch:
                status = health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service="readiness"), timeout=2).status
            workers = self.caller.gateway.ListWorkers(gpb.ListWorkersRequest(),
                                                      metadata=Caller.meta(), timeout=2).workers
        except grpc.RpcError:
            return False
        return status == health_pb2.HealthCheckResponse.SERVING and len(workers) == len(WORKERS)

    def worker_address(self, name: str) -> str:
        return self.workers[name][1]

    def kill(self, name: str) -> None:
        """SIGKILL: no drain, no unregister; the stack is broken from here on."""
        self.broken = True
        proc = self.workers[name][0]
        proc.kill()
        proc.wait(10)

    def metric(self, name: str, **labels: str) -> float:
        text = urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                      timeout=5).read().decode()
        want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
        for line in text.splitlines():
            key, _, value = line.rpartition(" ")
            if key == (f"{name}{{{want}}}" if want else name):
                return float(value)
        return 0.0

    def gateway_log(self) -> str:
        return (self.dir / "gateway.log").read_text()

    def close(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.send_signal(signal.SIGTERM)
            try:
                self.gateway.wait(15)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
        for proc, _ in self.workers.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for proc in [self.gateway, *(p for p, _ in self.workers.values())]:
            if proc is not None and proc.stdout is not None:
                proc.stdout.close()
        self.cache.drain()


class LiveStacks:
    """The session's stack, restarted after a test broke it. `model` and `gateway_args` as
    LiveStack's; `model` may be a callable making the checkpoint in a directory it is given."""

    def __init__(self, model=None, gateway_args: tuple[str, ...] = ()) -> None:
        self._model, self._gateway_args = model, gateway_args
        self._stack: LiveStack | None = None
        self._tmp = tempfile.TemporaryDirectory(prefix="gateway-e2e-")
        self._count = 0

    def get(self) -> LiveStack:
        if self._stack is not None and self._stack.broken:
            self._stack.close()
            self._stack = None
        if self._stack is None:
            self._count += 1
            workdir = Path(self._tmp.name) / f"stack{self._count}"
            workdir.mkdir()
            model = self._model(Path(self._tmp.name)) if callable(self._model) else self._model
            args = tuple(a.replace("{model}", model or "") for a in self._gateway_args)
            self._stack = LiveStack(workdir, model or "tiny-hybrid", args)
        return self._stack

    def close(self) -> None:
        if self._stack is not None:
            self._stack.close()
        self._tmp.cleanup()
