"""The gRPC server over real loopback gRPC: Step end to end, status codes of bad input (and that
nothing changed), subscriptions, health and drain, reflection, metrics, lease expiry, the CLI."""
from __future__ import annotations

import functools
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from cache_service import __main__ as cli
from cache_service.core import CacheCore
from cache_service.server import SERVICE_NAME
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache.v1 import common_pb2
from prefixcache_client.hash import MAX_TOKEN_ID
from tests.cache_service.grpc_harness import (PAGE, PROMPT, cache_prompt, expected_hashes,
                                              match_op, register, running_server, server_process,
                                              stub_for)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def stub():
    with running_server(CacheCore(max_ops_per_step=8), max_message_mb=1) as server:
        with stub_for(server) as s:
            yield s


def step(stub, pool_id="pool-a", epoch=1, **ops) -> pb.StepResponse:
    return stub.Step(pb.StepRequest(pool_id=pool_id, epoch=epoch, **ops), timeout=5)


def via(stub):
    """The stub's Step as a plain callable with a deadline, for `cache_prompt`."""
    return functools.partial(stub.Step, timeout=5)


def stats(stub, pool_id="pool-a") -> pb.PoolStats:
    return stub.GetStats(pb.GetStatsRequest(pool_id=pool_id), timeout=5).pools[0]


def batches(items) -> list:
    return [i.batch for i in items if i.WhichOneof("item") == "batch"]


def next_batch(stream):
    for item in stream:
        if item.WhichOneof("item") == "batch":
            return item.batch
    raise AssertionError("stream ended")


# ---- Step end to end ---------------------------------------------------------------------------

def test_step_end_to_end(stub):
    assert stub.RegisterPool(register(), timeout=5).reset
    first = step(stub, matches=[match_op()]).matches[0]
    assert (first.cached_tokens, list(first.device_pages)) == (0, [])
    alloc = step(stub, allocations=[pb.AllocateOp(lease_id=first.lease_id, num_pages=3)])
    assert alloc.allocations[0].ok and len(alloc.allocations[0].device_pages) == 3
    pub = step(stub, publishes=[pb.PublishOp(lease_id=first.lease_id, computed_pages=3)])
    assert pub.publishes[0].inserted_pages == 3

    second = step(stub, matches=[match_op(request_id="r2")]).matches[0]
    assert second.request_id == "r2"
    assert second.cached_tokens == second.device_hit_tokens == 3 * PAGE
    assert list(second.device_pages) == list(alloc.allocations[0].device_pages)
    assert list(second.page_hashes) == expected_hashes(PROMPT)

    step(stub, releases=[pb.ReleaseOp(lease_id=first.lease_id),
                         pb.ReleaseOp(lease_id=second.lease_id)])
    s = stats(stub)
    assert s.active_leases == 0
    assert (s.queried_tokens, s.hit_tokens_device) == (2 * len(PROMPT), 3 * PAGE)
    device = next(m for m in s.media if m.medium == common_pb2.MEDIUM_DEVICE)
    assert (device.cached_pages, device.pinned_pages, device.evictable_pages) == (3, 0, 3)


# ---- bad input: status code, a message naming the field, nothing changed -----------------------

def _other_pool_lease(stub) -> str:
    stub.RegisterPool(register("pool-b"), timeout=5)
    return step(stub, "pool-b", matches=[match_op()]).matches[0].lease_id


BAD_STEPS = {
    "negative token id": (lambda stub: {"matches": [match_op(), match_op([1, -1, 2])]},
                          grpc.StatusCode.INVALID_ARGUMENT, "matches[1].token_ids"),
    "token id above u32": (lambda stub: {"matches": [match_op(), match_op([MAX_TOKEN_ID + 1])]},
                           grpc.StatusCode.INVALID_ARGUMENT, "matches[1].token_ids"),
    "unknown pool": (lambda stub: {"pool_id": "no-such-pool", "matches": [match_op()]},
                     grpc.StatusCode.NOT_FOUND, "pool_id"),
    "unknown lease": (lambda stub: {"matches": [match_op()], "allocations": [
        pb.AllocateOp(lease_id="no-such-lease", num_pages=1)]},
        grpc.StatusCode.NOT_FOUND, "allocations[0]"),
    "lease of another pool": (lambda stub: {"matches": [match_op()], "allocations": [
        pb.AllocateOp(lease_id=_other_pool_lease(stub), num_pages=1)]},
        grpc.StatusCode.INVALID_ARGUMENT, "allocations[0]"),
    "wrong epoch": (lambda stub: {"epoch": 2, "matches": [match_op()]},
                    grpc.StatusCode.FAILED_PRECONDITION, "epoch"),
    "oversized batch": (lambda stub: {"matches": [match_op(request_id=str(i)) for i in range(9)]},
                        grpc.StatusCode.INVALID_ARGUMENT, "step"),
}


