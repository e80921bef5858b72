"""Start the services of a local stack as child processes, one log each, health-checked in order,
and stop them cleanly (SIGTERM, then SIGKILL after a grace period), also on Ctrl-C."""
from __future__ import annotations

import pathlib
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


# Ports handed to services started later are drawn from LOWEST_PORT up to the kernel's ephemeral
# range (net.ipv4.ip_local_port_range, 32768-60999 by default). bind(0) and every outgoing
# connection's local port come from that range, so a port chosen there and released before its
# service binds it can be taken in between (a CI run lost a redis-server's port so). Below it,
# only another such choice can take it.
LOWEST_PORT = 10000
_EPHEMERAL_RANGE = pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range")
_pick = random.Random()  # its own seed: tests that seed `random` must not pick alike


def free_port(taken: Collection[int] = (), bus_offset: int = 0) -> int:
    """A loopback port free now, below the ephemeral range and not in `taken`; with
    `bus_offset`, port + bus_offset is free and below that range too (a Redis Cluster node's
    bus port is its port + 10000). Free now is not reserved: a service that cannot bind it
    exits, and `prefixcache_bench.local_redis.launch` shows how to start again elsewhere. Where
    the range below holds no free port, one of bind(0)'s."""
    try:
        ephemeral_low = int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    high = min(ephemeral_low, 65536) - bus_offset
    for _ in range(200 if high > LOWEST_PORT else 0):
        port = _pick.randrange(LOWEST_PORT, high)
        if port not in taken and all(_bindable(p) for p in {port, port + bus_offset}):
            return port
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken and port + bus_offset < 65536 and _bindable(port + bus_offset):
            return port


def _bindable(port: int) -> bool:
    if not 0 < port < 65536:  # (a port + bus_offset past the last one)
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass(slots=True)
class Service:
    name: str
    argv: list[str]
    log_path: pathlib.Path
    address: str = ""
    proc: subprocess.Popen | None = None
    log: object = None


@dataclass
class Stack:
    """The processes of one local run; `stop()` ends them in reverse start order."""
    run_dir: pathlib.Path
    services: list[Service] = field(default_factory=list)
    # Signal handling (install_stop_signals): SIGINT/SIGTERM raise KeyboardInterrupt, except while
    # a child is being spawned and recorded (deferred to the end of it) or once stopping began.
    _critical: bool = False
    _deferred: bool = False
    _stopping: bool = False

    def install_stop_signals(self) -> None:
        """SIGINT and SIGTERM stop the launcher (KeyboardInterrupt), never between a child's
        spawn and its record in `services`, so that `stop()` always knows every child."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self._stopping:
            return  # already stopping every child: a second Ctrl-C must not cut that short
        if self._critical:
            self._deferred = True
            return
        raise KeyboardInterrupt

    def _spawn(self, svc: Service) -> None:
        self._critical = True
        try:
            svc.proc = subprocess.Popen(svc.argv, stdout=svc.log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # Ctrl-C reaches us, not them
            if svc not in self.services:
                self.services.append(svc)
        finally:
            self._critical = False
        if self._deferred:
            self._deferred = False
            raise KeyboardInterrupt

    def start(self, name: str, argv: list[str], address: str, ready_timeout_s: float = 120.0,
              grpc_health: bool = True) -> Service:
        svc = Service(name, argv, self.run_dir / f"{name}.log", address)
        svc.log = open(svc.log_path, "w")
        self._spawn(svc)
        wait_ready(svc, ready_timeout_s, grpc_health)
        return svc

    def restart(self, name: str, ready_timeout_s: float = 120.0, grpc_health: bool = True) -> Service:
        """Starts a service that exited (killed by a fault drill) again with the same command
        and address, appending to its log, and waits until it is ready."""
        svc = self.get(name)
        if svc.proc is not None and svc.proc.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {svc.proc.pid})")
        self._spawn(svc)
        wait_ready(svc, ready_timeout_s, grpc_health)
        return svc

    def get(self, name: str) -> Service:
        return next(svc for svc in self.services if svc.name == name)

    def has(self, name: str) -> bool:
        return any(svc.name == name for svc in self.services)

    def stop_one(self, name: str, grace_s: float = 20.0) -> int | None:
        svc = self.get(name)
        if svc.proc is not None and svc.proc.poll() is None:
            svc.proc.send_signal(signal.SIGTERM)
            try:
                svc.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                svc.proc.kill()
                svc.proc.wait()
        return svc.proc.returncode

    def stop(self, grace_s: float = 20.0) -> list[tuple[str, int | None]]:
        """Stops every child (idempotent); signals are ignored meanwhile."""
        self._stopping = True
        codes = []
        for svc in reversed(self.services):
            codes.append((svc.name, self.stop_one(svc.name, grace_s)))
            if not svc.log.closed:
                svc.log.close()
        return codes


def wait_ready(svc: Service, timeout_s: float, grpc_health: bool) -> None:
    """Until the gRPC readiness check answers SERVING (or, for Redis, a PING answers)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode}; see {svc.log_path}")
        if (grpc_health and _serving(svc.address)) or (not grpc_health and _redis_ping(svc.address)):
            return
        time.sleep(0.2)
    raise RuntimeError(f"{svc.name} not ready after {timeout_s:.0f} s; see {svc.log_path}")


def _serving(address: str) -> bool:
    try:
        with grpc.insecure_channel(address) as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=1.0)
            return resp.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def _redis_ping(address: str) -> bool:
    host, port = address.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=0.5) as c:
            c.sendall(b"PING\r\n")
            return c.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def python_module(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]
