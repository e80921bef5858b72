"""Every line the three services log parses as strict logfmt (tests/service_shell/logfmt.py):
`python -m cache_service`, `python -m compute_service` (tiny-transformer) and `python -m
gateway` (gRPC and HTTP) run as processes, serve a good request, refuse bad ones (not UTF-8, a
NaN float, an oversized prompt), and drain on SIGTERM; then their stderr is read line by line."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import grpc
import httpx

from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from stack.launcher import free_port
from tests.cache_service.grpc_harness import REPO
from tests.gateway.gateway_harness import wait_until
from tests.service_shell.logfmt import parse

NOT_UTF8 = b"\xc3\x28\xa0\xa1"


class _Service:
    def __init__(self, name: str, args: list[str], log_dir: Path):
        self.name, self.log = name, log_dir / f"{name}.log"
        with open(self.log, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", name, "--host", "127.0.0.1", "--port", "0", *args],
                cwd=REPO, stdout=subprocess.PIPE, stderr=err, text=True,
                env={**os.environ, "PREFIXCACHE_LOG_LEVEL": "DEBUG"})
        line = self.proc.stdout.readline()
        assert line.startswith("listening on "), f"{name}: {line!r}\n{self.log.read_text()}"
        self.address = line.split()[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()


def _call(address: str, method: str, data: bytes, stream: bool = False) -> grpc.StatusCode:
    with grpc.insecure_channel(address) as channel:
        try:
            if stream:
                list(channel.unary_stream(method)(data, timeout=30))
            else:
                channel.unary_unary(method)(data, timeout=30)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _exercise(cache: _Service, compute: _Service, gateway: _Service, http: str) -> None:
    bad_text = pb.GenerateRequest(text="Q7xZ").SerializeToString().replace(b"Q7xZ", NOT_UTF8)
    generate = "/prefixcache.v1.ComputeService/Generate"
    for address in (compute.address, gateway.address):
        assert _call(address, generate, bad_text, stream=True) == grpc.StatusCode.INVALID_ARGUMENT
    subscribe = cpb.SubscribeRequest(pool_id="w", heartbeat_interval_s=float("nan"))
    assert _call(cache.address, "/prefixcache.v1.CacheService/Subscribe",
                 subscribe.SerializeToString(), stream=True) == grpc.StatusCode.INVALID_ARGUMENT
    with grpc.insecure_channel(gateway.address) as channel:
        stub = pb_grpc.ComputeServiceStub(channel)
        wait_until(lambda: _generated(stub), timeout_s=120, what="gateway routes")
    r = httpx.post(f"{http}/v1/completions", json={"prompt": "a" * 200_000}, timeout=30)
    assert r.status_code == 400, r.text
    r = httpx.post(f"{http}/v1/completions", json={"prompt": "hello", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200, r.text


def _generated(stub: pb_grpc.ComputeServiceStub) -> bool:
    try:
        out = list(stub.Generate(pb.GenerateRequest(
            text="hello", sampling=pb.SamplingParams(max_tokens=2)), timeout=30))
    except grpc.RpcError:
        return False
    return out[-1].HasField("stats")


def test_every_service_log_line_is_logfmt(one_torch_thread):
    services: list[_Service] = []
    with tempfile.TemporaryDirectory(prefix="logfmt-") as tmp:
        log_dir = Path(tmp)
        try:
            cache = _Service("cache_service", [], log_dir)
            services.append(cache)
            compute = _Service("compute_service", [
                "--model", "tiny-transformer", "--cache-service", cache.address, "--pool-id",
                "w", "--page-size", "4", "--device-pages", "64", "--threads", "1",
                "--grace-s", "0"], log_dir)
            services.append(compute)
            http_port = free_port()
            gateway = _Service("gateway", [
                "--workers", f"{compute.address}@{cache.address}", "--allow-anonymous",
                "--http-port", str(http_port), "--grace-s", "0", "--heartbeat-interval-s",
                "0.2"], log_dir)
            services.append(gateway)
            _exercise(cache, compute, gateway, f"http://127.0.0.1:{http_port}")
        finally:
            for service in reversed(services):
                service.stop()
        for service in services:
            lines = service.log.read_text().splitlines()
            assert len(lines) >= 3, f"{service.name} logged too little:\n{lines}"
            events = set()
            for number, line in enumerate(lines, 1):
                try:
                    fields = parse(line)
                except ValueError as exc:
                    raise AssertionError(f"{service.name} line {number} is not logfmt ({exc}):"
                                         f"\n{line}") from None
                assert list(fields)[:3] == ["ts", "level", "logger"], line
                events.add(fields.get("event"))
            assert "request_unparsable" in events or service.name == "cache_service", events
            assert "server_stopped" in events or "drain_started" in events, events
