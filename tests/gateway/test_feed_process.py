"""The event streams read in a process of their own (`--feed-process`,
gateway/core/feed_process.py): the index it builds equals the one the gateway's own feeds build,
through a real cache service and CacheCore; a killed feed process is replaced and every feed
resumes where the index is. RESYNCs and broken streams through it: test_server_membership.py and
test_stream_resume.py run with it too."""
from __future__ import annotations

import asyncio
import logging
import os
import pickle
import signal

import grpc

from cache_service.core import CacheCore
from gateway.__main__ import config_from_args, parse_args
from gateway.core.discovery import WorkerAddress
from gateway.core import feed_process
from gateway.core.feed_process import MAX_QUEUED_ITEMS, FeedProcess
from gateway.core.feed_streams import StreamSettings
from gateway.core.feeds import FeedLoop
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import make_policy
from gateway.core.router import Router
from gateway.core import workers as workers_module
from gateway.core.workers import Fleet, WorkerSet
from prefixcache.v1 import common_pb2
from service_shell.retry import WORKER_RETRY
from tests.cache_service.grpc_harness import running_server
from tests.gateway.gateway_harness import (FakeWorker, cache_prompt, register_pool,
                                           running_gateway, settings, wait_until)
from tests.gateway.server_helpers import sample
from tests.gateway.test_stream_resume import BreakableCache

POOLS = ("fa", "fb", "fc")
MEDIA = (common_pb2.MEDIUM_DEVICE, common_pb2.MEDIUM_HOST, common_pb2.MEDIUM_REMOTE)


def _prompt(pool: int, i: int) -> list[int]:
    return [pool * 100_000 + i * 100 + t for t in range(41)]  # 10 full pages of 4


def _state(gw) -> dict:
    """What the gateway's index holds: per pool, its epoch, last seq and pages per medium."""
    with gw.router.lock:
        out = {}
        for name in POOLS:
            info = gw.router.index.info(name)
            out[name] = None if info is None else (
                info.epoch, info.last_seq,
                tuple(frozenset(gw.router.index.pages(name, m)) for m in MEDIA))
        return out


def _heads(core: CacheCore) -> dict[str, int]:
    return {name: core.pool_records(name, -1)[0].log.head_seq for name in POOLS}


def _caught_up(gw, core: CacheCore) -> bool:
    state, heads = _state(gw), _heads(core)
    return all(state[n] is not None and state[n][1] == heads[n] for n in POOLS)


def test_the_feed_process_builds_the_index_the_gateways_own_feeds_build():
    """Three pools of 256 device pages each take 40 prompts of 10 pages (evictions: removed
    events), half before the gateways start (their snapshots), half after (live batches)."""
    with running_server() as cache:
        core, address = cache.core, f"127.0.0.1:{cache.port}"
        workers = [FakeWorker(n) for n in POOLS]
        for w in workers:
            register_pool(core, w.name)
        for i in range(20):
            for p, name in enumerate(POOLS):
                cache_prompt(core, name, _prompt(p, i))
        addresses = [WorkerAddress(w.address, address) for w in workers]
        try:
            with running_gateway(lambda: addresses) as own, running_gateway(
                    lambda: addresses, worker=settings(feed_process=True)) as remote:
                assert remote.workers.remote is not None and own.workers.remote is None
                for i in range(20, 40):
                    for p, name in enumerate(POOLS):
                        cache_prompt(core, name, _prompt(p, i))
                for gw in (own, remote):
                    wait_until(lambda: _caught_up(gw, core), 20, "every batch applied")
                assert _state(remote) == _state(own)
                device = _state(remote)["fa"][2][0]
                assert 200 < len(device) <= 256  # evictions happened, and were applied
                assert remote.workers.remote.restarts == 0
        finally:
            for w in workers:
                w.stop()


def test_a_killed_feed_process_is_replaced_and_every_feed_resumes_where_the_index_is():
    core = CacheCore()
    cache = BreakableCache(core, grpc.StatusCode.UNAVAILABLE)  # records what it was asked
    workers = [FakeWorker(n) for n in POOLS]
    for w in workers:
        register_pool(core, w.name)
    addresses = [WorkerAddress(w.address, cache.address) for w in workers]
    try:
        with running_gateway(lambda: addresses, worker=settings(feed_process=True)) as gw:
            for p, name in enumerate(POOLS):
                cache_prompt(core, name, _prompt(p, 0))
            wait_until(lambda: _caught_up(gw, core), 20, "first batches applied")
            before = _heads(core)
            cache.open.clear()  # the new feed process's subscriptions wait
            os.kill(gw.workers.remote.pid, signal.SIGKILL)
            wait_until(lambda: len(cache.requests) == 2 * len(POOLS), 20, "resubscribed")
            for p, name in enumerate(POOLS):  # published while the streams were down
                cache_prompt(core, name, _prompt(p, 1))
            cache.open.set()
            wait_until(lambda: _caught_up(gw, core), 30, "later batches applied")
            assert gw.workers.remote.restarts == 1
            assert sample(gw, "prefixcache_gateway_feed_process_restarts_total") == 1
            # Each resubscription asked for what came after the index's last batch, and was
            # replayed that, not sent a snapshot.
            resumed = sorted(cache.requests[len(POOLS):])
            assert resumed == sorted((1, before[n]) for n in POOLS)
            assert not any(snap for sent in cache.sent[len(POOLS):] for _, snap in sent)
            state = _state(gw)
            for name in POOLS:
                assert len(state[name][2][0]) == 20  # both prompts' pages
            wait_until(lambda: all(gw.router.get(n).streaming for n in POOLS), 10,
                       "streaming again")
    finally:
        for w in workers:
            w.stop()
        cache.server.stop(0)


