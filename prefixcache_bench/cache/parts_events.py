"""Part `events`: page events delivered end to end to a gRPC subscriber (CacheClient.subscribe),
and a check that the stream, applied to an empty set, reproduces the pool's page set."""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prefixcache_bench.cache.params import Params, ceil_div, register
from prefixcache_bench.cache.serving import ServerHandle
from prefixcache_bench.cache.workloads import CoreSteps, Tokens
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_bench.harness import Progress
from prefixcache_client.cache import CacheClient


@dataclass
class EventIndex:
    """A subscriber's index: the stream applied to a set of (medium, page hash)."""
    pages: set[tuple[int, bytes]] = field(default_factory=set)
    received: int = 0  # page events (hashes in BlockStored/BlockRemoved) of live batches
    last_seq: int = -1
    last_at: float = 0.0
    gaps: int = 0
    snapshots: int = 0
    error: BaseException | None = None

    def apply(self, batch) -> None:
        if batch.snapshot:
            self.snapshots += batch.snapshot_end
        elif self.last_seq >= 0 and batch.seq != self.last_seq + 1:
            self.gaps += 1
        for ev in batch.events:
            kind = ev.WhichOneof("event")
            if kind == "stored":
                medium = ev.stored.medium
                self.pages.update((medium, h) for h in ev.stored.block_hashes)
                if not batch.snapshot:
                    self.received += len(ev.stored.block_hashes)
            elif kind == "removed":
                medium = ev.removed.medium
                self.pages.difference_update((medium, h) for h in ev.removed.block_hashes)
                if not batch.snapshot:
                    self.received += len(ev.removed.block_hashes)
            else:
                self.pages.clear()
        self.last_seq = batch.seq
        self.last_at = time.perf_counter()


def _consume(sub, index: EventIndex) -> None:
    try:
        for item in sub:
            if item.WhichOneof("item") == "batch":
                index.apply(item.batch)
    except BaseException as exc:  # reported in the results, never swallowed silently
        index.error = exc


def snapshot_pages(client: CacheClient, pool_id: str) -> set[tuple[int, bytes]]:
    """The pool's page set as the server's tree sees it, from a fresh snapshot."""
    index = EventIndex()
    with client.subscribe(pool_id, after_seq=-1) as sub:
        for item in sub:
            if item.WhichOneof("item") == "batch":
                index.apply(item.batch)
                if item.batch.snapshot_end:
                    break
    return index.pages


def bench_events(p: Params, server: ServerHandle) -> dict:
    """Page events per second from the first Step to the last batch delivered to a subscriber.

    Each round matches `event_requests` new prompts (unique first token, so every page is new),
    allocates, publishes and releases them; once the pool is full, allocation evicts as many
    pages as publishing stores, so the stream is about half BlockStored, half BlockRemoved.
    Generated = pages inserted (publish results) + pages evicted (stats); received = hashes in the
    live batches; and the subscriber's set must equal a fresh snapshot and the cached page count.
    """
    with CacheClient(server.target, timeout_s=30) as client:
        index, sub, consumer = follow_events(p, client)
        inserted, start, produced_s = produce_events(p, client, "events")
        head = next(pool.head_seq for pool in client.list_pools().pools if pool.pool_id == "events")
        _wait(lambda: index.last_seq >= head or index.error is not None, 60,
              f"the subscriber to reach seq {head}")
        sub.close()
        consumer.join(10)
        generated = inserted + _evictions(client, "events")
        tree = snapshot_pages(client, "events")
        stats = client.get_stats(pb.GetStatsRequest(pool_id="events")).pools[0]
        cached = sum(m.cached_pages for m in stats.media)
    elapsed = index.last_at - start
    return {
        "events_per_s": round(index.received / elapsed) if elapsed > 0 else 0,
        "events_generated": generated,
        "events_received": index.received,
        "events_lost": generated - index.received,
        "events_index_mismatch": len(index.pages ^ tree) + abs(len(tree) - cached),
        "events_seq_gaps": index.gaps,
        "events_resnapshots": index.snapshots - 1,
        "events_batches": head,
        "events_produce_s": round(produced_s, 3),
        "events_deliver_s": round(elapsed, 3),
        "events_subscriber_error": None if index.error is None else repr(index.error),
    }


def follow_events(p: Params, client: CacheClient) -> tuple[EventIndex, object, threading.Thread]:
    """Registers the pool "events" and a gRPC subscriber applying its stream to an index, on a
    thread of its own; returns once the subscriber's initial snapshot arrived."""
    client.wait_until_ready(30)
    client.register_pool(register("events", p, p.event_pool_pages))
    index = EventIndex()
    sub = client.subscribe("events", heartbeat_interval_s=0.1)
    consumer = threading.Thread(target=_consume, args=(sub, index), daemon=True)
    consumer.start()
    _wait(lambda: index.snapshots >= 1, 30, "the subscriber's initial snapshot")
    return index, sub, consumer


def produce_events(p: Params, client: CacheClient, label: str) -> tuple[int, float, float]:
    """Rounds on the registered pool "events" until about `event_pages` page events were
    generated (see bench_events): (pages inserted, perf_counter at the start, seconds taken)."""
    tok = Tokens(p.seed + 3, p.vocab)
    base = tok.random(p.event_prompt_pages * p.page_size + 1)
    n_tokens = len(base)
    steps = CoreSteps(client.step, "events", p.page_size)
    need = ceil_div(n_tokens, p.page_size)
    # Once the pool is full every inserted page evicts one: generated ~ 2 * inserted - pool.
    target = (p.event_pages + p.event_pool_pages) // 2
    inserted, counter, progress = 0, 0, Progress(label, p.event_pages)
    start = time.perf_counter()
    while inserted < target:
        matches = []
        for _ in range(p.event_requests):
            counter += 1
            tokens = base.copy()
            tokens[0] = counter  # a new first page: every page of the prompt is new
            matches.append(pb.MatchOp(token_ids=tokens.tolist()))
        leases = [m.lease_id for m in steps.step(steps.req(matches=matches)).matches]
        steps.step(steps.req(allocations=[pb.AllocateOp(lease_id=lease, num_pages=need)
                                          for lease in leases]))
        resp = steps.step(steps.req(
            publishes=[pb.PublishOp(lease_id=lease, computed_pages=n_tokens // p.page_size)
                       for lease in leases],
            releases=[pb.ReleaseOp(lease_id=lease) for lease in leases]))
        inserted += sum(r.inserted_pages for r in resp.publishes)
        progress.update(max(inserted, 2 * inserted - p.event_pool_pages))
    return inserted, start, time.perf_counter() - start


def _evictions(client: CacheClient, pool_id: str) -> int:
    stats = client.get_stats(pb.GetStatsRequest(pool_id=pool_id)).pools[0]
    return sum(m.evictions for m in stats.media)


def _wait(done: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.005)
