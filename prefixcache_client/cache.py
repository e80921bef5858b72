"""Typed client of the cache service, used by the compute service and the gateway.

Its methods take and return the same messages as `CacheCore`'s, and a rejected call raises a
`CacheError` subclass with the same code, so code written against the embedded core runs against
a remote one unchanged. Every unary call has a deadline. `subscribe` returns a `Subscription`:
an iterator that survives broken streams and server restarts by resubscribing from the last
(epoch, seq) it delivered.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator

import grpc

from prefixcache_client.errors import CacheError, ErrorCode
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache.v1 import cache_service_pb2_grpc as pb_grpc
from service_shell import TlsConfig, channel_options, open_channel, tracing
from service_shell.retry import SUBSCRIBE_RETRY, TRANSPORT_RETRY, RetryPolicy
from service_shell.service_token import SERVICE_TOKEN_METADATA_KEY, with_service_token

log = logging.getLogger("prefixcache_client.cache")

_SERVICE = pb.DESCRIPTOR.services_by_name["CacheService"].full_name
# Idempotent calls may be retried by gRPC itself when the server was briefly unreachable.
# (RegisterPool with the same epoch and shape is an idempotent retry by contract.)
_SERVICE_CONFIG = {"methodConfig": [{
    "name": [{"service": _SERVICE, "method": m} for m in ("RegisterPool", "ListPools", "GetStats")],
    "retryPolicy": TRANSPORT_RETRY.grpc_retry_policy(max_attempts=3),
}]}
_REJECTED = {c.value for c in ErrorCode}  # the codes the core raises
_UNAVAILABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                grpc.StatusCode.CANCELLED}
# Subscribe errors that a resubscription can cure. NOT_FOUND is added once the stream has
# delivered: after a cache-service restart the pool exists again only when its worker re-registers.
_RESUBSCRIBE = _UNAVAILABLE | {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.ABORTED,
                               grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}


class CacheClientError(Exception):
    """A call to the cache service failed. `status` is the gRPC code, `message` the server's."""

    def __init__(self, method: str, status: grpc.StatusCode, message: str):
        Exception.__init__(self, method, status, message)
        self.method = method
        self.status = status
        self.message = message

    def __str__(self) -> str:
        return f"{self.method} failed: {self.status.name}: {self.message}"


class CacheRejectedError(CacheClientError, CacheError):
    """The server rejected the input; `code` is the core's `ErrorCode` (nothing was changed)."""

    def __init__(self, method: str, status: grpc.StatusCode, message: str):
        super().__init__(method, status, message)
        self.code = ErrorCode[status.name]


class CacheUnavailableError(CacheClientError):
    """The server was not reached or did not answer within the deadline. The call may or may
    not have been applied (Step is not idempotent: re-register or re-match after this)."""


def _error(method: str, err: grpc.RpcError) -> CacheClientError:
    status, message = err.code(), err.details() or ""
    if status.name in _REJECTED:
        return CacheRejectedError(method, status, message)
    if status in _UNAVAILABLE:
        return CacheUnavailableError(method, status, message)
    return CacheClientError(method, status, message)


# The resubscription backoff is service_shell's one retry policy; `Backoff` is its former name
# here, kept for callers of the public client.
Backoff = RetryPolicy


