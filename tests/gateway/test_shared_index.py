"""The shared routing index in Redis (gateway/core/shared_index.py, shared_indexer.py) against a
real redis-server and real cache services' Subscribe streams over loopback gRPC: two replicas see
one index, a killed indexer's lease is taken over and the stream resumes from its seq without a
snapshot, lookups equal KvIndex's on the same events, namespaces never leak, Redis down."""
from __future__ import annotations

import random
import time

import pytest

from cache_service.core import CacheCore
from gateway.core.index import KvIndex
from gateway.core.shared_index import SharedIndexConfig, SharedIndexStore, SharedIndexView, TableRow
from gateway.core.shared_indexer import Indexer, StreamWriter
from gateway.core.workers import WorkerSettings
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache.v1 import common_pb2, events_pb2
from tests.cache_service.grpc_harness import (PAGE, cache_prompt, expected_hashes, register,
                                              running_server, stub_for)

PROMPTS = [list(range(100, 100 + 3 * PAGE + 1)), list(range(100, 100 + 2 * PAGE)) + [7] * (PAGE + 1),
           list(range(500, 500 + 4 * PAGE + 1))]
# The gateway's channels to a cache service without TLS or a service token.
PLAIN = WorkerSettings().cache_channel


def store(redis_server, namespace="ns-a", **kw) -> SharedIndexStore:
    kw.setdefault("lease_ms", 1500)
    return SharedIndexStore(SharedIndexConfig(redis_server.url, namespace, **kw))


