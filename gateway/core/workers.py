"""Worker lifecycle: discovered address -> identified worker -> admitted into the router, with a
readiness probe and an event feed; and back out when it leaves (design.md §6).

Per address, one thread (`WorkerHandle._run`):
1. identify: GetModelInfo until it answers (the worker may still be loading its model);
2. admit: its model id and page size must be the fleet's (`Fleet`), else it is refused with a
   logged reason and asked again later (the address may get another worker); its tokenizer is
   compared with the gateway's, which the first worker with one gives a gateway started with
   `--tokenizer auto` (gateway/core/tokenize.py): a worker with another tokenizer is admitted for
   token-id prompts only;
3. follow: a second thread feeds its cache service's event stream for its pool into the router,
   resubscribing from where the index says when it reports a gap or a new epoch, and after a
   broken stream from the last batch applied (the cache service replays its buffer, or sends a
   snapshot when the buffer has moved past that point); this thread
   probes the worker's `readiness` health, so a dead or draining worker stops being routed to.
   A third holds a health `Watch` on `readiness`: a worker that starts draining (SIGTERM:
   readiness NOT_SERVING, design.md §8) is out of the routing within a round trip, before it
   starts refusing new requests `--drain-delay-s` later, instead of up to a probe interval
   later; the probes remain the fallback, and the only way back up (after re-identifying).
   A worker that comes back under another pool id (restarted elsewhere, new pod on the same
   address) is removed and admitted again under its new name.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.core.discovery import WorkerAddress
from gateway.core.index import ApplyStatus
from gateway.core.router import Router, Worker, log_resync
from gateway.core.tokenize import GatewayTokenizer
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.cache import CacheClient, CacheClientError
from prefixcache_client.compute import ComputeClient, ComputeClientError
from service_shell import TlsConfig, channel_options, kv, open_channel
from service_shell.retry import WORKER_RETRY, RetryPolicy

log = logging.getLogger("gateway.workers")

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
    # Between attempts of each worker thread's identify, health-watch and event-feed loops.
    backoff: RetryPolicy = WORKER_RETRY


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
    """One discovered address; see the module docstring. `stop()` from any thread."""

    def __init__(self, address: WorkerAddress, router: Router, fleet: Fleet,
                 settings: WorkerSettings) -> None:
        self.address = address
        self._router, self._fleet, self._settings = router, fleet, settings
        s = settings
        self.cache = CacheClient(address.cache, timeout_s=s.rpc_timeout_s,
                                 max_message_mb=s.max_message_mb, tls=s.tls,
                                 service_token=s.service_token)
        self._health_channel = open_channel(address.compute, channel_options(1), tls=s.tls)
        self._health = health_pb2_grpc.HealthStub(self._health_channel)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"worker-{address.compute}",
                                        daemon=True)
        self.name: str | None = None

    def start(self) -> WorkerHandle:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Leaves the routing now; the threads end on their own."""
        self._stopped.set()
        self.cache.close()  # ends the subscription, so the feed thread returns

    def join(self, timeout_s: float) -> None:
        self._thread.join(timeout_s)

    # ----- lifecycle ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                s = self._settings
                # One client per admission: the router closes it once the worker it was
                # admitted as is removed and its last call ended.
                client = ComputeClient(self.address.compute, timeout_s=s.rpc_timeout_s,
                                       max_message_mb=s.max_message_mb, tls=s.tls,
                                       service_token=s.service_token)
                info = self._identify(client)
                reason = "stopped" if info is None else self._fleet.admit(info,
                                                                        self.address.compute)
                if reason is not None:
                    client.close()
                    if info is None:
                        return
                    log.warning(kv("worker_refused", address=self.address.compute,
                                   worker=info.worker, reason=reason))
                    self._stopped.wait(s.refused_retry_s)
                    continue
                self._follow(info, client)
        except Exception:  # a bug here must not go unnoticed, nor take the gateway down
            log.exception(kv("worker_thread_failed", address=self.address.compute))
        finally:
            self._health_channel.close()

    def _identify(self, client: ComputeClient) -> pb.GetModelInfoResponse | None:
        failures = 0
        backoff = self._settings.backoff
        while not self._stopped.is_set():
            try:
                return client.model_info()
            except ComputeClientError as exc:
                failures += 1
                if failures == 1 or failures % 20 == 0:
                    log.info(kv("worker_not_answering", address=self.address.compute,
                                code=exc.status.name, message=exc.message, attempts=failures))
                self._stopped.wait(backoff.delay(failures))
        return None

    def _follow(self, info: pb.GetModelInfoResponse, client: ComputeClient) -> None:
        name = self.name = info.worker
        tokenizer = self._fleet.tokenizer
        # Before it is routed to: text prompts after readiness find the tokenizer known.
        tokenizer.worker_joined(name, info, client)
        worker = Worker(name, self.address.compute, self.address.cache, client, info)
        self._router.add(worker)
        log.info(kv("worker_added", worker=name, address=self.address.compute,
                    cache=self.address.cache, model=info.model_id, page_size=info.page_size,
                    device_pages=info.device_pages, host_pages=info.host_pages))
        left = threading.Event()  # tells the feed this registration ended
        feed = threading.Thread(target=self._feed, args=(name, left), name=f"feed-{name}",
                                daemon=True)
        feed.start()
        watches: list[grpc.Future] = []  # the current Watch call, cancelled when it left
        threading.Thread(target=self._watch, args=(name, left, watches), name=f"watch-{name}",
                         daemon=True).start()
        try:
            while not self._stopped.wait(self._settings.probe_interval_s):
                tokenizer.learn(name, info, client)  # no-op once known; retries a failed fetch
                up = self._ready()
                if up and not worker.up:
                    again = self._identify_quietly(client)
                    if again is not None and again.worker != name:
                        log.info(kv("worker_renamed", address=self.address.compute, old=name,
                                    new=again.worker))
                        return  # re-admitted under its new name by _run
                if self._router.set_up(name, up):
                    log.info(kv("worker_up" if up else "worker_down", worker=name))
        finally:
            left.set()
            for call in list(watches):
                call.cancel()
            self._router.remove(name)
            tokenizer.worker_left(name)
            self._fleet.release(name, self.address.compute)
            log.info(kv("worker_removed", worker=name, address=self.address.compute))

    def _watch(self, name: str, left: threading.Event, watches: list) -> None:
        """Takes the worker out of the routing the moment its readiness turns NOT_SERVING (it
        drains), as a health Watch stream reports it; reconnects after a failure."""
        failures = 0
        backoff = self._settings.backoff
        done: Callable[[], bool] = lambda: left.is_set() or self._stopped.is_set()
        while not done():
            call = None
            try:
                call = self._health.Watch(health_pb2.HealthCheckRequest(service="readiness"))
                watches[:] = [call]
                if done():  # left between the check and the registration: none would cancel it
                    return
                for resp in call:
                    failures = 0
                    if resp.status != _SERVING and self._router.set_up(name, False):
                        status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
                        log.info(kv("worker_down", worker=name, reason=f"readiness {status}"))
            except (grpc.RpcError, ValueError):  # ValueError: the channel was closed
                pass
            finally:
                if call is not None:
                    call.cancel()
            failures += 1
            self._stopped.wait(backoff.delay(failures))

    def _ready(self) -> bool:
        try:
            resp = self._health.Check(health_pb2.HealthCheckRequest(service="readiness"),
                                      timeout=self._settings.rpc_timeout_s)
        except grpc.RpcError:
            return False
        return resp.status == _SERVING

    @staticmethod
    def _identify_quietly(client: ComputeClient) -> pb.GetModelInfoResponse | None:
        try:
            return client.model_info()
        except ComputeClientError:
            return None

    # ----- event stream ------------------------------------------------------------------------

    def _feed(self, name: str, left: threading.Event) -> None:
        """Follows the pool's event stream into the router until the worker leaves."""
        epoch, after_seq, failures = 0, -1, 0
        backoff = self._settings.backoff
        done: Callable[[], bool] = lambda: left.is_set() or self._stopped.is_set()
        while not done():
            sub = self.cache.subscribe(name, epoch=epoch, after_seq=after_seq,
                                       heartbeat_interval_s=self._settings.heartbeat_interval_s)
            try:
                for item in sub:
                    result = self._router.on_stream_item(name, item)
                    if result is None or done():
                        return
                    failures = 0
                    if result.status is ApplyStatus.RESYNC:
                        log_resync(name, result)
                        epoch, after_seq = result.resume_epoch, result.resume_after_seq
                        break
                else:  # the cache service ended the stream: the pool was unregistered
                    if done():
                        return
                    log.info(kv("stream_ended", worker=name, reason="pool unregistered"))
                    epoch, after_seq, failures = 0, -1, failures + 1
                    self._stopped.wait(backoff.delay(failures))
            except ValueError:  # grpc: "RPC on closed channel": stop() closed the client
                return
            except CacheClientError as exc:
                if done():
                    return
                failures += 1
                # Resume where the index stopped: a replay of the missed batches, not a
                # snapshot of the whole pool (the cache service decides, by its buffer).
                epoch, after_seq = self._router.resume_point(name)
                log.warning(kv("stream_failed", worker=name, code=exc.status.name,
                               message=exc.message, attempts=failures, resume_epoch=epoch,
                               resume_after_seq=after_seq))
                self._stopped.wait(backoff.delay(failures))
            finally:
                sub.close()


class WorkerSet:
    """The handles of the addresses `source()` returns, reconciled by `refresh()`."""

    def __init__(self, source: Callable[[], list[WorkerAddress]], router: Router, fleet: Fleet,
                 settings: WorkerSettings) -> None:
        self._source = source
        self._router, self._fleet, self._settings = router, fleet, settings
        self._handles: dict[WorkerAddress, WorkerHandle] = {}
        self._lock = threading.Lock()

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
                                                      self._settings).start()

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