class Subscription(Iterator[pb.SubscribeResponse]):
    """The event stream of one pool. Iterate it; `close()` (from any thread) ends the iteration.

    On a broken stream it resubscribes with backoff from `resume_point`: the last batch it
    delivered, or the last complete snapshot; a stream broken inside a snapshot asks for a new
    snapshot, since the consumer already cleared its index. The iteration ends normally when the
    server ends the stream with OK (the pool was unregistered) and raises `CacheClientError` on
    an error no retry can cure.
    """

    def __init__(self, stub: pb_grpc.CacheServiceStub, pool_id: str, *, epoch: int,
                 after_seq: int, heartbeat_interval_s: float, backoff: RetryPolicy,
                 stall_timeout_s: float | None, pool_wait_s: float):
        self.pool_id = pool_id
        self.resubscriptions = 0
        self._stub = stub
        self._resume = (epoch, after_seq)
        self._heartbeat_interval_s = heartbeat_interval_s
        self._backoff = backoff
        self._stall_timeout_s = stall_timeout_s
        self._pool_wait_s = pool_wait_s
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._call: grpc.Call | None = None
        self._waiting_since: float | None = None  # set while blocked on the server
        self._stalled = False
        self._items = self._run()

    @property
    def resume_point(self) -> tuple[int, int]:
        """(epoch, after_seq) the next resubscription will send."""
        return self._resume

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def __next__(self) -> pb.SubscribeResponse:
        return next(self._items)

    def close(self) -> None:
        with self._lock:
            self._closed.set()
            if self._call is not None:
                self._call.cancel()

    cancel = close

    def __enter__(self) -> Subscription:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _run(self) -> Iterator[pb.SubscribeResponse]:
        failures = 0
        delivered = False
        not_found_since: float | None = None
        if self._stall_timeout_s is not None:
            threading.Thread(target=self._watchdog, name=f"subscribe-watchdog-{self.pool_id}",
                             daemon=True).start()
        try:
            while (call := self._open()) is not None:
                try:
                    while True:
                        self._waiting_since = time.monotonic()
                        try:
                            item = next(call)
                        except StopIteration:
                            return  # OK end: the pool was unregistered
                        finally:
                            self._waiting_since = None
                        failures, delivered, not_found_since = 0, True, None
                        self._advance(item)
                        yield item
                except grpc.RpcError as err:
                    if self._closed.is_set():
                        return
                    status = grpc.StatusCode.DEADLINE_EXCEEDED if self._stalled else err.code()
                    self._stalled = False
                    if status == grpc.StatusCode.NOT_FOUND and delivered:
                        not_found_since = not_found_since or time.monotonic()
                        if time.monotonic() - not_found_since > self._pool_wait_s:
                            raise _error("Subscribe", err) from None
                    elif status not in _RESUBSCRIBE:
                        raise _error("Subscribe", err) from None
                    failures += 1
                    self.resubscriptions += 1
                    delay = self._backoff.delay(failures)
                    log.info("event=resubscribe pool=%s code=%s epoch=%d after_seq=%d "
                             "delay_s=%.3f failures=%d", self.pool_id, status.name,
                             *self._resume, delay, failures)
                    if self._closed.wait(delay):
                        return
                finally:
                    call.cancel()  # no-op when finished; frees the stream when abandoned
        finally:
            self._closed.set()  # also stops the watchdog

    def _open(self) -> grpc.Call | None:
        with self._lock:
            if self._closed.is_set():
                return None
            epoch, after_seq = self._resume
            self._call = self._stub.Subscribe(pb.SubscribeRequest(
                pool_id=self.pool_id, epoch=epoch, after_seq=after_seq,
                heartbeat_interval_s=self._heartbeat_interval_s))
            return self._call

    def _advance(self, item: pb.SubscribeResponse) -> None:
        if item.WhichOneof("item") != "batch":
            return
        batch = item.batch
        if batch.snapshot and not batch.snapshot_end:
            self._resume = (batch.epoch, -1)
        else:
            self._resume = (batch.epoch, batch.seq)

    def _watchdog(self) -> None:
        """Cancels a stream that sent nothing (not even a heartbeat) for `stall_timeout_s` while
        the consumer waited on it: a wedged server or a half-open connection keepalive missed."""
        assert self._stall_timeout_s is not None
        while not self._closed.wait(self._stall_timeout_s / 4):
            since = self._waiting_since
            if since is not None and time.monotonic() - since > self._stall_timeout_s:
                with self._lock:
                    if self._call is not None and not self._closed.is_set():
                        self._stalled = True
                        self._call.cancel()


