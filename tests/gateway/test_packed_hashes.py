"""The packed hash encoding of the event stream (SubscribeRequest.packed_hashes, design.md §6):
a subscriber that asks for it gets BlockStored/BlockRemoved.packed_block_hashes, one that does not
(an older gateway, the shared indexer) the per-page block_hashes as before, and the gateway's
index ends in the same state from either, live batches and snapshots alike (real gRPC over
loopback to the real cache service)."""
from __future__ import annotations

import grpc

from cache_service.core import CacheCore
from gateway.core.feed_streams import Feed, aio_channel
from gateway.core.feeds import FeedLoop
from gateway.core.stream_items import split_snapshot
from gateway.core.index import KvIndex
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router, Worker
from gateway.core.workers import WorkerSettings
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from prefixcache.v1 import common_pb2
from prefixcache.v1 import compute_service_pb2 as pb
from service_shell import channel_options
from tests.cache_service.grpc_harness import running_server
from tests.gateway.gateway_harness import cache_prompt, register_pool, wait_until
from tests.gateway.helpers import DEVICE, batch, cleared, pages, removed, stored

POOL = "pk"
MEDIA = (common_pb2.MEDIUM_DEVICE, common_pb2.MEDIUM_HOST, common_pb2.MEDIUM_REMOTE)


def _prompt(i: int) -> list[int]:
    return [7919 * i + j for j in range(9)]  # 2 full pages of 4 tokens


def _fill(core: CacheCore, start: int, stop: int) -> None:
    """Prompts start..stop-1; past the pool's 256 device pages (no host tier) the oldest are
    evicted, so the stream carries removals as well as stores."""
    for i in range(start, stop):
        cache_prompt(core, POOL, _prompt(i))


def _state(index: KvIndex) -> tuple:
    info = index.info(POOL)
    return (info.epoch, info.last_seq, info.pages,
            tuple(index.pages(POOL, m) for m in MEDIA))