@pytest.mark.parametrize("case", BAD_STEPS)
def test_bad_step_is_rejected_and_changes_nothing(stub, case):
    stub.RegisterPool(register(), timeout=5)
    cache_prompt(via(stub))
    make_ops, code, field = BAD_STEPS[case]
    ops = make_ops(stub)
    before = stats(stub)
    with pytest.raises(grpc.RpcError) as err:
        step(stub, **ops)
    assert err.value.code() == code
    assert field in err.value.details()
    # The valid match in the same step did not run: no lease, no queried tokens, same pages.
    assert stats(stub) == before
    again = step(stub, matches=[match_op()]).matches[0]
    assert again.cached_tokens == 3 * PAGE


def test_evict_unknown_namespace_is_not_found(stub):
    stub.RegisterPool(register(), timeout=5)
    cache_prompt(via(stub))
    before = stats(stub)
    with pytest.raises(grpc.RpcError) as err:
        stub.EvictNamespace(pb.EvictNamespaceRequest(
            pool_id="pool-a", namespace=common_pb2.Namespace(adapter="no-such-adapter")), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "namespace" in err.value.details()
    assert stats(stub) == before


@pytest.mark.parametrize("page_size", [0, 4097])
def test_register_bad_page_size(stub, page_size):
    with pytest.raises(grpc.RpcError) as err:
        stub.RegisterPool(pb.RegisterPoolRequest(pool_id="pool-a", epoch=1, page_size=page_size,
                                                 device_pages=4, model_id="m"), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "page_size" in err.value.details()
    assert not stub.ListPools(pb.ListPoolsRequest(), timeout=5).pools


def test_message_over_the_size_limit_is_resource_exhausted(stub):
    stub.RegisterPool(register(), timeout=5)
    huge = match_op([-1] * 110_000)  # 10 bytes per id: ~1.1 MB, over the fixture's 1 MiB
    with pytest.raises(grpc.RpcError) as err:
        step(stub, matches=[huge])
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stats(stub).queried_tokens == 0


# ---- subscriptions --------------------------------------------------------------------------

def subscribe(stub, pool_id="pool-a", epoch=0, after_seq=-1):
    return stub.Subscribe(pb.SubscribeRequest(pool_id=pool_id, epoch=epoch, after_seq=after_seq,
                                              heartbeat_interval_s=0.05), timeout=10)


def test_subscribe_snapshot_then_live_events(stub):
    stub.RegisterPool(register(), timeout=5)
    stream = subscribe(stub)
    snap = next_batch(stream)
    assert snap.snapshot and snap.snapshot_end
    assert snap.events[0].WhichOneof("event") == "cleared"
    cache_prompt(via(stub))
    live = next_batch(stream)
    assert not live.snapshot and live.seq == snap.seq + 1
    stored = live.events[0].stored
    assert list(stored.block_hashes) == expected_hashes(PROMPT)
    assert list(stored.token_ids) == PROMPT[:3 * PAGE]
    assert (stored.block_size, stored.parent_block_hash, stored.medium) == (
        PAGE, b"", common_pb2.MEDIUM_DEVICE)
    stream.cancel()


def test_subscribe_resumes_with_exactly_the_missed_batches(stub):
    stub.RegisterPool(register(), timeout=5)
    head = stub.ListPools(pb.ListPoolsRequest(), timeout=5).pools[0].head_seq
    cache_prompt(via(stub))
    cache_prompt(via(stub), tokens=list(range(500, 509)))
    new_head = stub.ListPools(pb.ListPoolsRequest(), timeout=5).pools[0].head_seq
    assert new_head > head

    stream = subscribe(stub, epoch=1, after_seq=head)
    got = []
    for item in stream:
        if item.WhichOneof("item") == "heartbeat":
            assert item.heartbeat.head_seq == new_head
            break
        got.append(item.batch)
    stream.cancel()
    assert [b.seq for b in got] == list(range(head + 1, new_head + 1))
    assert not any(b.snapshot for b in got)


def test_subscribe_after_a_gap_gets_a_snapshot_then_live():
    with running_server(CacheCore(replay_events=2)) as server, stub_for(server) as stub:
        stub.RegisterPool(register(), timeout=5)
        for i in range(3):  # each inserts 2 pages: seq 0 falls out of a 2-event buffer
            cache_prompt(via(stub), tokens=list(range(i * 100, i * 100 + 9)))
        stream = subscribe(stub, epoch=1, after_seq=0)
        snap = []
        while not snap or not snap[-1].snapshot_end:
            snap.append(next_batch(stream))
        assert all(b.snapshot for b in snap)
        assert snap[0].events[0].WhichOneof("event") == "cleared"
        stored = [h for b in snap for e in b.events if e.HasField("stored")
                  for h in e.stored.block_hashes]
        assert len(stored) == 6
        cache_prompt(via(stub), tokens=list(range(900, 909)))
        live = next_batch(stream)
        assert not live.snapshot and live.seq == snap[-1].seq + 1
        stream.cancel()


def test_new_epoch_clears_and_continues_in_the_new_epoch(stub):
    stub.RegisterPool(register(epoch=1), timeout=5)
    cache_prompt(via(stub))
    stream = subscribe(stub)
    assert next_batch(stream).snapshot_end
    assert stub.RegisterPool(register(epoch=2), timeout=5).reset
    retired = next_batch(stream)
    assert retired.epoch == 1 and retired.events[-1].WhichOneof("event") == "cleared"
    fresh = next_batch(stream)
    assert fresh.epoch == 2 and fresh.events[0].WhichOneof("event") == "cleared"
    while not fresh.snapshot_end and fresh.snapshot:
        fresh = next_batch(stream)
    cache_prompt(via(stub), epoch=2)
    live = next_batch(stream)
    assert live.epoch == 2 and list(live.events[0].stored.block_hashes) == expected_hashes(PROMPT)
    stream.cancel()


def test_unregister_ends_the_stream_after_all_blocks_cleared(stub):
    stub.RegisterPool(register(), timeout=5)
    stream = subscribe(stub)
    next_batch(stream)
    stub.UnregisterPool(pb.UnregisterPoolRequest(pool_id="pool-a"), timeout=5)
    rest = batches(stream)  # ends with OK
    assert rest[-1].events[-1].WhichOneof("event") == "cleared"
    assert stream.code() == grpc.StatusCode.OK


def test_heartbeat_relays_the_load_report(stub):
    stub.RegisterPool(register(), timeout=5)
    load = common_pb2.LoadReport(waiting_requests=3, running_requests=2, queued_prefill_tokens=99)
    step(stub, load=load)
    stream = subscribe(stub)
    beat = next(i.heartbeat for i in stream if i.WhichOneof("item") == "heartbeat")
    stream.cancel()
    assert beat.load.waiting_requests == 3 and beat.load.queued_prefill_tokens == 99


def test_subscribe_unknown_pool_is_not_found(stub):
    with pytest.raises(grpc.RpcError) as err:
        next(subscribe(stub, pool_id="no-such-pool"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert "pool_id" in err.value.details()


def test_subscriptions_beyond_the_limit_are_resource_exhausted():
    with running_server(max_workers=4, max_subscriptions=1) as server, stub_for(server) as stub:
        stub.RegisterPool(register(), timeout=5)
        first = subscribe(stub)
        next_batch(first)
        with pytest.raises(grpc.RpcError) as err:
            next(subscribe(stub))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        first.cancel()


def test_drain_ends_subscriptions_with_unavailable():
    with running_server(grace_s=5.0) as server, stub_for(server) as stub:
        stub.RegisterPool(register(), timeout=5)
        stream = subscribe(stub)
        next_batch(stream)
        start = time.monotonic()
        server.drain()
        with pytest.raises(grpc.RpcError) as err:
            batches(stream)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert time.monotonic() - start < 2.0  # not held for the whole grace period


# ---- leases expire without any call ------------------------------------------------------------

def test_background_thread_expires_leases():
    with running_server(expire_interval_s=0.05) as server, stub_for(server) as stub:
        stub.RegisterPool(register(lease_ttl_s=0.1), timeout=5)
        step(stub, matches=[match_op()])
        assert stats(stub).active_leases == 1
        deadline = time.monotonic() + 3
        while stats(stub).active_leases and time.monotonic() < deadline:
            time.sleep(0.05)
        s = stats(stub)
        assert (s.active_leases, s.lease_expiries) == (0, 1)


# ---- health, reflection, metrics -----------------------------------------------------------

def test_reflection_lists_the_services():
    with running_server() as server, grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            list_services="")]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names
        reply = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(
            file_containing_symbol=SERVICE_NAME)]), timeout=5))
        assert reply.file_descriptor_response.file_descriptor_proto