class CacheClient:
    """Client of one cache service. Thread-safe; close() it (or use `with`) when done.

    `tls` (PEM files, e.g. `TlsConfig.from_env()`) or `credentials` make the channel TLS;
    plaintext without either. `service_token` is sent on every call as this process's service
    identity (`x-prefixcache-service-token`; service_shell/auth.py)."""

    def __init__(self, target: str, *, timeout_s: float = 5.0, max_message_mb: int = 64,
                 tls: TlsConfig | None = None,
                 credentials: grpc.ChannelCredentials | None = None,
                 service_token: str | None = None):
        self.target = target
        self.timeout_s = timeout_s
        self._channel = open_channel(target, channel_options(max_message_mb, _SERVICE_CONFIG),
                                     tls=tls, credentials=credentials)
        # Unary calls (Step: once per engine step) add the token themselves, which costs less
        # than a channel interceptor on every call; subscriptions go through one.
        self._metadata = ((SERVICE_TOKEN_METADATA_KEY, service_token),) if service_token else None
        self._stub = pb_grpc.CacheServiceStub(self._channel)
        self._stream_stub = pb_grpc.CacheServiceStub(with_service_token(self._channel,
                                                                        service_token))
        self._subscriptions: list[Subscription] = []
        self._lock = threading.Lock()

    def wait_until_ready(self, timeout_s: float | None = None) -> None:
        """Blocks until the channel is connected; raises CacheUnavailableError on timeout."""
        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout_s or self.timeout_s)
        except grpc.FutureTimeoutError:
            raise CacheUnavailableError("connect", grpc.StatusCode.UNAVAILABLE,
                                        f"no connection to {self.target}") from None

    def register_pool(self, req: pb.RegisterPoolRequest, *,
                      timeout_s: float | None = None) -> pb.RegisterPoolResponse:
        return self._unary("RegisterPool", self._stub.RegisterPool, req, timeout_s)

    def unregister_pool(self, req: pb.UnregisterPoolRequest, *,
                        timeout_s: float | None = None) -> pb.UnregisterPoolResponse:
        return self._unary("UnregisterPool", self._stub.UnregisterPool, req, timeout_s)

    def list_pools(self, req: pb.ListPoolsRequest | None = None, *,
                   timeout_s: float | None = None) -> pb.ListPoolsResponse:
        return self._unary("ListPools", self._stub.ListPools, req or pb.ListPoolsRequest(),
                           timeout_s)

    def step(self, req: pb.StepRequest, *, timeout_s: float | None = None) -> pb.StepResponse:
        return self._unary("Step", self._stub.Step, req, timeout_s)

    def evict_namespace(self, req: pb.EvictNamespaceRequest, *,
                        timeout_s: float | None = None) -> pb.EvictNamespaceResponse:
        return self._unary("EvictNamespace", self._stub.EvictNamespace, req, timeout_s)

    def get_stats(self, req: pb.GetStatsRequest | None = None, *,
                  timeout_s: float | None = None) -> pb.GetStatsResponse:
        return self._unary("GetStats", self._stub.GetStats, req or pb.GetStatsRequest(),
                           timeout_s)

    def subscribe(self, pool_id: str, *, epoch: int = 0, after_seq: int = -1,
                  heartbeat_interval_s: float = 0.0, backoff: RetryPolicy | None = None,
                  stall_timeout_s: float | None = -1.0,
                  pool_wait_s: float = 30.0) -> Subscription:
        """Events of `pool_id` after (epoch, after_seq); after_seq=-1 starts with a snapshot.

        stall_timeout_s: resubscribe when nothing arrived for that long; -1 = five heartbeat
        intervals but at least 10 s; None = never. pool_wait_s: after a restart of the cache
        service, how long to wait for the pool to be registered again before raising NOT_FOUND.
        """
        if stall_timeout_s is not None and stall_timeout_s < 0:
            stall_timeout_s = max(10.0, 5 * (heartbeat_interval_s or 1.0))
        sub = Subscription(self._stream_stub, pool_id, epoch=epoch, after_seq=after_seq,
                           heartbeat_interval_s=heartbeat_interval_s, backoff=backoff or SUBSCRIBE_RETRY,
                           stall_timeout_s=stall_timeout_s, pool_wait_s=pool_wait_s)
        with self._lock:
            self._subscriptions = [s for s in self._subscriptions if not s.closed] + [sub]
        return sub

    def close(self) -> None:
        """Ends every subscription of this client and closes the channel."""
        with self._lock:
            subs, self._subscriptions = self._subscriptions, []
        for sub in subs:
            sub.close()
        self._channel.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    def _unary(self, method: str, stub_method, req, timeout_s: float | None):
        try:
            # The trace context current on this thread (the engine's cache.Step span), when
            # tracing is on: the cache service's span joins it.
            return stub_method(req, timeout=self.timeout_s if timeout_s is None else timeout_s,
                               metadata=tracing.inject(self._metadata))
        except grpc.RpcError as err:
            raise _error(method, err) from None