def wait_until(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError("condition not reached")


def written_seq(st: SharedIndexStore, pool: str) -> int:
    row = st.row(pool)
    return -2 if row is None else row.last_seq


def head_seq(stub, pool: str) -> int:
    return next(p.head_seq for p in stub.ListPools(pb.ListPoolsRequest(), timeout=5).pools
                if p.pool_id == pool)


def step(stub):
    return lambda req: stub.Step(req, timeout=5)


@pytest.fixture(params=["redis", "cluster"])
def index_redis(request):
    """One redis-server, or a 3-master Redis Cluster (tests/conftest.py): the index's layout
    and writes differ between them (gateway/core/shared_index.py's module doc)."""
    return request.getfixturevalue("redis_server" if request.param == "redis" else "redis_cluster")


@pytest.fixture
def cache():
    with running_server(CacheCore()) as server, stub_for(server) as stub:
        for pool in ("pool-a", "pool-b"):
            stub.RegisterPool(register(pool), timeout=5)
        yield f"127.0.0.1:{server.port}", stub


def test_two_replicas_see_one_index_written_by_one_indexer(index_redis, cache):
    address, stub = cache
    st = store(index_redis)
    indexers = [Indexer(st, "pool-a", address, f"replica-{i}", connect=PLAIN).start()
                for i in range(2)]
    try:
        cache_prompt(step(stub), "pool-a", tokens=PROMPTS[0])
        wait_until(lambda: written_seq(st, "pool-a") == head_seq(stub, "pool-a"))
        assert sum(ix.holding for ix in indexers) == 1
        assert st.holder("pool-a") in ("replica-0", "replica-1")
        views = [SharedIndexView(store(index_redis)) for _ in range(2)]
        hashes = expected_hashes(PROMPTS[0])
        answers = [v.lookup(hashes) for v in views]
        assert answers[0] == answers[1]
        assert answers[0]["pool-a"].device_pages == 3
        assert views[0].lookup(expected_hashes(PROMPTS[2])) == {}
    finally:
        for ix in indexers:
            ix.stop()


def test_a_killed_indexers_lease_is_taken_over_and_resumes_from_its_seq(index_redis, cache):
    address, stub = cache
    st = store(index_redis)
    first = Indexer(st, "pool-a", address, "first", connect=PLAIN).start()
    cache_prompt(step(stub), "pool-a", tokens=PROMPTS[0])
    wait_until(lambda: written_seq(st, "pool-a") == head_seq(stub, "pool-a"))
    first.stop(release=False)  # as a crash: the lease stays until it expires
    cache_prompt(step(stub), "pool-a", tokens=PROMPTS[2])  # events while nobody indexes
    second = Indexer(st, "pool-a", address, "second", connect=PLAIN).start()
    try:
        wait_until(lambda: written_seq(st, "pool-a") == head_seq(stub, "pool-a"))
        assert st.holder("pool-a") == "second"
        assert second.counters.snapshots == 0  # resumed from the replay buffer
        assert second.counters.batches >= 1
        view = SharedIndexView(store(index_redis))
        assert view.lookup(expected_hashes(PROMPTS[0]))["pool-a"].device_pages == 3
        assert view.lookup(expected_hashes(PROMPTS[2]))["pool-a"].device_pages == 4
        # The old holder can no longer write.
        assert not st.write("first", "pool-a", st.row("pool-a"), [])
    finally:
        second.stop()


def test_lookups_equal_the_in_memory_index_on_the_same_events(index_redis, cache):
    address, stub = cache
    st = store(index_redis)
    indexers = [Indexer(st, p, address, "r", connect=PLAIN).start() for p in ("pool-a", "pool-b")]
    memory = KvIndex()
    streams = {p: stub.Subscribe(pb.SubscribeRequest(pool_id=p, after_seq=-1, heartbeat_interval_s=0.05),
                                 timeout=20) for p in ("pool-a", "pool-b")}
    try:
        for pool, prompts in (("pool-a", PROMPTS[:2]), ("pool-b", PROMPTS[1:])):
            for tokens in prompts:
                cache_prompt(step(stub), pool, tokens=tokens)
        for pool, stream in streams.items():
            head = head_seq(stub, pool)
            for item in stream:
                if item.WhichOneof("item") == "batch":
                    memory.apply(item.batch)
                    if item.batch.seq == head and not item.batch.snapshot:
                        break
        for pool in streams:
            wait_until(lambda p=pool: written_seq(st, p) == head_seq(stub, p))
        view = SharedIndexView(store(index_redis))
        for tokens in [*PROMPTS, PROMPTS[0][:PAGE * 2], list(range(900, 920))]:
            hashes = expected_hashes(tokens)
            shared, local = view.lookup(hashes), memory.lookup(hashes)
            assert {k: (m.device_pages, m.host_pages, m.remote_pages) for k, m in shared.items()} == \
                {k: (m.device_pages, m.host_pages, m.remote_pages) for k, m in local.items()}
    finally:
        for s in streams.values():
            s.cancel()
        for ix in indexers:
            ix.stop()


def test_namespaces_never_leak(index_redis, cache):
    address, stub = cache
    a, b = store(index_redis, "ns-a"), store(index_redis, "ns-b")
    ix = Indexer(a, "pool-a", address, "r", connect=PLAIN).start()
    try:
        cache_prompt(step(stub), "pool-a", tokens=PROMPTS[0])
        wait_until(lambda: written_seq(a, "pool-a") == head_seq(stub, "pool-a"))
        hashes = expected_hashes(PROMPTS[0])
        assert SharedIndexView(a).lookup(hashes)["pool-a"].device_pages == 3
        other = SharedIndexView(b)
        assert other.lookup(hashes) == {} and other.workers() == []
        assert b.holder("pool-a") is None
        keys = b.redis.keys("*", target_nodes="all") if b.cluster else b.redis.keys("*")
        assert keys and all(k.startswith(b"pcx:ns-a:") for k in keys)
    finally:
        ix.stop()
    with pytest.raises(ValueError, match="without ':'"):
        store(index_redis, "a:b")


def test_redis_down_answers_no_prefix_knowledge_and_says_so(redis_server, cache):
    address, stub = cache
    st = store(redis_server)
    ix = Indexer(st, "pool-a", address, "r", connect=PLAIN).start()
    try:
        cache_prompt(step(stub), "pool-a", tokens=PROMPTS[0])
        wait_until(lambda: written_seq(st, "pool-a") == head_seq(stub, "pool-a"))
        view = SharedIndexView(store(redis_server))
        assert view.lookup(expected_hashes(PROMPTS[0]))
        assert not view.health.redis_down
        redis_server.stop()
        assert view.lookup(expected_hashes(PROMPTS[0])) == {}
        assert view.health.redis_down and view.health.lookup_failures == 1
        assert view.last_seen("pool-a") is not None  # still routable, by load
    finally:
        ix.stop()


def _batch(pool, seq, events, epoch=1, snapshot=False, end=False):
    return events_pb2.EventBatch(pool_id=pool, epoch=epoch, seq=seq, events=events,
                                 snapshot=snapshot, snapshot_end=end)


def _ev(kind, hashes, medium):
    body = events_pb2.BlockStored if kind == "stored" else events_pb2.BlockRemoved
    return events_pb2.KvEvent(**{kind: body(block_hashes=hashes, medium=medium)})


def test_every_medium_removals_snapshots_and_epochs_equal_the_in_memory_index(index_redis):
    """Random streams of 5 workers over device, host and remote, with removals, snapshots that
    replace a view, a cleared pool and a new epoch: every lookup equals KvIndex's."""
    rng = random.Random(31)
    pages = [bytes([i]) * 16 for i in range(1, 40)]
    media = (common_pb2.MEDIUM_DEVICE, common_pb2.MEDIUM_HOST, common_pb2.MEDIUM_REMOTE)
    # Leases that outlast the test: a worker may go unwritten for many rounds (slow on a loaded
    # machine, with a cluster), and this test is about the index, not the leases.
    st, memory = store(index_redis, lease_ms=600_000), KvIndex()
    writers = {}
    for w in range(5):
        pool = f"w{w}"
        assert st.try_lease(pool, "r")
        writers[pool] = StreamWriter(st, pool, "r")
    seq = dict.fromkeys(writers, -1)
    epoch = dict.fromkeys(writers, 1)
    for round_ in range(60):
        pool = rng.choice(list(writers))
        roll = rng.random()
        if roll < 0.08:  # a snapshot: the whole view replaced, in two batches
            held = rng.sample(pages, 8)
            batches = [_batch(pool, seq[pool], [events_pb2.KvEvent(cleared=events_pb2.AllBlocksCleared()),
                                                _ev("stored", held[:4], media[0])], epoch[pool], True),
                       _batch(pool, seq[pool], [_ev("stored", held[4:], rng.choice(media))],
                              epoch[pool], True, True)]
        elif roll < 0.12:  # a new epoch starts from an empty pool at seq 0
            epoch[pool] += 1
            seq[pool] = 0
            batches = [_batch(pool, 0, [_ev("stored", pages[:3], media[0])], epoch[pool])]
        else:
            seq[pool] += 1
            run = pages[rng.randrange(0, 20):][:rng.randrange(1, 12)]
            events = [_ev(rng.choice(("stored", "stored", "removed")), run, rng.choice(media))]
            if rng.random() < 0.05:
                events.insert(0, events_pb2.KvEvent(cleared=events_pb2.AllBlocksCleared()))
            batches = [_batch(pool, seq[pool], events, epoch[pool])]
        for b in batches:
            memory.apply(b)
            writers[pool].apply(b)
        view = SharedIndexView(store(index_redis))
        for start in (0, 0, 3, 10):
            hashes = pages[start:start + rng.randrange(1, 25)]
            shared, local = view.lookup(hashes), memory.lookup(hashes)
            assert {k: (m.device_pages, m.host_pages, m.remote_pages) for k, m in shared.items()} == \
                {k: (m.device_pages, m.host_pages, m.remote_pages) for k, m in local.items()}, round_


def test_routing_with_the_shared_index_equals_routing_with_the_in_memory_one(redis_server):
    """The same events into a router's own KvIndex (through `on_stream_item`) and into Redis
    (through the indexer's writer); a router over `SharedIndexView` routes every request to the
    same worker, with the same scores."""
    from gateway.core.metrics import GatewayMetrics
    from gateway.core.policies import RouteRequest, make_policy
    from gateway.core.router import Router, Worker
    from prefixcache.v1 import compute_service_pb2 as cpb_compute
    from tests.gateway.helpers import HOST, batch, pages, stored

    st = store(redis_server)
    clock = lambda: 1000.0  # noqa: E731 - one frozen clock: load decays alike in both routers
    routers = [Router(make_policy("affinity"), GatewayMetrics(), clock=clock),
               Router(make_policy("affinity"), GatewayMetrics(), clock=clock,
                      index=SharedIndexView(store(redis_server), clock=clock))]
    names = [f"w{i}" for i in range(4)]
    for router in routers:
        for name in names:
            router.add(Worker(name, "w", "c", None, cpb_compute.GetModelInfoResponse(worker=name)))
    for i, name in enumerate(names):
        assert st.try_lease(name, "r")
        writer = StreamWriter(st, name, "r")
        for seq, events in enumerate([(stored(pages(0, 4 + 4 * i)),), (stored(pages(100 * i, 100 * i + 8), HOST),)]):
            b = batch(name, seq, *events)
            routers[0].on_stream_item(name, pb.SubscribeResponse(batch=b))
            writer.apply(b)
        routers[1].get(name).synced = True  # its indexer, not this replica, follows the stream
    rng = random.Random(5)
    for n in range(200):
        start = rng.choice([0, 0, 100, 200, 300, 1000])
        request = RouteRequest(f"r{n}", pages(start, start + rng.randrange(1, 20)), 200, 4)
        got = [router.route(request) for router in routers]
        assert got[0].worker.name == got[1].worker.name, n
        assert got[0].decision.scores == got[1].decision.scores, n
        if n % 3:
            for router in routers:
                router.finish(request.request_id)


def test_a_cluster_writer_whose_lease_expired_writes_no_page(redis_cluster):
    """On a cluster the page commands go before the lease script (the module doc): a writer
    past half a lease since its last renewal renews first, so one whose lease expired and went
    to another replica sends no page command at all."""
    a, b = store(redis_cluster), store(redis_cluster)
    assert a.cluster
    assert a.try_lease("pool-a", "a")
    row = TableRow(a.new_slot(), 1, 0, time.time(), False)
    assert a.write("a", "pool-a", row, [("+", b"page-one", row.slot * 3)])
    a.redis.delete(a.lease_key("pool-a"))  # as if it had expired
    assert b.try_lease("pool-a", "b")
    a._renewed["pool-a"] -= a.config.lease_ms / 1000  # a's last renewal is a lease old
    assert not a.write("a", "pool-a", row, [("+", b"page-two", row.slot * 3)])
    assert a.redis.exists(a.page_key(b"page-one")) and not a.redis.exists(a.page_key(b"page-two"))
    assert b.write("b", "pool-a", row, [("+", b"page-two", row.slot * 3)])
