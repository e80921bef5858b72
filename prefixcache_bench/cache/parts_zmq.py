"""Part `zmq`: the vLLM-format KV event stream (cache_service/zmq_publisher.py).

- Page events per second delivered over ZMQ to a SUB consumer while a gRPC subscriber follows
  the same pool (the `events` part's workload, on a server with the ZMQ stream on), beside the
  gRPC subscriber's figure in the same run; events lost (after asking the replay socket for any
  gap) and the consumer's index against the tree.
- step_rpc_32 with the ZMQ stream off and on (a SUB consumer attached), alternating on fresh
  servers of the same kind: the stream must not slow the Step path.
"""
from __future__ import annotations

import statistics
import threading
import time

import msgspec
import zmq

from prefixcache_bench.cache.params import Params
from prefixcache_bench.cache.parts_events import (_evictions, _wait, follow_events,
                                              produce_events, snapshot_pages)
from prefixcache_bench.cache.parts_step import bench_step_rpc
from prefixcache_bench.cache.serving import ServerHandle, cache_server
from prefixcache.v1 import common_pb2
from prefixcache_bench.harness import log
from prefixcache_client.cache import CacheClient

MEDIUM = {common_pb2.MEDIUM_DEVICE: "GPU", common_pb2.MEDIUM_HOST: "CPU"}
END_SEQ = (-1).to_bytes(8, "big", signed=True)
ROUNDS = 2  # of the step measurement, ZMQ off and on alternating


class ZmqIndex:
    """A SUB consumer of one topic: the stream applied to a set of (medium, u64 hash)."""

    def __init__(self, endpoint: str, topic: bytes, apply: bool = True):
        """`apply=False`: receive and drop (the step measurement, where this process's
        interpreter lock belongs to the client timing its Steps)."""
        self.applies = apply
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.RCVHWM, 0)  # the consumer, not its socket, is what is measured
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.topic = topic
        self.decode = msgspec.msgpack.Decoder().decode
        self.pages: set[tuple[str, int]] = set()
        self.received = 0  # page events of live batches
        self.recovered = 0  # page events of batches fetched by replay
        self.missing: list[int] = []  # seqs skipped on the live stream
        self.last_seq = -1
        self.last_at = 0.0
        self.batches = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def apply(self, payload: bytes) -> int:
        events = self.decode(payload)[1]
        n = 0
        for ev in events:
            kind = ev["type"]
            if kind == "AllBlocksCleared":
                self.pages.clear()
                continue
            if ev.get("group_idx"):
                continue  # Mamba group: none in this (attention-only) pool
            keys = [(ev["medium"], h) for h in ev["block_hashes"]]
            if kind == "BlockStored":
                self.pages.update(keys)
            else:
                self.pages.difference_update(keys)
            n += len(keys)
        return n

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                if not self.sub.poll(50):
                    continue
                _, seq_bytes, payload = self.sub.recv_multipart()
                if not self.applies:
                    self.batches += 1
                    continue
                seq = int.from_bytes(seq_bytes, "big")
                if seq > self.last_seq + 1:
                    self.missing += range(self.last_seq + 1, seq)
                self.received += self.apply(payload)
                self.last_seq = seq
                self.batches += 1
                self.last_at = time.perf_counter()
        except BaseException as exc:  # reported in the results
            self.error = exc

    def replay(self, endpoint: str) -> int:
        """Fetches the skipped seqs from the replay ROUTER; returns the batches it got."""
        if not self.missing:
            return 0
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(endpoint)
        wanted, got = set(self.missing), 0
        dealer.send_multipart((b"", self.topic, min(wanted).to_bytes(8, "big")))
        while dealer.poll(10_000):
            _, _, seq_bytes, payload = dealer.recv_multipart()
            if seq_bytes == END_SEQ:
                break
            seq = int.from_bytes(seq_bytes, "big")
            if seq in wanted:  # only the content of the lost batches counts (page sets are
                # idempotent: re-applying the later ones in order restores the final set)
                self.recovered += self.apply(payload)
                got += 1
            else:
                self.apply(payload)
        dealer.close(linger=0)
        return got

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()