def test_the_gateway_flag_runs_the_streams_in_a_feed_process():
    args = ["--workers", "localhost:1", "--allow-anonymous"]
    default = config_from_args(parse_args(args))
    on = config_from_args(parse_args([*args, "--feed-process"]))
    assert not default.worker.feed_process and on.worker.feed_process
    router = Router(make_policy("affinity"), GatewayMetrics())
    workers = WorkerSet(lambda: [], router, Fleet(None, None), on.worker)
    try:
        # The applier's queue is the feed process's bound, and a process is running.
        assert workers.remote is not None and workers.feeds.applier.max_pending == MAX_QUEUED_ITEMS
        wait_until(lambda: workers.remote.pid is not None, 10, "feed process started")
    finally:
        workers.close()
    assert not _alive(workers.remote.pid), "the feed process outlived the gateway's feeds"


def test_a_large_fleet_read_in_the_gateways_own_process_is_advised_the_feed_process_once(
        monkeypatch, caplog):
    """Past FEED_PROCESS_ADVISED_WORKERS workers (2 here) without --feed-process, one warning
    names the flag; a fleet that grows further is not told again."""
    monkeypatch.setattr(workers_module, "FEED_PROCESS_ADVISED_WORKERS", 2)
    addresses = [WorkerAddress(f"127.0.0.1:{port}", f"127.0.0.1:{port}") for port in (1, 2, 3)]
    shown = addresses[:1]
    workers = WorkerSet(lambda: shown, Router(make_policy("affinity"), GatewayMetrics()),
                        Fleet(None, None), settings())  # the gateway's own feeds

    def advised() -> list[str]:
        return [r.getMessage() for r in caplog.records if "feed_process_advised" in r.getMessage()]

    try:
        with caplog.at_level(logging.WARNING, logger="gateway.workers"):
            workers.refresh()
            assert advised() == []  # one worker: nothing to advise
            shown = addresses[:2]
            workers.refresh()
            assert len(advised()) == 1 and "workers=2" in advised()[0]
            assert "--feed-process" in advised()[0]
            shown = addresses
            workers.refresh()
            assert len(advised()) == 1
    finally:
        workers.close()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_feed_process_that_cannot_start_is_retried_after_the_backoff_not_the_timeout(
        monkeypatch, caplog):
    """One that exits before it connects (its imports failing, say) is seen at once and started
    again after the backoff, with its exit code logged; not after CONNECT_TIMEOUT_S (60 s)."""
    monkeypatch.setattr(feed_process, "_MAIN", "import sys; sys.exit(3)")
    router = Router(make_policy("affinity"), GatewayMetrics())
    loop = FeedLoop(router)
    remote = FeedProcess(loop.applier, router.resume_point)
    try:
        with caplog.at_level(logging.WARNING, logger="gateway.feed_process"):
            loop.submit(remote.run())
            wait_until(lambda: remote.restarts >= 2, 10, "two failed starts")
        assert "exited (3) before it connected" in caplog.text
    finally:
        loop.close()


def test_the_streams_start_a_batch_of_follows_at_a_time(monkeypatch, tmp_path):
    """A restart's follows come all at once (1,000). Read back to back, every channel opened
    before any stream ran (the first frame 0.6 s after the feed process connected); after each
    one, the opening of channels interleaved with framing the first streams. The streams opened
    so far start every FOLLOWS_A_TURN follows."""
    order: list[tuple[str, int]] = []

    class Channel:
        async def close(self) -> None:
            pass

    def channel(address, options, tls):
        order.append(("channel", int(address)))
        return Channel()

    async def follow_events(sender, stub, feed, settings, watchdog):
        order.append(("stream", int(feed.name)))
        await asyncio.Event().wait()

    monkeypatch.setattr(feed_process, "aio_channel", channel)
    monkeypatch.setattr(feed_process, "follow_events", follow_events)
    monkeypatch.setattr(feed_process.cpb_grpc, "CacheServiceStub", lambda ch: None)
    batch, n = feed_process.FOLLOWS_A_TURN, 2 * feed_process.FOLLOWS_A_TURN + 5

    async def gateway_side() -> None:
        path = str(tmp_path / "feeds.sock")
        connected: asyncio.Queue = asyncio.Queue()
        server = await asyncio.start_unix_server(lambda r, w: connected.put_nowait((r, w)), path)
        child = asyncio.create_task(feed_process._serve(path, 64))
        _, writer = await connected.get()
        settings = StreamSettings(1.0, WORKER_RETRY)
        for i in range(n):  # one write: all buffered when the child reads the first
            target = feed_process.StreamTarget(str(i), settings)
            feed_process.write_message(writer, feed_process.CONTROL,
                                       pickle.dumps(("follow", str(i), target, (0, -1))))
        await writer.drain()
        for _ in range(300):
            await asyncio.sleep(0.01)
            if len(order) == 2 * n or child.done():
                break
        writer.close()
        child.cancel()
        server.close()

    asyncio.run(gateway_side())
    assert sorted(order) == sorted([("channel", i) for i in range(n)] +
                                   [("stream", i) for i in range(n)])
    first_stream = order.index(("stream", 0))
    # a batch of channels, then their streams, before the next batch's channels
    assert order[:batch] == [("channel", i) for i in range(batch)]
    assert first_stream == batch
    assert order.index(("channel", batch)) < order.index(("stream", batch))
    assert all(order.index(("stream", i)) < order.index(("channel", 2 * batch))
               for i in range(batch))
