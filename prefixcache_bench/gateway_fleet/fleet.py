"""The recorded fleet: what every simulated pool holds and streams, and a CacheService that
replays it (the load generator; it runs in its own process, on its own core).

Content, deterministic so that both processes know it without sharing it: each pool holds
`pages_per_pool` private pages (conversations of CONVERSATION_PAGES pages) and the system prompts
(SHARED_PROMPTS prompts of CONVERSATION_PAGES pages) its (pool, prompt) draw gives it (~1 in 10).
Its stream is a snapshot of that (batches of SNAPSHOT_BATCH_PAGES pages, as the cache service
sends it; PACKED_SNAPSHOT_BATCH_PAGES with the hashes packed to a subscriber that asks for it,
SubscribeRequest.packed_hashes), then `live_batches` live batches that each store LIVE_PAGES new private pages and
remove the oldest LIVE_PAGES. Page hashes are distinct 16-byte strings (the index hashes them
again, so their bit pattern does not matter).
"""
from __future__ import annotations

import time
from collections.abc import Iterator

from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import common_pb2, events_pb2

CONVERSATION_PAGES = 32
SHARED_PROMPTS = 16
LIVE_PAGES = 64
SNAPSHOT_BATCH_PAGES = 4096  # cache_service/core.py's
# cache_service/core.py's PACKED_SNAPSHOT_BATCH_BYTES over a page of 16 hashed bytes and 16 tokens.
PACKED_SNAPSHOT_BATCH_PAGES = (4 << 20) // (16 + 4 * 16)
EPOCH = 1
_DEVICE = common_pb2.MEDIUM_DEVICE


def pool_name(i: int) -> str:
    return f"pool-{i:04d}"


def private_page(pool: int, j: int) -> bytes:
    return ((pool << 40) | j).to_bytes(16, "little")


def shared_page(prompt: int, j: int) -> bytes:
    return ((1 << 100) | (prompt << 20) | j).to_bytes(16, "little")


def holds_prompt(pool: int, prompt: int) -> bool:
    return (pool * 2654435761 + prompt * 40503) % 10 == 0


def snapshot_pages(pool: int, pages_per_pool: int) -> list[bytes]:
    shared = [shared_page(s, j) for s in range(SHARED_PROMPTS) if holds_prompt(pool, s)
              for j in range(CONVERSATION_PAGES)]
    return shared + [private_page(pool, j) for j in range(pages_per_pool)]


def _hashes(hashes: list[bytes], packed: bool) -> dict:
    return {"packed_block_hashes": b"".join(hashes)} if packed else {"block_hashes": hashes}


def _stored(hashes: list[bytes], packed: bool = False) -> events_pb2.KvEvent:
    return events_pb2.KvEvent(stored=events_pb2.BlockStored(**_hashes(hashes, packed), block_size=16,
                                                            medium=_DEVICE))


def recorded_stream(pool: int, pages_per_pool: int, live_batches: int,
                    packed: bool = False) -> list[bytes]:
    """The pool's stream as serialized SubscribeResponses: snapshot (seq 0), then live 1..K; the
    hashes packed or a bytes field each, as the cache service sends them."""
    name, pages = pool_name(pool), snapshot_pages(pool, pages_per_pool)
    size = PACKED_SNAPSHOT_BATCH_PAGES if packed else SNAPSHOT_BATCH_PAGES
    chunks = [pages[i:i + size] for i in range(0, len(pages), size)]
    out = []
    for k, chunk in enumerate(chunks):
        events = ([events_pb2.KvEvent(cleared=events_pb2.AllBlocksCleared())] if k == 0 else [])
        out.append(events_pb2.EventBatch(pool_id=name, epoch=EPOCH, seq=0, snapshot=True,
                                         snapshot_end=k == len(chunks) - 1,
                                         events=[*events, _stored(chunk, packed)]))
    for seq in range(1, live_batches + 1):
        new = [private_page(pool, pages_per_pool + (seq - 1) * LIVE_PAGES + j) for j in range(LIVE_PAGES)]
        old = [private_page(pool, (seq - 1) * LIVE_PAGES + j) for j in range(LIVE_PAGES)]
        gone = events_pb2.KvEvent(removed=events_pb2.BlockRemoved(**_hashes(old, packed),
                                                                  medium=_DEVICE))
        out.append(events_pb2.EventBatch(pool_id=name, epoch=EPOCH, seq=seq,
                                         events=[_stored(new, packed), gone]))
    return [cpb.SubscribeResponse(batch=b).SerializeToString() for b in out]


