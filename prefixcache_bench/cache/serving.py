"""The gRPC server the `step` and `events` parts talk to: in a child process, as deployed, or in
this process."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from prefixcache_bench.cache.params import REPO
from cache_service.core import CacheCore
from cache_service.server import CacheServer, ServerConfig
from cache_service.zmq_publisher import ZmqEventPublisher, ZmqEventsConfig


@dataclass(slots=True)
class ServerHandle:
    target: str
    pid: int | None  # the server process, for its CPU time; None when in a thread
    # The vLLM-format ZMQ stream's PUB and replay ROUTER endpoints ("" when off).
    kv_endpoint: str = ""
    kv_replay_endpoint: str = ""

    def cpu_s(self) -> float | None:
        """User + system CPU seconds of the server process so far (Linux /proc)."""
        if self.pid is None:
            return None
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cache_server(mode: str, kv_events: bool = False) -> Iterator[ServerHandle]:
    """A cache server on 127.0.0.1 (any free port): `python -m cache_service` in a child process
    (as deployed: the server has its own interpreter lock), or a CacheServer in this process.
    `kv_events`: with the vLLM-format ZMQ stream on (PUB and replay ROUTER on free ports)."""
    endpoint = "tcp://127.0.0.1:*"
    if mode == "thread":
        core = CacheCore()
        publisher = None
        if kv_events:
            # The map encoding: the consumer (parts_zmq.py) reads events by name.
            publisher = ZmqEventPublisher(core, ZmqEventsConfig(endpoint, endpoint, encoding="map"))
        server = CacheServer(core, ServerConfig(host="127.0.0.1", port=0, grace_s=0.0),
                             publisher)
        server.start()
        try:
            yield ServerHandle(f"127.0.0.1:{server.port}", None,
                               *((publisher.endpoint, publisher.replay_endpoint)
                                 if publisher else ()))
        finally:
            server.drain()
        return
    flags = ["--kv-events-zmq-endpoint", endpoint,
             "--kv-events-zmq-replay-endpoint", endpoint] if kv_events else []
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cache_service", "--host", "127.0.0.1", "--port", "0",
             "--log-level", "WARNING", "--grace-s", "0", "--metrics-port", "0", *flags],
            cwd=REPO, stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            line = proc.stdout.readline()
            if not line.startswith("listening on "):
                proc.wait(10)
                errors.seek(0)
                raise RuntimeError(f"cache server did not start: {line!r}\n{errors.read()}")
            handle = ServerHandle(f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}", proc.pid)
            if kv_events:  # "kv events on ENDPOINT replay ENDPOINT"
                words = proc.stdout.readline().split()
                handle.kv_endpoint, handle.kv_replay_endpoint = words[3], words[5]
            yield handle
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