def test_metrics_endpoint_serves_rpc_and_pool_metrics():
    with running_server(metrics_port=0) as server, stub_for(server) as stub:
        stub.RegisterPool(register(), timeout=5)
        cache_prompt(via(stub))
        with pytest.raises(grpc.RpcError):
            step(stub, epoch=9)
        stream = subscribe(stub)
        next_batch(stream)
        url = f"http://127.0.0.1:{server.metrics_port}/metrics"
        text = urllib.request.urlopen(url, timeout=5).read().decode()
        stream.cancel()
    assert 'prefixcache_cache_rpcs_total{code="OK",method="Step"} 3.0' in text
    assert 'prefixcache_cache_rpcs_total{code="FAILED_PRECONDITION",method="Step"} 1.0' in text
    assert 'prefixcache_cache_rpc_duration_seconds_count{method="Step"} 4.0' in text
    assert "prefixcache_cache_active_subscriptions 1.0" in text
    assert 'prefixcache_cache_pages{medium="device",pool="pool-a",state="cached"} 3.0' in text
    assert 'prefixcache_cache_pages{medium="device",pool="pool-a",state="pinned"} 0.0' in text
    assert 'prefixcache_cache_hit_tokens_total{medium="device",pool="pool-a"} 0.0' in text
    assert 'prefixcache_cache_active_leases{pool="pool-a"} 0.0' in text