def _subscribe(port: int, packed: bool | None) -> list[cpb.SubscribeResponse]:
    """The items of a fresh subscription up to the pool's head (snapshot and replay), over gRPC."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = cpb.SubscribeRequest(pool_id=POOL, epoch=1, after_seq=-1,
                                       heartbeat_interval_s=0.05)
        if packed is not None:
            request.packed_hashes = packed
        call = cpb_grpc.CacheServiceStub(channel).Subscribe(request)
        items = []
        for item in call:
            if item.WhichOneof("item") == "heartbeat":
                break
            items.append(item)
        call.cancel()
        return items


def _bodies(items: list[cpb.SubscribeResponse]) -> list:
    return [getattr(e, e.WhichOneof("event")) for it in items for e in it.batch.events
            if e.WhichOneof("event") in ("stored", "removed")]


def test_an_old_subscriber_gets_the_per_page_encoding_and_a_packed_one_the_packed():
    core = CacheCore()
    register_pool(core, POOL)
    _fill(core, 0, 10)
    with running_server(core) as cache:
        old, unasked, packed = (_subscribe(cache.port, p) for p in (False, None, True))
    old_bodies, packed_bodies = _bodies(old), _bodies(packed)
    assert old_bodies and len(old_bodies) == len(packed_bodies)
    assert _bodies(unasked) == old_bodies  # the field left out: the encoding of before
    assert all(b.block_hashes and not b.packed_block_hashes for b in old_bodies)
    assert all(b.packed_block_hashes and not b.block_hashes for b in packed_bodies)
    for o, p in zip(old_bodies, packed_bodies):
        assert b"".join(o.block_hashes) == p.packed_block_hashes
        assert o.medium == p.medium


def test_packed_and_unpacked_subscribers_see_the_same_index_state():
    """Two routers follow one pool, one asking for packed hashes and one not: after the
    snapshot and after live batches with stores and removals, their indexes hold the same pages
    at the same seq."""
    core = CacheCore()
    register_pool(core, POOL)
    _fill(core, 0, 40)
    with running_server(core) as cache:
        routers, loops = [], []
        try:
            for packed in (True, False):
                router = Router(make_policy("affinity"), GatewayMetrics())
                router.add(Worker(POOL, "w", "c", None, pb.GetModelInfoResponse(worker=POOL)))
                loop = FeedLoop(router)
                loop.submit(_follow(loop, cache.port, packed))
                routers.append(router)
                loops.append(loop)

            def synced(head: int) -> bool:
                infos = [r.index.info(POOL) for r in routers]
                return all(i is not None and i.last_seq == head and not i.in_snapshot for i in infos)

            wait_until(lambda: synced(core._pools[POOL].log.head_seq), what="snapshots applied")
            assert _state(routers[0].index) == _state(routers[1].index)
            _fill(core, 40, 200)  # live: 320 pages into 256, so the oldest go
            wait_until(lambda: synced(core._pools[POOL].log.head_seq), what="live batches applied")
        finally:
            for loop in loops:
                loop.close()
    packed_state, plain_state = (_state(r.index) for r in routers)
    assert packed_state == plain_state
    assert 0 < len(packed_state[3][0]) <= 256  # removals happened and were applied


async def _follow(loop: FeedLoop, port: int, packed: bool) -> None:
    settings = WorkerSettings(heartbeat_interval_s=0.1).stream_settings()
    settings = type(settings)(settings.heartbeat_interval_s, settings.backoff, settings.metadata,
                              packed_hashes=packed)
    channel = aio_channel(f"127.0.0.1:{port}", channel_options(4), None)
    try:
        await loop.follow(cpb_grpc.CacheServiceStub(channel), Feed(POOL), settings)
    finally:
        await channel.close()


def test_a_packed_snapshot_restores_the_same_index():
    """A pool's snapshot in packed form (fewer, bigger batches) and in the per-page form, each
    applied to an empty index (and cut into the feeds' slices), give the same index."""
    core = CacheCore()
    core.register_pool(cpb.RegisterPoolRequest(pool_id=POOL, epoch=1, page_size=4,
                                               model_id="m", device_pages=6000))
    _fill(core, 0, 2500)  # 5,000 pages: two per-page snapshot batches, one packed
    pool = core._pools[POOL]
    plain, packed = core._snapshot(pool), core._snapshot(pool, packed=True)
    assert len(plain) == 2 and len(packed) == 1
    indexes = []
    for batches in (plain, packed, [p for b in packed for p in split_snapshot(b, 1024)]):
        index = KvIndex()
        for b in batches:
            assert index.apply(b).status.name == "APPLIED"
        indexes.append(_state(index))
    assert indexes[0] == indexes[1] == indexes[2]
    assert len(indexes[0][3][0]) == 5000


def test_a_packed_snapshot_batch_is_split_by_slicing_its_bytes():
    hashes = pages(0, 2500)
    big = batch("p", 0, cleared(), stored(hashes), removed(pages(0, 10)), snapshot=True,
                snapshot_end=True)
    for event in big.events[1:]:
        body = getattr(event, event.WhichOneof("event"))
        body.packed_block_hashes = b"".join(body.block_hashes)
        body.ClearField("block_hashes")
    parts = split_snapshot(big, 1000)
    assert [p.snapshot_end for p in parts] == [False, False, True]
    bodies = [(e.WhichOneof("event"), getattr(e, e.WhichOneof("event"))) for p in parts
              for e in p.events if e.WhichOneof("event") != "cleared"]
    assert all(not b.block_hashes and b.medium == DEVICE for _, b in bodies)
    assert [len(b.packed_block_hashes) // 16 for _, b in bodies] == [1000, 1000, 500, 10]
    assert b"".join(b.packed_block_hashes for k, b in bodies if k == "stored") == b"".join(hashes)
