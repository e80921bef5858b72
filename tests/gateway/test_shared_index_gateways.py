"""Two gateway replicas with `--index-backend redis` (gateway/assembly.py) against one real
redis-server, one real cache service over loopback gRPC and two fake workers: pages a worker
publishes are seen by both replicas' routing (the same preview, the same route), each worker's
events are written by exactly one replica (its lease holder), a replica that stops leaves the
other routing from the index intact, writing the workers' new events itself, and Redis going
down and coming back empty costs prefix knowledge only while it is away; and one replica on a
Redis Cluster."""
from __future__ import annotations

import contextlib

import pytest

from gateway.__main__ import config_from_args, parse_args
from gateway.core.discovery import WorkerAddress
from tests.cache_service.grpc_harness import running_server
from tests.gateway.gateway_harness import (Caller, FakeWorker, cache_prompt, register_pool,
                                           running_gateway, settings, wait_until)
from tests.gateway.server_helpers import list_workers, preview, prompt, sample

METRIC = "prefixcache_gateway_shared_index"


def routed_to(caller: Caller, tokens: list[int]) -> tuple[str, str]:
    resp = preview(caller, tokens)
    return resp.worker, resp.reason


def test_two_replicas_route_from_one_shared_index_and_survive_one_leaving(redis_server):
    with running_server() as cache:
        workers = {name: FakeWorker(name) for name in ("w1", "w2")}
        for name in workers:
            register_pool(cache.core, name)
        cache_addr = f"127.0.0.1:{cache.port}"
        addresses = [WorkerAddress(w.address, cache_addr) for w in workers.values()]
        shared = dict(index_backend="redis", index_redis_url=redis_server.url,
                      index_namespace="e2e")
        try:
            with contextlib.ExitStack() as stack, \
                    running_gateway(lambda: addresses, **shared) as gw_a:
                # Replica a starts first and takes both leases; b only reads, until a leaves.
                wait_until(lambda: gw_a.indexers.held() == 2, what="a holds every lease")
                gw_b = stack.enter_context(running_gateway(lambda: addresses, **shared))
                callers = [Caller(gw_a.address), Caller(gw_b.address)]
                wait_until(lambda: all(len(list_workers(c)) == 2 for c in callers)
                           and gw_a.router.ready() and gw_b.router.ready(), what="both ready")
                assert gw_b.indexers.held() == 0
                tokens = prompt(1)
                cache_prompt(cache.core, "w2", tokens, salt="salt-a")
                wait_until(lambda: all(routed_to(c, tokens)[0] == "w2" for c in callers),
                           what="both replicas see w2's pages")
                a, b = (routed_to(c, tokens) for c in callers)
                assert a == b and a[1].startswith("holds 60 of 64 prompt tokens (device 60")
                assert [c.generate(tokens)[-1].stats.worker for c in callers] == ["w2", "w2"]
                # (now 64: a replica's policy also counts the pages it routed lately)
                seen_by_b = routed_to(callers[1], tokens)
                # The replicas hold no index of their own: the pages are in Redis only.
                assert gw_a.router.index.stats().entries == gw_b.router.index.stats().entries == 0
                for gw in (gw_a, gw_b):
                    assert sample(gw, f"{METRIC}_redis_down") == 0
                    assert sample(gw, f"{METRIC}_lookups_total") > 0
                    assert sample(gw, f"{METRIC}_round_trip_seconds_count") > 0
                assert sample(gw_a, f"{METRIC}_leases_held") == 2
                assert sample(gw_b, f"{METRIC}_leases_held") == 0

                gw_a.drain()  # releases its leases: replica b takes them over
                callers[0].close()
                wait_until(lambda: gw_b.indexers.held() == 2, what="b takes over every lease")
                assert routed_to(callers[1], tokens) == seen_by_b  # the index outlived a
                later = prompt(2)
                cache_prompt(cache.core, "w1", later, salt="salt-a")
                wait_until(lambda: routed_to(callers[1], later)[0] == "w1",
                           what="b writes and sees w1's new pages")
                assert callers[1].generate(later)[-1].stats.worker == "w1"

                # Redis down: routing goes on by load, and the metrics say so.
                redis_server.stop()
                assert callers[1].generate(prompt(3))[-1].stats.worker in workers
                wait_until(lambda: sample(gw_b, f"{METRIC}_redis_down") == 1, what="redis_down")
                assert sample(gw_b, f"{METRIC}_failures_total") > 0
                meanwhile = prompt(4)  # published while no indexer can write
                cache_prompt(cache.core, "w2", meanwhile, salt="salt-a")
                # Back, empty (no persistence): the indexers take their leases again and
                # rebuild the index from the cache service's snapshots.
                redis_server.start()
                wait_until(lambda: routed_to(callers[1], meanwhile) == ("w2", b[1])
                           and sample(gw_b, f"{METRIC}_redis_down") == 0, timeout_s=20,
                           what="index rebuilt after Redis came back")
                wait_until(lambda: gw_b.indexers.held() == 2, what="b holds both leases again")
                callers[1].close()
        finally:
            for w in workers.values():
                w.stop()


