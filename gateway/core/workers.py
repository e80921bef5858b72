"""Worker lifecycle: discovered address -> identified worker -> admitted into the router, with a
readiness probe and an event feed; and back out when it leaves (design.md §6).

Every worker runs as coroutines on the one `FeedLoop` (gateway/core/feeds.py: one asyncio
thread with grpc.aio, plus a fixed pool of 4 threads for the calls that only exist blocking), so
the gateway's thread count does not grow with its workers. Per address (`WorkerHandle._run`):
1. identify: GetModelInfo until it answers (the worker may still be loading its model);
2. admit: its model id and page size must be the fleet's (`Fleet`), else it is refused with a
   logged reason and asked again later (the address may get another worker); its tokenizer is
   compared with the gateway's, which the first worker with one gives a gateway started with
   `--tokenizer auto` (gateway/core/tokenize.py): a worker with another tokenizer is admitted for
   token-id prompts only;
3. follow: a feed task subscribes to its cache service's event stream for its pool and queues
   the decoded items for bulk apply (`feeds.follow_events`), resubscribing from where the index
   says when it reports a gap or a new epoch, and after a broken stream from the last batch
   received (the cache service replays its buffer, or sends a snapshot when the buffer has moved
   past that point); with `--feed-process` that stream is read in the gateway's feed process
   (gateway/core/feed_process.py), which sends the items back as frames and takes the RESYNCs
   and the removal. The handle probes the worker's `readiness` health, so a dead or draining
   worker stops being routed to. A watch task holds a health `Watch` on `readiness`: a worker
   that starts draining (SIGTERM: readiness NOT_SERVING, design.md §8) is out of the routing
   within a round trip, before it starts refusing new requests `--drain-delay-s` later, instead
   of up to a probe interval later; the probes remain the fallback, and the only way back up
   (after re-identifying). A worker that comes back under another pool id (restarted elsewhere,
   new pod on the same address) is removed and admitted again under its new name.
   With the shared index (`--index-backend redis`), an admitted worker also gets this replica's
   indexer role (gateway/core/indexer_roles.py), stopped when it is removed; the feed then brings
   the router its load only.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.core.discovery import WorkerAddress
from gateway.core.feed_process import FeedProcess, RemoteFeed, StreamTarget
from gateway.core.feed_streams import Feed, StreamSettings, aio_channel, token_metadata
from gateway.core.feeds import FeedLoop
from gateway.core.indexer_roles import IndexerRoles
from gateway.core.ingest_slices import SLICE_S
from gateway.core.router import Router, Worker
from gateway.core.tokenize import GatewayTokenizer
from prefixcache.v1 import cache_service_pb2_grpc as cpb_grpc
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1.compute_service_pb2_grpc import ComputeServiceStub as ComputeStub
from prefixcache_client.compute import ComputeClient
from service_shell import TlsConfig, channel_options, kv, open_channel
from service_shell.retry import SUBSCRIBE_RETRY, WORKER_RETRY, RetryPolicy

log = logging.getLogger("gateway.workers")

# A gateway that reads this many workers' streams in its own process is told once that
# --feed-process is the setting for its fleet: there the streams' gRPC holds the routing
# process's GIL, and a decision's p99 from its wake-up was 1.0 ms at 100 workers, 3.0-3.6 ms at
# 1,000, against 0.62-0.72 ms with the feed process (docs/results/gateway/fleet/summary.txt).
FEED_PROCESS_ADVISED_WORKERS = 100

_SERVING = health_pb2.HealthCheckResponse.SERVING


@dataclass(slots=True)
class WorkerSettings:
    tls: TlsConfig | None = None
    # The gateway's service identity at the workers' compute and cache ports (auth.py).
    service_token: str | None = None
    max_message_mb: int = 64
    rpc_timeout_s: float = 5.0
    # Seconds between readiness probes of each worker.
    probe_interval_s: float = 2.0
    # Heartbeats asked of the cache services when a pool is quiet.
    heartbeat_interval_s: float = 1.0
    # Seconds before a refused worker (another model) is identified again.
    refused_retry_s: float = 30.0
    # Between attempts of each worker's identify and health-watch loops.
    backoff: RetryPolicy = WORKER_RETRY
    # Between attempts to reopen a worker's event stream.
    stream_backoff: RetryPolicy = SUBSCRIBE_RETRY
    # How long one ingest slice may hold the router's lock (gateway/core/ingest_slices.py).
    ingest_slice_s: float = SLICE_S
    # The event streams read in a process of their own (gateway/core/feed_process.py).
    feed_process: bool = False

    def stream_settings(self) -> StreamSettings:
        return StreamSettings(self.heartbeat_interval_s, self.stream_backoff,
                              token_metadata(self.service_token))

    def cache_channel(self, address: str) -> grpc.Channel:
        """A blocking channel to a worker's cache service, for the shared index's indexers
        (gateway/core/shared_indexer.py, threads of their own): the feeds' channel (`aio_channel`:
        the same options and TLS) in its synchronous form, `service_shell.open_channel`, which
        sends the service token with every call as `token_metadata` does for the feeds."""
        return open_channel(address, channel_options(self.max_message_mb), tls=self.tls,
                            service_token=self.service_token)


class Fleet:
    """The model every admitted worker must serve: fixed by flags, or by the first worker; and
    the gateway's tokenizer, which decides which workers may be sent text."""

    def __init__(self, model_id: str | None, page_size: int | None,
                 tokenizer: GatewayTokenizer | None = None) -> None:
        self.model_id, self.page_size = model_id, page_size
        self.info: pb.GetModelInfoResponse | None = None
        self.tokenizer = tokenizer if tokenizer is not None else GatewayTokenizer()
        self._names: dict[str, str] = {}  # admitted worker -> its compute address
        self._lock = threading.Lock()

    def admit(self, info: pb.GetModelInfoResponse, address: str) -> str | None:
        """None when the worker joins the fleet, else why not."""
        with self._lock:
            if not info.worker:
                return "GetModelInfo names no worker (pool id)"
            if self.model_id is not None and info.model_id != self.model_id:
                return f"model id {info.model_id!r} is not the fleet's {self.model_id!r}"
            if self.page_size is not None and info.page_size != self.page_size:
                return f"page size {info.page_size} is not the fleet's {self.page_size}"
            holder = self._names.get(info.worker)
            if holder is not None and holder != address:
                return f"worker name {info.worker!r} is already served at {holder}"
            self._names[info.worker] = address
            self.model_id, self.page_size = info.model_id, info.page_size
            if self.info is None:
                self.info = info
            return None

    def release(self, name: str, address: str) -> None:
        with self._lock:
            if self._names.get(name) == address:
                del self._names[name]