def bench_zmq(p: Params) -> dict:
    out: dict = {}
    with cache_server(p.server, kv_events=True) as server:
        log(f"[zmq] events server={p.server} {server.target} {server.kv_endpoint}")
        out.update(_events(p, server))
    # Step latency, ZMQ off and on alternating (ROUNDS each, every one on a fresh server of the
    # same kind), so that drift on a shared machine does not favour either: medians of the p50s.
    runs: dict[str, list[dict]] = {"off": [], "on": []}
    for round_ in range(ROUNDS):
        for label, on in (("off", False), ("on", True)):
            with cache_server(p.server, kv_events=on) as server:
                log(f"[zmq] step_rpc_32 with the ZMQ stream {label} (round {round_ + 1})")
                runs[label].append(_step_with_consumer(p, server, on))
    for label, results in runs.items():
        for key in ("step_rpc_32_ms_p50", "step_rpc_32_ms_p99", "step_rpc_32_mixed_ms_p50",
                    "step_rpc_32_mixed_server_cpu_ms"):
            values = [r[key] for r in results if r[key] is not None]  # None: CPU not read
            out[f"zmq_{label}_{key}"] = statistics.median(values) if values else None
    out["zmq_on_step_batches_received"] = min(r["batches"] for r in runs["on"])
    out["zmq_step_rpc_32_p50_ratio"] = round(
        out["zmq_on_step_rpc_32_ms_p50"] / out["zmq_off_step_rpc_32_ms_p50"], 3)
    out["zmq_step_rounds"] = ROUNDS
    return out


def _step_with_consumer(p: Params, server: ServerHandle, on: bool) -> dict:
    """bench_step_rpc on `server`, with a SUB consumer attached when the ZMQ stream is on."""
    consumer = ZmqIndex(server.kv_endpoint, b"", apply=False) if on else None
    drain = None
    if consumer is not None:
        drain = threading.Thread(target=consumer.run, daemon=True)
        drain.start()
    try:
        step = bench_step_rpc(p, server)
    finally:
        if consumer is not None:
            consumer.stop.set()
            drain.join(5)
            consumer.close()
    step["batches"] = consumer.batches if consumer is not None else 0
    return step


def _events(p: Params, server: ServerHandle) -> dict:
    """The `events` part's workload with both a gRPC subscriber and a ZMQ consumer."""
    zmq_index = ZmqIndex(server.kv_endpoint, b"kv@events@")
    zmq_thread = threading.Thread(target=zmq_index.run, daemon=True)
    zmq_thread.start()
    time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the publisher
    with CacheClient(server.target, timeout_s=30) as client:
        index, sub, consumer = follow_events(p, client)
        inserted, start, produced_s = produce_events(p, client, "zmq events")
        head = next(pool.head_seq for pool in client.list_pools().pools
                    if pool.pool_id == "events")
        _wait(lambda: index.last_seq >= head or index.error is not None, 60,
              f"the gRPC subscriber to reach seq {head}")
        try:
            _wait(lambda: zmq_index.last_seq >= head or zmq_index.error is not None, 60,
                  f"the ZMQ consumer to reach seq {head}")
        except TimeoutError:
            pass  # the tail was lost: the replay below fetches it, and it is counted
        zmq_index.stop.set()
        zmq_thread.join(5)
        if zmq_index.last_seq < head:
            zmq_index.missing += range(zmq_index.last_seq + 1, head + 1)
        replayed = zmq_index.replay(server.kv_replay_endpoint)
        sub.close()
        consumer.join(10)
        generated = inserted + _evictions(client, "events")
        tree = snapshot_pages(client, "events")
    zmq_index.close()
    tree_u64 = {(MEDIUM[m], int.from_bytes(h[8:], "big")) for m, h in tree}
    grpc_s = index.last_at - start
    zmq_s = zmq_index.last_at - start
    return {
        "zmq_events_per_s": round(zmq_index.received / zmq_s) if zmq_s > 0 else 0,
        "zmq_grpc_events_per_s": round(index.received / grpc_s) if grpc_s > 0 else 0,
        "zmq_events_generated": generated,
        "zmq_events_received": zmq_index.received,
        "zmq_events_lost": generated - zmq_index.received,
        "zmq_events_recovered_by_replay": zmq_index.recovered,
        "zmq_events_lost_after_replay": generated - zmq_index.received - zmq_index.recovered,
        "zmq_grpc_events_lost": generated - index.received,
        "zmq_seq_gaps": len(zmq_index.missing),
        "zmq_replayed_batches": replayed,
        "zmq_index_mismatch": len(zmq_index.pages ^ tree_u64),
        "zmq_batches": head,
        "zmq_produce_s": round(produced_s, 3),
        "zmq_deliver_s": round(zmq_s, 3),
        "zmq_consumer_error": None if zmq_index.error is None else repr(zmq_index.error),
    }