def _watch(channel, service):
    return health_pb2_grpc.HealthStub(channel).Watch(
        health_pb2.HealthCheckRequest(service=service), timeout=10)


def test_sigterm_drains_health_then_exits_zero():
    with server_process(0, "--grace-s", "3") as proc:
        with grpc.insecure_channel(proc.target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for service in ("", "liveness", "readiness", SERVICE_NAME):
                reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
                assert reply.status == SERVING, service
            watches = {name: _watch(channel, name) for name in ("liveness", "readiness")}
            for stream in watches.values():
                assert next(stream).status == SERVING
            start = time.monotonic()
            proc.terminate()
            for name, stream in watches.items():
                assert next(stream).status == NOT_SERVING, name
                stream.cancel()
        assert proc.proc.wait(timeout=3) == 0
        assert time.monotonic() - start < 3
        log = proc.log()
    assert "event=drain_started" in log and "event=server_stopped" in log


def test_cli_reads_the_environment(monkeypatch):
    monkeypatch.setenv("PREFIXCACHE_CACHE_PORT", "6000")
    monkeypatch.setenv("PREFIXCACHE_METRICS_PORT", "9100")
    monkeypatch.setenv("PREFIXCACHE_MAX_MESSAGE_MB", "8")
    monkeypatch.setenv("PREFIXCACHE_REPLAY_EVENTS", "77")
    monkeypatch.setenv("PREFIXCACHE_LOG_LEVEL", "debug")
    args = cli.parse_args([])
    assert (args.port, args.metrics_port, args.max_message_mb, args.replay_events,
            args.log_level) == (6000, 9100, 8, 77, "DEBUG")
    assert cli.parse_args(["--port", "0"]).port == 0

