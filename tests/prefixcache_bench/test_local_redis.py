"""The throwaway redis-servers the suite starts move to another port when theirs is taken
between choosing it and binding it (a CI run once failed on "redis-server on port N did not
start"): an outgoing connection's ephemeral port, or another test's server, can take it."""
import socket

import pytest

from prefixcache_bench import local_redis
from prefixcache_bench.local_redis import RedisClusterServers
from stack import launcher
from tests.conftest import RedisServer


@pytest.fixture
def offer_first(monkeypatch):
    """Make `free_ports` offer the given ports first, one a call, then free ones."""
    def offer(*ports: int) -> None:
        real, queue = local_redis.free_ports, [[p] for p in ports]
        monkeypatch.setattr(local_redis, "free_ports",
                            lambda n, taken=(): queue.pop(0) if queue else real(n, taken))
    return offer


def test_a_server_moves_on_from_a_port_a_socket_holds(tmp_path, offer_first):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        offer_first(held.getsockname()[1])
        server = RedisServer(tmp_path)
        try:
            assert server.port != held.getsockname()[1]
            assert server.proc.poll() is None
        finally:
            server.stop()


def test_a_server_is_not_taken_for_another_answering_on_its_port(tmp_path, offer_first):
    """Another redis-server answers PING on the port: only the own process id counts."""
    (tmp_path / "other").mkdir()
    other = RedisServer(tmp_path / "other")
    try:
        offer_first(other.port)
        mine = RedisServer(tmp_path)
        try:
            assert mine.port != other.port
            assert mine.proc.poll() is None and other.proc.poll() is None
        finally:
            mine.stop()
    finally:
        other.stop()


def test_a_cluster_node_moves_on_from_a_taken_port(tmp_path, offer_first):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        offer_first(held.getsockname()[1])
        with RedisClusterServers(tmp_path) as cluster:
            assert held.getsockname()[1] not in cluster.ports and len(cluster.ports) == 3
            assert all(cluster.node(p).cluster("info")["cluster_state"] == "ok"
                       for p in cluster.ports)


def test_free_ports_are_drawn_below_the_ephemeral_range_and_skip_held_ones(monkeypatch):
    """stack.launcher.free_port: outgoing connections' local ports (and bind(0)'s) come from
    the ephemeral range, so the ports handed to services are drawn below it; a port a socket
    holds, or one in `taken`, is never handed out, nor one whose bus port is held."""
    low = int(launcher._EPHEMERAL_RANGE.read_text().split()[0])
    good, other = launcher.free_port(bus_offset=10000), launcher.free_port(bus_offset=10000)
    with socket.socket() as held, socket.socket() as bus:
        held.bind(("127.0.0.1", 0))
        bus.bind(("127.0.0.1", 0))
        # offered in turn: a held port, one taken, one whose bus port is held, then a free one
        tries = iter([held.getsockname()[1], other, bus.getsockname()[1] - 10000, good])
        monkeypatch.setattr(launcher._pick, "randrange", lambda a, b: next(tries))
        assert launcher.free_port(taken=[other], bus_offset=10000) == good
    monkeypatch.undo()
    ports = [launcher.free_port() for _ in range(50)]
    assert all(launcher.LOWEST_PORT <= p < low for p in ports)
    assert all(p + 10000 < low for p in local_redis.free_ports(5))
