"""The vLLM-format stream end to end: a real cache service over loopback gRPC with its ZMQ
publisher, a gRPC subscriber and a ZMQ SUB consumer (examples/subscribe_vllm_events.py) that
loses batches and gets them back from the replay ROUTER. The consumer's index, the tree and the
gRPC subscriber's index must be the same set of pages; and with the publisher's queue full,
batches are dropped and counted, Step never waits, and replay recovers every one of them."""
from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import threading
import time

import prometheus_client
import zmq

from prefixcache_bench.cache.parts_events import EventIndex
from cache_service.core import CacheCore
from cache_service.tree import NO_SLOT, nodes_below
from cache_service.zmq_publisher import ZmqEventPublisher, ZmqEventsConfig
from prefixcache.v1 import common_pb2
from prefixcache_client.cache import CacheClient
from cache_service.server import CacheServer, ServerConfig
from tests.cache_service.grpc_harness import server_process
from tests.cache_service.test_vllm_events_conformance import wait_subscribed
from tests.cache_service.vllm_events_workload import register, run_workload

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "subscribe_vllm_events.py"
MEDIUM = {common_pb2.MEDIUM_DEVICE: "GPU", common_pb2.MEDIUM_HOST: "CPU"}


def example():
    spec = importlib.util.spec_from_file_location("subscribe_vllm_events", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def u64(page_hash: bytes) -> int:
    return int.from_bytes(page_hash[8:], "big")


def tree_blocks(core: CacheCore, pool_id: str) -> set[tuple[int, str, int]]:
    """(group, medium, u64 hash) of every cached page and (group 1) every checkpointed one."""
    with core._lock:
        pool = core._pools[pool_id]
        out = set()
        for root in pool.roots.values():
            for node in nodes_below(root):
                out |= {(0, MEDIUM[node.medium], u64(node.hashes[i:i + 16]))
                        for i in range(0, len(node.hashes), 16)}
        out |= {(1, "GPU", u64(h)) for node, h in pool.checkpointed.items()
                if node.slot != NO_SLOT and h}
        return out


def grpc_blocks(index: EventIndex) -> set[tuple[int, str, int]]:
    return {(0, MEDIUM[m], u64(h)) for m, h in index.pages}


def _consume(sub, index: EventIndex) -> None:
    try:
        for item in sub:
            if item.WhichOneof("item") == "batch":
                index.apply(item.batch)
    except BaseException as exc:  # checked by the test
        index.error = exc


class LossySubscriber:
    """The example's subscriber, made to lose the batches of `topic` whose seq is in `lost`."""

    def __init__(self, sub, topic: bytes, lost: range):
        self.sub, self.topic, self.lost, self.dropped = sub, topic, lost, 0

    def poll(self, timeout_ms: int) -> bool:
        if not self.sub.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if topic == self.topic and seq in self.lost and not self.dropped_all(seq):
            self.dropped += 1
            return True
        self.sub.receive(topic, seq, payload)
        return True

    def dropped_all(self, seq: int) -> bool:
        return self.dropped >= len(self.lost)


def wait_for(check, timeout_s: float, what: str, pump=None) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        if pump is None or not pump(50):
            time.sleep(0.01)


def test_zmq_consumer_with_a_forced_gap_rebuilds_the_tree_and_the_grpc_index():
    ex = example()
    core = CacheCore()
    pub = ZmqEventPublisher(core, ZmqEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    server = CacheServer(core, ServerConfig(host="127.0.0.1", port=0, grace_s=0.0), pub).start()
    try:
        consumer = ex.VllmSubscriber(pub.endpoint, pub.replay_endpoint, b"kv@")
        lossy = LossySubscriber(consumer, b"kv@hyb@m", range(5, 12))
        time.sleep(0.3)  # ZMQ's slow joiner
        with CacheClient(f"127.0.0.1:{server.port}", timeout_s=30) as client:
            client.register_pool(register("hyb"))
            index = EventIndex()
            stream = client.subscribe("hyb", heartbeat_interval_s=0.1)
            reader = threading.Thread(target=_consume, args=(stream, index), daemon=True)
            reader.start()
            wait_for(lambda: index.snapshots >= 1, 10, "the gRPC snapshot")
            done = threading.Event()
            work = threading.Thread(target=lambda: (run_workload(
                client.step, client.evict_namespace, client.register_pool, "hyb"), done.set()))
            work.start()
            wait_for(done.is_set, 60, "the workload", pump=lossy.poll)
            work.join()
            tree = tree_blocks(core, "hyb")
            zmq_index = consumer.indexes[b"kv@hyb@m"]
            wait_for(lambda: zmq_index.blocks == tree, 10, "the ZMQ index", pump=lossy.poll)
            wait_for(lambda: grpc_blocks(index) == {b for b in tree if b[0] == 0}, 10,
                     "the gRPC index")
            stream.close()
            reader.join(5)
        assert index.error is None or "CANCELLED" in repr(index.error), index.error
        assert lossy.dropped == 7 and consumer.gaps >= 1 and consumer.replayed >= 7
        assert pub.dropped_batches == 0 and pub.replays >= 1
        metrics = prometheus_client.generate_latest(server.metrics.registry).decode()
        assert 'prefixcache_cache_kv_events_zmq_batches_total{state="dropped"} 0.0' in metrics
        assert f'prefixcache_cache_kv_events_zmq_batches_total{{state="published"}} ' \
               f'{float(pub.published_batches)}' in metrics
        assert {b[0] for b in tree} == {0, 1}  # both groups: attention pages and checkpoints
        consumer.close()
    finally:
        server.drain()  # closes the publisher too


def test_a_full_queue_drops_and_counts_without_blocking_step_and_replay_recovers():
    ex = example()
    core = CacheCore()
    pub = ZmqEventPublisher(core, ZmqEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                                                  max_queue_batches=3))
    consumer = ex.VllmSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        wait_subscribed(pub, consumer.sub)
        # The publisher thread is not running yet: nothing leaves the queue, which holds 3.
        start = time.perf_counter()
        run_workload(core.step, core.evict_namespace, core.register_pool, "hyb", rounds=1,
                     new_epoch=False)  # seq restarts in a new epoch: docs/kv-events.md
        elapsed = time.perf_counter() - start
        head = core._pools["hyb"].log.head_seq
        assert pub.dropped_batches > 0 and pub.dropped_pages > 0
        assert elapsed < 30  # Step never waited on ZMQ (the queue never blocks)
        pub.start()
        # The 3 queued batches are the first ones; the rest were dropped.
        topic = b"kv@hyb@m"
        wait_for(lambda: topic in consumer.indexes, 10, "the first batches", pump=consumer.poll)
        # The consumer asks for what it lacks from its last seq on (as after any gap).
        consumer.replay(topic, consumer.indexes[topic].last_seq + 1)
        tree = tree_blocks(core, "hyb")
        wait_for(lambda: consumer.indexes[topic].blocks == tree, 10, "the replayed index",
                 pump=consumer.poll)
        assert consumer.indexes[topic].last_seq == head
    finally:
        consumer.close()
        pub.close()


def test_a_replay_older_than_the_buffer_is_answered_with_a_snapshot():
    ex = example()
    core = CacheCore(replay_events=8)  # a tiny replay buffer: seq 0 is long gone
    pub = ZmqEventPublisher(core, ZmqEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    pub.start()
    consumer = ex.VllmSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        run_workload(core.step, core.evict_namespace, core.register_pool, "hyb", rounds=1)
        topic = b"kv@hyb@m"
        consumer.replay(topic, 1)
        assert consumer.indexes[topic].blocks == tree_blocks(core, "hyb")
        assert consumer.indexes[topic].last_seq == core._pools["hyb"].log.head_seq
    finally:
        consumer.close()
        pub.close()


def test_replay_without_a_topic_answers_every_pool_in_vllms_framing():
    core = CacheCore()
    pub = ZmqEventPublisher(core, ZmqEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    pub.start()
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    try:
        for pool in ("a", "b"):
            core.register_pool(register(pool))
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))  # vLLM's request
        frames = []
        while True:
            assert dealer.poll(5000)
            frames.append(dealer.recv_multipart())
            if frames[-1][1] == b"":
                break
        assert [f[1:3] for f in frames] == [[b"kv@a@m", bytes(8)], [b"kv@b@m", bytes(8)],
                                            [b"", (-1).to_bytes(8, "big", signed=True)]]
        assert frames[-1][3] == b"" and all(f[0] == b"" for f in frames)
    finally:
        dealer.close(linger=0)
        ctx.term()
        pub.close()


def test_the_cli_publishes_and_drains(tmp_path):
    """`python -m cache_service` with the PREFIXCACHE_KV_EVENTS_* variables: it prints the bound
    endpoints, publishes a registered pool's first batch, and exits 0 on SIGTERM."""
    key = tmp_path / "key"
    key.write_bytes(b"cli-test-namespace-key-0123456789")
    env = {"PREFIXCACHE_KV_EVENTS_ZMQ_ENDPOINT": "tcp://127.0.0.1:*",
           "PREFIXCACHE_KV_EVENTS_ZMQ_REPLAY_ENDPOINT": "tcp://127.0.0.1:*",
           "PREFIXCACHE_KV_EVENTS_NAMESPACE_KEY_FILE": str(key)}
    with server_process(0, env=env) as proc:
        words = proc.proc.stdout.readline().split()
        assert words[:3] == ["kv", "events", "on"] and words[4] == "replay", words
        ex = example()
        consumer = ex.VllmSubscriber(words[3], words[5])
        try:
            with CacheClient(proc.target, timeout_s=10) as client:
                epoch = 0
                while b"kv@cli@m" not in consumer.indexes:  # until the subscription is through
                    epoch += 1
                    assert epoch < 200, "no batch arrived"
                    client.register_pool(register("cli", epoch=epoch))  # a new epoch: a batch
                    consumer.poll(50)
            assert consumer.indexes[b"kv@cli@m"].batches >= 1
        finally:
            consumer.close()
        proc.terminate()
        assert proc.exit_code() == 0, proc.log()


def test_the_example_runs_as_a_program():
    core = CacheCore()
    pub = ZmqEventPublisher(core, ZmqEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*"))
    pub.start()
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), "--endpoint", pub.endpoint,
                             "--replay", pub.replay_endpoint, "--max-batches", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        round_ = 0
        while proc.poll() is None and round_ < 200:  # until it has printed 3 live batches
            round_ += 1
            core.register_pool(register("ex", epoch=round_))  # each a new epoch: a batch or two
            time.sleep(0.05)
        out = proc.communicate(timeout=10)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
        pub.close()
    assert proc.returncode == 0, out
    assert "kv@ex@m seq 0: all blocks cleared" in out and "index: 0 blocks" in out, out
