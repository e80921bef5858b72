"""A throwaway Redis Cluster of real redis-server processes on loopback ports: what the L3
cluster tests (fixtures `redis_cluster` and `own_redis_cluster` in tests/conftest.py) and
`python -m prefixcache_bench.tiers --cluster` run against.

Three masters, no replicas, `cluster-require-full-coverage no` (as deploy/k8s/components/
redis-cluster runs it): a master that dies leaves the other slots served.

Also how the suite starts every throwaway redis-server (`start_redis`, `launch`): a port is
free when chosen, not reserved, so a server whose port was taken before it bound it is started
again on another one.
"""
from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Collection
from pathlib import Path

import redis
from redis.crc import key_slot

from stack.launcher import free_port


def free_ports(n: int, taken: Collection[int] = ()) -> list[int]:
    """n free loopback ports, none in `taken`, whose port + 10000 (the cluster bus port) is free
    too (stack.launcher.free_port: below the ephemeral range, both). Free now, not reserved:
    `launch` starts again elsewhere when one is taken before its server binds it."""
    ports: list[int] = []
    while len(ports) < n:
        ports.append(free_port([*taken, *ports], bus_offset=10000))
    return ports


def serving(proc: subprocess.Popen, ready: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Wait until `ready()` (a `redis.RedisError` is a not yet): True; False when `proc` exited
    first. A redis-server exits when another process took its port (or its bus port) after
    `free_ports` saw it free: an outgoing connection's ephemeral port can be any of them. After
    `timeout_s` it is killed and the wait raises."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None:
        try:
            if ready():
                return True
        except redis.RedisError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"redis-server (pid {proc.pid}) did not answer in {timeout_s} s")
        time.sleep(0.02)
    return False


def is_process(client: redis.Redis, proc: subprocess.Popen) -> Callable[[], bool]:
    """`serving`'s test that the server answering through `client` is `proc`, not another one
    that holds the port."""
    return lambda: client.info("server")["process_id"] == proc.pid


def launch(start: Callable[[int], bool], taken: Collection[int] = (), tries: int = 5) -> int:
    """The port on which `start(port)` (True once its server answers, as `serving`) succeeded,
    trying a new free port each time its server exited before answering."""
    for _ in range(tries):
        port, = free_ports(1, taken)
        if start(port):
            return port
    raise RuntimeError(f"redis-server exited before answering on {tries} free ports")


def start_redis(args_on: Callable[[int], list[str]],
                ready_on: Callable[[int], bool]) -> tuple[subprocess.Popen, int]:
    """redis-server with `args_on(port)` on a free port, once `ready_on(port)`: the process and
    its port (`launch`: another port when the server exits before it is ready)."""
    procs: dict[int, subprocess.Popen] = {}

    def on(port: int) -> bool:
        procs[port] = subprocess.Popen(["redis-server", *args_on(port)],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return serving(procs[port], lambda: ready_on(port))

    port = launch(on)
    return procs[port], port


class RedisClusterServers:
    """`masters` redis-server processes joined into one cluster (`redis-cli --cluster create`)."""

    def __init__(self, tmp_path: Path, masters: int = 3, maxmemory: str = "128mb",
                 extra_args: tuple[str, ...] = (), admin: tuple[str, str] | None = None):
        """`extra_args` go to every redis-server (e.g. ACL users); `admin` (user, password)
        is who runs the cluster's creation and administration when `default` is off."""
        self.maxmemory, self.extra_args, self.admin = maxmemory, tuple(extra_args), admin
        self.dir = tmp_path
        self.procs: dict[int, subprocess.Popen] = {}
        self.ports: list[int] = []
        try:
            for _ in range(masters):
                self.ports.append(launch(self.start, taken=self.ports))
            hosts = [f"127.0.0.1:{p}" for p in self.ports]
            subprocess.run(["redis-cli", *self._auth_args(), "--cluster", "create", *hosts,
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=60)
            self.wait_ok()
        except BaseException:
            self.stop()  # no fixture yields this cluster: nobody else would stop its nodes
            raise
        self.url = f"redis+cluster://127.0.0.1:{self.ports[0]}"

    def start(self, port: int) -> bool:
        """One node on `port`: True once it answers, False when it exited first (`serving`)."""
        node_dir = self.dir / str(port)
        node_dir.mkdir(exist_ok=True)
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(node_dir), "--cluster-enabled", "yes",
             "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", "2000",
             "--cluster-require-full-coverage", "no", "--maxmemory", self.maxmemory,
             "--maxmemory-policy", "allkeys-lru", *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        if serving(self.procs[port], is_process(self.node(port, socket_timeout=0.2),
                                                self.procs[port])):
            return True
        del self.procs[port]
        return False

    def _auth_args(self) -> list[str]:
        if self.admin is None:
            return []
        return ["--user", self.admin[0], "--pass", self.admin[1], "--no-auth-warning"]

    def node(self, port: int, **kwargs) -> redis.Redis:
        """An admin client of one node."""
        if self.admin is not None:
            kwargs.update(username=self.admin[0], password=self.admin[1])
        return redis.Redis(port=port, **kwargs)

    def wait_ok(self, timeout_s: float = 20.0) -> None:
        """Until every live node reports cluster_state:ok (slots assigned, gossip settled)."""
        deadline = time.monotonic() + timeout_s
        while True:
            states = [self.node(p).cluster("info")["cluster_state"]
                      for p, proc in self.procs.items() if proc.poll() is None]
            if all(s == "ok" for s in states):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"cluster not ok: {states}")
            time.sleep(0.05)

    def master_of(self, key: str) -> int:
        """The port of the master serving `key`'s slot."""
        slot = key_slot(key.encode())
        live = next(p for p, proc in self.procs.items() if proc.poll() is None)
        for start, end, (_, port, *_), *_ in self.node(live).execute_command(
                "CLUSTER", "SLOTS"):
            if start <= slot <= end:
                return port
        raise KeyError(slot)

    def flush(self) -> None:
        for port, proc in self.procs.items():
            if proc.poll() is None:
                self.node(port).flushall()

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def __enter__(self) -> RedisClusterServers:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