def page_events(pool: int, pages_per_pool: int, live_batches: int) -> tuple[int, int]:
    """(snapshot page events, live page events) of a pool's stream."""
    return len(snapshot_pages(pool, pages_per_pool)), 2 * LIVE_PAGES * live_batches


def _heartbeat(pool_id: str, head_seq: int) -> bytes:
    return cpb.SubscribeResponse(heartbeat=events_pb2.Heartbeat(
        pool_id=pool_id, epoch=EPOCH, head_seq=head_seq)).SerializeToString()


class ReplayCache:
    """Subscribe: the pool's recorded stream from the request's point (after_seq -1: from the
    snapshot; its live part once `go` is set, so that warm-up and live ingest are timed apart,
    with heartbeats at the asked interval meanwhile), then heartbeats until cancelled. Messages
    go out pre-serialized (the server's work is the transport, not building messages), in the
    encoding the request asks for (`packed` False: only the per-page one is recorded, for every
    request)."""

    def __init__(self, pools: int, pages_per_pool: int, live_batches: int, go, packed: bool = True,
                 sent=None):
        self.live_batches, self.go = live_batches, go
        # When the last live batch of a stream was handed to gRPC (time.perf_counter: CLOCK_MONOTONIC, the latest
        # over every stream; a shared double the bench reads): the load generator's send rate.
        self.sent = sent
        self.streams = {(pool_name(i), p): recorded_stream(i, pages_per_pool, live_batches, p)
                        for i in range(pools) for p in ({False, packed})}

    def Subscribe(self, request: cpb.SubscribeRequest, context) -> Iterator[bytes]:
        stream = self.streams.get((request.pool_id, request.packed_hashes),
                                  self.streams[request.pool_id, False])
        live_start = len(stream) - self.live_batches  # live seq k sits at live_start + k - 1
        if request.after_seq < 0 or request.epoch != EPOCH:
            yield from stream[:live_start]
            first_live = live_start
        else:
            first_live = live_start + request.after_seq
        interval = request.heartbeat_interval_s or 1.0
        heartbeat = _heartbeat(request.pool_id, first_live - live_start)  # head: what was sent
        # The live part waits for `go` (a resubscription's too), heartbeating meanwhile as an idle
        # cache service does: a warm-up longer than the gateway's stall timeout (10M pages on a
        # slow day) must not read as a stalled stream.
        while not self.go.wait(interval):
            if not context.is_active():
                return
            yield heartbeat
        yield from stream[first_live:]
        if self.sent is not None and first_live < len(stream):
            with self.sent.get_lock():
                self.sent.value = max(self.sent.value, time.perf_counter())
        heartbeat = _heartbeat(request.pool_id, self.live_batches)
        while context.is_active():
            time.sleep(interval)
            yield heartbeat


def serve(pools: int, pages_per_pool: int, live_batches: int, port_out, go, cpu: int | None,
          packed: bool = True, sent=None) -> None:
    """The load generator's process: builds the recording, serves it, reports its port."""
    import os

    import grpc
    from concurrent import futures
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    servicer = ReplayCache(pools, pages_per_pool, live_batches, go, packed, sent)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=pools + 8),
                         options=[("grpc.max_send_message_length", 64 << 20),
                                  ("grpc.max_concurrent_streams", pools + 8)])
    # CacheService.Subscribe with an identity serializer: the recording is already bytes.
    handler = grpc.unary_stream_rpc_method_handler(
        servicer.Subscribe, request_deserializer=cpb.SubscribeRequest.FromString,
        response_serializer=lambda b: b)
    service = cpb.DESCRIPTOR.services_by_name["CacheService"].full_name
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service,
                                                                          {"Subscribe": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port_out.put(port)
    server.wait_for_termination()
