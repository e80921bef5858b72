"""CacheClient over real loopback gRPC: typed calls, errors and deadlines, and subscriptions that
resume across broken streams, drained servers and a killed server process."""
from __future__ import annotations

import contextlib
import threading
import time
from concurrent import futures

import grpc
import pytest

from cache_service.core import CacheCore
from cache_service.server import CacheServer, ServerConfig
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache.v1 import cache_service_pb2_grpc as pb_grpc
from prefixcache.v1 import common_pb2, events_pb2
from prefixcache_client.cache import CacheClient, CacheRejectedError, CacheUnavailableError
from service_shell.retry import RetryPolicy
from prefixcache_client.errors import CacheError, ErrorCode
from stack.launcher import free_port
from tests.cache_service.grpc_harness import (PAGE, PROMPT, cache_prompt, expected_hashes,
                                              match_op, register, running_server, server_process)

FAST = RetryPolicy(initial_s=0.01, max_s=0.1)
OTHER = list(range(700, 709))


def next_batch(sub) -> events_pb2.EventBatch:
    for item in sub:
        if item.WhichOneof("item") == "batch":
            return item.batch
    raise AssertionError("subscription ended")


def snapshot(sub) -> list[events_pb2.EventBatch]:
    out = [next_batch(sub)]
    while not out[-1].snapshot_end:
        out.append(next_batch(sub))
    assert all(b.snapshot for b in out) and out[0].events[0].HasField("cleared")
    return out


def stored_hashes(batches) -> list[bytes]:
    return [h for b in batches for e in b.events if e.HasField("stored")
            for h in e.stored.block_hashes]


@pytest.fixture
def server():
    with running_server() as s:
        yield s


@pytest.fixture
def client(server):
    with CacheClient(f"127.0.0.1:{server.port}", timeout_s=5) as c:
        yield c


# ---- unary calls -------------------------------------------------------------------------

def test_every_method_returns_its_typed_response(client):
    assert client.register_pool(register()).reset
    assert [p.pool_id for p in client.list_pools().pools] == ["pool-a"]
    cache_prompt(client.step)
    hit = client.step(pb.StepRequest(pool_id="pool-a", epoch=1, matches=[match_op()])).matches[0]
    assert hit.cached_tokens == 3 * PAGE
    client.step(pb.StepRequest(pool_id="pool-a", epoch=1,
                               releases=[pb.ReleaseOp(lease_id=hit.lease_id)]))
    assert client.get_stats().pools[0].hit_tokens_device == 3 * PAGE
    evicted = client.evict_namespace(pb.EvictNamespaceRequest(
        pool_id="pool-a", namespace=common_pb2.Namespace()))
    assert (evicted.removed_pages, evicted.deferred_pages) == (3, 0)
    client.unregister_pool(pb.UnregisterPoolRequest(pool_id="pool-a"))
    assert not client.list_pools().pools


def test_rejected_call_raises_the_core_error_type(client):
    client.register_pool(register())
    with pytest.raises(CacheRejectedError) as err:
        client.step(pb.StepRequest(pool_id="pool-a", epoch=1, matches=[match_op([-5])]))
    assert isinstance(err.value, CacheError)  # callers treat embedded and remote cores alike
    assert err.value.code == ErrorCode.INVALID_ARGUMENT
    assert err.value.status == grpc.StatusCode.INVALID_ARGUMENT
    assert "matches[0].token_ids" in err.value.message
    assert str(err.value).startswith("Step failed: INVALID_ARGUMENT: matches[0].token_ids")
    with pytest.raises(CacheRejectedError) as err:
        client.get_stats(pb.GetStatsRequest(pool_id="nope"))
    assert err.value.code == ErrorCode.NOT_FOUND


class _SlowStep(pb_grpc.CacheServiceServicer):
    def __init__(self):
        self.release = threading.Event()

    def Step(self, request, context):
        self.release.wait(5)
        return pb.StepResponse()


@contextlib.contextmanager
def fake_server(servicer):
    server = grpc.server(futures.ThreadPoolExecutor(4))
    pb_grpc.add_CacheServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)