class WorkerHandle:
    """One discovered address; see the module docstring. `start()` and `stop()` from any thread
    but the loop's."""

    def __init__(self, address: WorkerAddress, router: Router, fleet: Fleet,
                 settings: WorkerSettings, feeds: FeedLoop,
                 indexers: IndexerRoles | None = None, remote: FeedProcess | None = None) -> None:
        self.address = address
        self._router, self._fleet, self._settings, self._feeds = router, fleet, settings, feeds
        self._remote = remote  # the feed process that reads the event stream, if any
        self._indexers = indexers
        self._future: concurrent.futures.Future[None] | None = None
        self.name: str | None = None

    def start(self) -> WorkerHandle:
        self._future = self._feeds.submit(self._run())
        return self

    def stop(self) -> None:
        """Leaves the routing now (the lifecycle task is cancelled; its cleanup runs on the loop)."""
        if self._future is not None:
            self._feeds.loop.call_soon_threadsafe(self._future.cancel)

    def join(self, timeout_s: float) -> None:
        if self._future is not None:
            concurrent.futures.wait([self._future], timeout_s)

    # ----- lifecycle ---------------------------------------------------------------------------

    async def _run(self) -> None:
        s = self._settings
        # grpc.aio channels (the loop's): health and GetModelInfo at the compute port, events at
        # the cache port. The sync `ComputeClient` is the proxy's, for Generate.
        compute = aio_channel(self.address.compute, channel_options(1), s.tls)
        cache = aio_channel(self.address.cache, channel_options(s.max_message_mb), s.tls)
        identify = ComputeStub(compute).GetModelInfo
        try:
            while True:
                # One client per admission: the router closes it once the worker it was
                # admitted as is removed and its last call ended.
                client = ComputeClient(self.address.compute, timeout_s=s.rpc_timeout_s,
                                       max_message_mb=s.max_message_mb, tls=s.tls,
                                       service_token=s.service_token)
                info = await self._identify(identify)
                reason = self._fleet.admit(info, self.address.compute)
                if reason is not None:
                    client.close()
                    log.warning(kv("worker_refused", address=self.address.compute,
                                   worker=info.worker, reason=reason))
                    await asyncio.sleep(s.refused_retry_s)
                    continue
                await self._follow(info, client, identify, health_pb2_grpc.HealthStub(compute),
                                   cpb_grpc.CacheServiceStub(cache))
        except asyncio.CancelledError:
            raise
        except Exception:  # a bug here must not go unnoticed, nor take the gateway down
            log.exception(kv("worker_task_failed", address=self.address.compute))
        finally:
            await asyncio.gather(compute.close(), cache.close(), return_exceptions=True)

    async def _identify(self, identify: Callable) -> pb.GetModelInfoResponse:
        failures = 0
        backoff = self._settings.backoff
        while True:
            try:
                return await self._model_info(identify)
            except grpc.aio.AioRpcError as exc:
                failures += 1
                if failures == 1 or failures % 20 == 0:
                    log.info(kv("worker_not_answering", address=self.address.compute,
                                code=exc.code().name, message=exc.details(), attempts=failures))
                await asyncio.sleep(backoff.delay(failures))

    async def _model_info(self, identify: Callable) -> pb.GetModelInfoResponse:
        s = self._settings
        return await identify(pb.GetModelInfoRequest(), timeout=s.rpc_timeout_s,
                              metadata=token_metadata(s.service_token))

    async def _follow(self, info: pb.GetModelInfoResponse, client: ComputeClient,
                      identify: Callable, health: health_pb2_grpc.HealthStub,
                      cache: cpb_grpc.CacheServiceStub) -> None:
        name = self.name = info.worker
        tokenizer, s = self._fleet.tokenizer, self._settings
        # Before it is routed to: text prompts after readiness find the tokenizer known.
        await self._feeds.blocking(tokenizer.worker_joined, name, info, client)
        worker = Worker(name, self.address.compute, self.address.cache, client, info)
        self._router.add(worker)
        if self._indexers is not None:
            self._indexers.join(name, self.address.cache)
        log.info(kv("worker_added", worker=name, address=self.address.compute,
                    cache=self.address.cache, model=info.model_id, page_size=info.page_size,
                    device_pages=info.device_pages, host_pages=info.host_pages))
        # Where its stream picks up: a fresh worker from a snapshot, one restored from an index
        # checkpoint (gateway/core/index_checkpoint.py) right after its last applied batch.
        point = self._router.resume_point(name)
        if self._remote is None:
            follow = self._feeds.follow(cache, Feed(name, point=point), s.stream_settings())
        else:
            follow = self._remote.follow(StreamTarget(self.address.cache, s.stream_settings(),
                                                      s.tls, s.max_message_mb),
                                         RemoteFeed(name, point=point))
        tasks = [asyncio.create_task(follow), asyncio.create_task(self._watch(name, health))]
        try:
            while True:
                await asyncio.sleep(s.probe_interval_s)
                await self._feeds.blocking(tokenizer.learn, name, info, client)  # no-op once known
                up = await self._ready(health)
                if up and not worker.up:
                    again = await self._identify_quietly(identify)
                    if again is not None and again.worker != name:
                        log.info(kv("worker_renamed", address=self.address.compute, old=name,
                                    new=again.worker))
                        return  # re-admitted under its new name by _run
                if self._router.set_up(name, up):
                    log.info(kv("worker_up" if up else "worker_down", worker=name))
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._router.remove(name)
            if self._indexers is not None:
                self._indexers.leave(name)  # quick: its thread ends on the cancelled stream
            tokenizer.worker_left(name)
            self._fleet.release(name, self.address.compute)
            log.info(kv("worker_removed", worker=name, address=self.address.compute))

    async def _watch(self, name: str, health: health_pb2_grpc.HealthStub) -> None:
        """Takes the worker out of the routing the moment its readiness turns NOT_SERVING (it
        drains), as a health Watch stream reports it; reconnects after a failure."""
        failures = 0
        backoff = self._settings.backoff
        while True:
            call = health.Watch(health_pb2.HealthCheckRequest(service="readiness"))
            try:
                async for resp in call:
                    failures = 0
                    if resp.status != _SERVING and self._router.set_up(name, False):
                        status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
                        log.info(kv("worker_down", worker=name, reason=f"readiness {status}"))
            except grpc.aio.AioRpcError:
                pass
            finally:
                call.cancel()
            failures += 1
            await asyncio.sleep(backoff.delay(failures))

    async def _ready(self, health: health_pb2_grpc.HealthStub) -> bool:
        try:
            resp = await health.Check(health_pb2.HealthCheckRequest(service="readiness"),
                                      timeout=self._settings.rpc_timeout_s)
        except grpc.aio.AioRpcError:
            return False
        return resp.status == _SERVING

    async def _identify_quietly(self, identify: Callable) -> pb.GetModelInfoResponse | None:
        try:
            return await self._model_info(identify)
        except grpc.aio.AioRpcError:
            return None


