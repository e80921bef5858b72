"""Suite-wide settings that must be in place before any test module imports torch or triton."""
import os
import shutil

# Triton kernels run on CPU through the interpreter when there is no GPU. It must be set before
# triton is first imported, so it lives here, at the root of the suite.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")


import subprocess  # noqa: E402

import pytest  # noqa: E402
import redis  # noqa: E402

from prefixcache_bench.local_redis import is_process, launch, serving  # noqa: E402


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one intra-op thread for a module: the tests share two cores with other xdist
    workers, and torch's default thread count oversubscribes them (an engine step of a tiny
    model gets many times slower). torch is imported here only when a test asks for it."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


class RedisServer:
    """A throwaway redis-server on a free port, which tests may stop, pause or flush."""

    def __init__(self, tmp_path):
        self.dir = tmp_path
        self.proc: subprocess.Popen | None = None
        self.port = launch(self._start_on)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def _start_on(self, port: int) -> bool:
        self.port = port
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), "--maxmemory", "256mb",
             "--maxmemory-policy", "allkeys-lru"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return serving(self.proc, is_process(redis.Redis(port=port, socket_timeout=0.2),
                                             self.proc))

    def start(self) -> None:
        """Again on the same port (after `stop`): a test's restart of the store."""
        if not self._start_on(self.port):
            raise RuntimeError(f"redis-server exited on restart: port {self.port} taken")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def pause(self) -> None:
        self.proc.send_signal(19)  # SIGSTOP: accepts connections, answers nothing

    def resume(self) -> None:
        self.proc.send_signal(18)  # SIGCONT


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path)
    try:
        yield server
    finally:
        server.resume() if server.proc and server.proc.poll() is None else None
        server.stop()


@pytest.fixture(scope="session")
def _session_redis_cluster(tmp_path_factory):
    from prefixcache_bench.local_redis import RedisClusterServers

    cluster = RedisClusterServers(tmp_path_factory.mktemp("redis-cluster"))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def redis_cluster(_session_redis_cluster):
    """A 3-master Redis Cluster (prefixcache_bench/local_redis.py) shared by the session,
    emptied for each test; a test that kills a master uses `own_redis_cluster`."""
    _session_redis_cluster.flush()
    return _session_redis_cluster


@pytest.fixture
def own_redis_cluster(tmp_path):
    """A 3-master Redis Cluster of this test alone (it may kill masters)."""
    from prefixcache_bench.local_redis import RedisClusterServers

    cluster = RedisClusterServers(tmp_path)
    try:
        yield cluster
    finally:
        cluster.stop()