def test_a_replica_whose_feed_process_reads_the_streams_routes_from_the_shared_index(
        redis_server):
    """`--feed-process` beside `--index-backend redis`: the indexers write the pages to Redis,
    the feed process's frames keep the workers streaming (their load), and the replica routes
    to the holder of a prompt's pages with none of them in its own index."""
    with running_server() as cache:
        workers = {name: FakeWorker(name) for name in ("w1", "w2")}
        for name in workers:
            register_pool(cache.core, name)
        addresses = [WorkerAddress(w.address, f"127.0.0.1:{cache.port}")
                     for w in workers.values()]
        try:
            with running_gateway(lambda: addresses, index_backend="redis",
                                 index_redis_url=redis_server.url, index_namespace="fp",
                                 worker=settings(feed_process=True)) as gw:
                caller = Caller(gw.address)
                wait_until(lambda: gw.indexers.held() == 2 and gw.router.ready()
                           and all(gw.router.get(n).streaming for n in workers),
                           timeout_s=20, what="leases held, streams read by the feed process")
                assert gw.workers.remote is not None and gw.workers.remote.pid is not None
                tokens = prompt(1)
                cache_prompt(cache.core, "w2", tokens, salt="salt-a")
                wait_until(lambda: routed_to(caller, tokens)[0] == "w2", what="w2's pages seen")
                assert caller.generate(tokens)[-1].stats.worker == "w2"
                assert gw.router.index.stats().entries == 0  # in Redis only
                caller.close()
        finally:
            for w in workers.values():
                w.stop()


@pytest.mark.parametrize("flags, message", [
    (["--index-backend", "redis"], "--index-backend redis needs --index-redis-url"),
    (["--index-backend", "redis", "--index-redis-url", "redis://localhost:6379/0",
      "--index-namespace", "a:b"], "index namespace 'a:b'"),
])
def test_index_backend_flags_are_checked(flags, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--workers", "localhost:50051", "--allow-anonymous", *flags])
    assert message in capsys.readouterr().err


def test_index_backend_flags_reach_the_gateway_config():
    args = parse_args(["--workers", "localhost:50051", "--allow-anonymous", "--index-backend",
                       "redis", "--index-redis-url", "redis://127.0.0.1:6379/0",
                       "--index-namespace", "fleet-a"])
    cfg = config_from_args(args)
    assert (cfg.index_backend, cfg.index_redis_url, cfg.index_namespace) == (
        "redis", "redis://127.0.0.1:6379/0", "fleet-a")
    assert config_from_args(parse_args(["--workers", "localhost:50051",
                                        "--allow-anonymous"])).index_backend == "memory"


def test_a_gateway_indexes_and_routes_on_a_redis_cluster(redis_cluster):
    """`--index-redis-url redis+cluster://`: the same indexing and routing on a 3-master Redis
    Cluster, whose page keys spread over the masters (gateway/core/shared_index.py)."""
    args = parse_args(["--workers", "localhost:50051", "--allow-anonymous", "--index-backend",
                       "redis", "--index-redis-url", redis_cluster.url])
    assert config_from_args(args).index_redis_url.startswith("redis+cluster://")
    with running_server() as cache:
        worker = FakeWorker("w1")
        register_pool(cache.core, "w1")
        address = [WorkerAddress(worker.address, f"127.0.0.1:{cache.port}")]
        try:
            with running_gateway(lambda: address, index_backend="redis",
                                 index_redis_url=redis_cluster.url) as gw:
                assert gw.router.index.store.cluster
                wait_until(lambda: gw.indexers.held() == 1 and gw.router.ready(),
                           what="the gateway holds w1's lease")
                tokens = prompt(1)
                cache_prompt(cache.core, "w1", tokens, salt="salt-a")
                caller = Caller(gw.address)
                wait_until(lambda: routed_to(caller, tokens)[1].startswith("holds 60"),
                           what="the indexed pages route")
                assert caller.generate(tokens)[-1].stats.worker == "w1"
                caller.close()
                client = gw.router.index.store.redis
                masters = {client.get_node_from_key(k).name
                           for k in client.keys("pcx:default:p:*", target_nodes="all")}
                assert len(masters) > 1  # the page keys spread over the masters
        finally:
            worker.stop()