class WorkerSet:
    """The handles of the addresses `source()` returns, reconciled by `refresh()`; their tasks
    run on one `FeedLoop`, which `close()` ends."""

    def __init__(self, source: Callable[[], list[WorkerAddress]], router: Router, fleet: Fleet,
                 settings: WorkerSettings, feeds: FeedLoop | None = None,
                 indexers: IndexerRoles | None = None) -> None:
        self._source = source
        self._router, self._fleet, self._settings = router, fleet, settings
        # The shared index's mode: each admitted worker gets an indexer on this replica.
        self.indexers = indexers
        self.feeds = feeds if feeds is not None else FeedLoop(router, settings.ingest_slice_s)
        self.remote: FeedProcess | None = None
        if settings.feed_process:
            self.remote = FeedProcess(self.feeds.applier, router.resume_point)
            self.feeds.submit(self.remote.run())
        self._handles: dict[WorkerAddress, WorkerHandle] = {}
        self._lock = threading.Lock()
        self._advised = settings.feed_process  # nothing to advise

    def refresh(self) -> None:
        desired = set(self._source())
        with self._lock:
            gone = [a for a in self._handles if a not in desired]
            for address in gone:
                log.info(kv("worker_address_gone", address=address.compute))
                self._handles.pop(address).stop()
            for address in sorted(desired - self._handles.keys()):
                log.info(kv("worker_address_found", address=address.compute, cache=address.cache))
                self._handles[address] = WorkerHandle(address, self._router, self._fleet,
                                                      self._settings, self.feeds,
                                                      self.indexers, self.remote).start()
            if not self._advised and len(self._handles) >= FEED_PROCESS_ADVISED_WORKERS:
                self._advised = True
                log.warning(kv("feed_process_advised", workers=len(self._handles),
                               advice="--feed-process (PREFIXCACHE_FEED_PROCESS=on): the "
                                      "workers' streams read off the routing process's GIL"))

    def addresses(self) -> list[WorkerAddress]:
        with self._lock:
            return sorted(self._handles)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            handle.stop()
        for handle in handles:
            handle.join(timeout_s)
        self.feeds.close(timeout_s)
        if self.indexers is not None:
            self.indexers.close()