def test_every_call_has_a_deadline():
    servicer = _SlowStep()
    with fake_server(servicer) as target, CacheClient(target, timeout_s=0.2) as client:
        start = time.monotonic()
        with pytest.raises(CacheUnavailableError) as err:
            client.step(pb.StepRequest(pool_id="p", epoch=1))
        assert err.value.status == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(CacheUnavailableError):
            client.step(pb.StepRequest(pool_id="p", epoch=1), timeout_s=0.05)
        servicer.release.set()
        assert time.monotonic() - start < 1.5


def test_unreachable_server_is_unavailable():
    with CacheClient(f"127.0.0.1:{free_port()}", timeout_s=1) as client:
        with pytest.raises(CacheUnavailableError) as err:
            client.list_pools()
        assert err.value.status == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(CacheUnavailableError):
            client.wait_until_ready(0.1)


# ---- subscriptions against the real server ----------------------------------------------------

def test_subscribe_snapshot_then_live_and_resume_point(client):
    client.register_pool(register())
    sub = client.subscribe("pool-a", heartbeat_interval_s=0.05, backoff=FAST)
    assert sub.resume_point == (0, -1)
    snap = snapshot(sub)
    assert sub.resume_point == (1, snap[-1].seq)
    cache_prompt(client.step)
    live = next_batch(sub)
    assert stored_hashes([live]) == expected_hashes(PROMPT)
    assert sub.resume_point == (1, live.seq)
    sub.close()
    assert list(sub) == []


def test_close_from_another_thread_ends_a_blocked_iteration(client):
    client.register_pool(register())
    sub = client.subscribe("pool-a", heartbeat_interval_s=5.0)
    snapshot(sub)
    threading.Timer(0.1, sub.close).start()
    start = time.monotonic()
    assert list(sub) == []  # blocked waiting for the next heartbeat until closed
    assert time.monotonic() - start < 1.0
    assert sub.closed


def test_client_close_ends_its_subscriptions(server):
    client = CacheClient(f"127.0.0.1:{server.port}")
    client.register_pool(register())
    sub = client.subscribe("pool-a", heartbeat_interval_s=5.0)
    snapshot(sub)
    threading.Timer(0.1, client.close).start()
    assert list(sub) == []


def test_unknown_pool_and_bad_request_raise(client):
    with pytest.raises(CacheRejectedError) as err:
        next(client.subscribe("no-such-pool"))
    assert err.value.code == ErrorCode.NOT_FOUND
    client.register_pool(register())
    with pytest.raises(CacheRejectedError) as err:
        next(client.subscribe("pool-a", heartbeat_interval_s=0.001))
    assert "heartbeat_interval_s" in err.value.message


def test_unregister_ends_the_iteration(client):
    client.register_pool(register())
    sub = client.subscribe("pool-a", heartbeat_interval_s=0.05)
    snapshot(sub)
    client.unregister_pool(pb.UnregisterPoolRequest(pool_id="pool-a"))
    rest = [i.batch for i in sub if i.WhichOneof("item") == "batch"]
    assert rest[-1].events[-1].HasField("cleared")
    assert sub.resubscriptions == 0


def test_resubscribes_to_a_restarted_server_after_drain():
    first = CacheServer(CacheCore(), ServerConfig(host="127.0.0.1", port=0, grace_s=0)).start()
    client = CacheClient(f"127.0.0.1:{first.port}", timeout_s=5)
    client.register_pool(register(epoch=1))
    cache_prompt(client.step)
    sub = client.subscribe("pool-a", heartbeat_interval_s=0.05, backoff=FAST)
    assert stored_hashes(snapshot(sub)) == expected_hashes(PROMPT)
    first.drain()  # the stream ends with UNAVAILABLE
    with running_server(port=first.port) as restarted:
        client.wait_until_ready(5)
        client.register_pool(register(epoch=2))
        cache_prompt(client.step, epoch=2, tokens=OTHER)
        snap = snapshot(sub)
        assert snap[-1].epoch == 2 and stored_hashes(snap) == expected_hashes(OTHER)
        assert sub.resubscriptions >= 1
        assert restarted.port == first.port
    client.close()


