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

from cache_service.bench.params import REPO
from cache_service.core import CacheCore
from cache_service.server import CacheServer, ServerConfig


@dataclass(slots=True)
class ServerHandle:
    target: str
    pid: int | None  # the server process, for its CPU time; None when in a thread

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
def cache_server(mode: str) -> Iterator[ServerHandle]:
    """A cache server on 127.0.0.1 (any free port): `python -m cache_service` in a child process
    (as deployed: the server has its own interpreter lock), or a CacheServer in this process."""
    if mode == "thread":
        server = CacheServer(CacheCore(), ServerConfig(host="127.0.0.1", port=0, grace_s=0.0))
        server.start()
        try:
            yield ServerHandle(f"127.0.0.1:{server.port}", None)
        finally:
            server.drain()
        return
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = subprocess.Popen(
            [sys.executable, "-m", "cache_service", "--host", "127.0.0.1", "--port", "0",
             "--log-level", "WARNING", "--grace-s", "0", "--metrics-port", "0"],
            cwd=REPO, stdout=subprocess.PIPE, stderr=errors, text=True)
        try:
            line = proc.stdout.readline()
            if not line.startswith("listening on "):
                proc.wait(10)
                errors.seek(0)
                raise RuntimeError(f"cache server did not start: {line!r}\n{errors.read()}")
            yield ServerHandle(f"127.0.0.1:{line.rsplit(':', 1)[1].strip()}", proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()