def test_subscription_survives_a_killed_server_process():
    with server_process(0) as first:
        port = first.port
        client = CacheClient(first.target, timeout_s=5)
        client.register_pool(register(epoch=1))
        cache_prompt(client.step)
        sub = client.subscribe("pool-a", heartbeat_interval_s=0.1, backoff=FAST)
        assert stored_hashes(snapshot(sub)) == expected_hashes(PROMPT)
        first.kill()  # SIGKILL: no drain, the connection just breaks
    with server_process(port) as second:
        assert second.port == port
        client.wait_until_ready(5)
        client.register_pool(register(epoch=2))  # the worker re-registers with the new server
        cache_prompt(client.step, epoch=2)
        snap = snapshot(sub)
        assert snap[-1].epoch == 2 and stored_hashes(snap) == expected_hashes(PROMPT)
        cache_prompt(client.step, epoch=2, tokens=OTHER)
        live = next_batch(sub)
        assert (live.epoch, live.snapshot) == (2, False)
        assert stored_hashes([live]) == expected_hashes(OTHER)
        assert sub.resubscriptions >= 1
        client.close()


# ---- resubscription rules, against a scripted server ----------------------------------------

def _batch(epoch: int, seq: int, snapshot: bool = False, end: bool = False):
    return pb.SubscribeResponse(batch=events_pb2.EventBatch(
        pool_id="p", epoch=epoch, seq=seq, snapshot=snapshot, snapshot_end=end))


_BEAT = pb.SubscribeResponse(heartbeat=events_pb2.Heartbeat(pool_id="p"))


class _ScriptedSubscribe(pb_grpc.CacheServiceServicer):
    """Call i yields script[i]'s items and then ends with its status (None: hangs until the
    client goes away)."""

    def __init__(self, script):
        self.script = script
        self.requests: list[tuple[int, int]] = []

    def Subscribe(self, request, context):
        self.requests.append((request.epoch, request.after_seq))
        items, status = self.script[min(len(self.requests), len(self.script)) - 1]
        yield from items
        if status is None:
            while context.is_active():
                time.sleep(0.01)
        else:
            context.abort(status, "scripted")


def test_resumes_after_the_last_batch_and_restarts_a_broken_snapshot():
    unavailable = grpc.StatusCode.UNAVAILABLE
    servicer = _ScriptedSubscribe([
        ([_batch(7, 4), _batch(7, 5)], unavailable),
        ([_batch(7, 9, snapshot=True)], unavailable),  # broken inside a snapshot
        ([_batch(8, 3, snapshot=True, end=True)], unavailable),
        ([_BEAT], None),
    ])
    with fake_server(servicer) as target, CacheClient(target) as client:
        sub = client.subscribe("p", epoch=7, after_seq=3, backoff=FAST)
        got = [next(sub) for _ in range(5)]
        sub.close()
    assert got[-1] == _BEAT
    assert servicer.requests == [(7, 3), (7, 5), (7, -1), (8, 3)]
    assert sub.resubscriptions == 3


def test_a_stalled_stream_is_resubscribed():
    servicer = _ScriptedSubscribe([([_batch(1, 0)], None)])
    with fake_server(servicer) as target, CacheClient(target) as client:
        sub = client.subscribe("p", backoff=FAST, stall_timeout_s=0.2)
        next(sub)
        start = time.monotonic()
        next(sub)  # the first stream never sends again: the watchdog cancels it
        assert 0.15 < time.monotonic() - start < 1.5
        sub.close()
    assert servicer.requests[:2] == [(0, -1), (1, 0)]
    assert sub.resubscriptions >= 1


def test_pool_missing_after_a_break_is_awaited_then_reported():
    servicer = _ScriptedSubscribe([([_batch(1, 0)], grpc.StatusCode.UNAVAILABLE),
                                   ([], grpc.StatusCode.NOT_FOUND)])
    with fake_server(servicer) as target, CacheClient(target) as client:
        sub = client.subscribe("p", backoff=FAST, pool_wait_s=0.2)
        next(sub)
        with pytest.raises(CacheRejectedError) as err:
            next(sub)
    assert err.value.code == ErrorCode.NOT_FOUND
    assert len(servicer.requests) >= 3  # NOT_FOUND was retried before giving up

