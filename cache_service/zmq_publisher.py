"""Every pool's KV events on vLLM's wire: a ZMQ PUB socket and a replay ROUTER socket, matching
vLLM's `ZmqEventPublisher` (`vllm/distributed/kv_events.py`, 0.33.0) frame for frame.

- PUB: one multipart message per batch, `(topic, seq as 8 bytes big-endian, payload)`, where the
  topic names the pool and its model (`--kv-events-topic`, default `kv@{pool_id}@{model_id}`,
  the form llm-d's indexer parses), seq is the batch's seq on the gRPC stream (per pool, from 0
  in every epoch) and the payload is a msgpack KVEventBatch (cache_service/vllm_events.py).
- ROUTER (replay): a request `(b"", start seq as 8 bytes big-endian)` from a DEALER, vLLM's
  form, is answered with every pool's batches from that seq on, each as
  `(b"", topic, seq, payload)`, then the end marker `(b"", b"", seq -1, b"")`. The extension
  `(b"", topic, start seq)` replays that topic's pool only. Batches come from the pools' own
  replay buffers (events.EventLog); one the buffer no longer holds is answered with a snapshot
  of the pool (AllBlocksCleared, then every cached page) tagged with the pool's head seq.

The gRPC stream stays the reference: the core hands each batch's records to `offer` under its
lock, which only appends them to a bounded queue; this module's own thread encodes and sends.
A full queue drops the batch and counts it (as vLLM's publisher bounds its queue); a subscriber
sees the gap in seq and asks the ROUTER for it.
"""
from __future__ import annotations

import argparse
import logging
import queue
import threading
import time
from dataclasses import dataclass

import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cache_service.events import record_pages
from cache_service.vllm_events import ENCODINGS, VllmEncoder
from service_shell import add_flag, kv

log = logging.getLogger("cache_service.zmq_publisher")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
YIELD_S = 2e-5
_STOP = object()


@dataclass(slots=True)
class ZmqEventsConfig:
    # tcp://*:5557 binds; tcp://host:port connects (a proxy's XSUB), as in vLLM.
    endpoint: str
    # "" = no replay socket.
    replay_endpoint: str = ""
    encoding: str = "array"
    topic: str = "kv@{pool_id}@{model_id}"
    # Key of the namespace ids in extra_keys; b"" = a random key per process.
    namespace_key: bytes = b""
    # Batches waiting for the publisher thread; more are dropped (and counted).
    max_queue_batches: int = 100_000
    # ZMQ high-water mark of the PUB socket (messages per subscriber), vLLM's default.
    hwm: int = 100_000
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if not self.endpoint:
            raise ValueError("kv_events_zmq_endpoint: must not be empty")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv_events_encoding: must be one of {', '.join(ENCODINGS)}, "
                             f"got '{self.encoding}'")
        if self.max_queue_batches < 1:
            raise ValueError(f"kv_events_queue: must be >= 1, got {self.max_queue_batches}")
        try:
            self.topic.format(pool_id="p", model_id="m")
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"kv_events_topic: only {{pool_id}} and {{model_id}} may be "
                             f"substituted in '{self.topic}' ({exc!r})") from None


def _pause() -> None:
    """Encoding holds the interpreter lock, and a Step that needs it would wait until this
    thread ran out of work (CPython hands the lock over on request only after 5 ms). A short
    sleep every PAUSE_PAGES pages and after every batch lets it in: a Step waits for one
    slice of encoding, not for a whole batch."""
    time.sleep(YIELD_S)


def _binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard, ipc and inproc endpoints are bound, the rest connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """Publishes the batches of every pool of `core`; attach before the first pool registers."""

    def __init__(self, core, config: ZmqEventsConfig):
        self.core = core
        self.config = cfg = config
        self.encoder = VllmEncoder(cfg.encoding, cfg.namespace_key, cfg.data_parallel_rank)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._topics: dict[tuple[str, str], bytes] = {}
        # Counted by the publisher thread (sent) or under the core's lock (dropped).
        self.published_batches = self.published_pages = 0
        self.dropped_batches = self.dropped_pages = 0
        self.replays = 0
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self.endpoint = self._open(self._pub, cfg.endpoint)
        self._replay = None
        self.replay_endpoint = ""
        if cfg.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            # A replay is bounded by the replay buffer: queue all of it for a slow subscriber.
            self._replay.setsockopt(zmq.SNDHWM, 0)
            self._replay.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._open(self._replay, cfg.replay_endpoint, bind=True)
        self._thread = threading.Thread(target=self._run, name="kv-events-zmq", daemon=True)
        core.event_sinks.append(self.offer)

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: str, bind: bool = False) -> str:
        if bind or _binds(endpoint):
            sock.bind(endpoint)
            return sock.getsockopt_string(zmq.LAST_ENDPOINT)  # the real port of a :* or :0
        sock.connect(endpoint)
        return endpoint

    def start(self) -> ZmqEventPublisher:
        self._thread.start()
        log.info(kv("kv_events_zmq_started", endpoint=self.endpoint,
                    replay_endpoint=self.replay_endpoint, encoding=self.config.encoding))
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        """Sends what is queued (up to `timeout_s`), then closes the sockets."""
        if self.offer in self.core.event_sinks:
            self.core.event_sinks.remove(self.offer)
        if self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    # ---- the Step path: never blocks ------------------------------------------------------

    def offer(self, pool, entry: list) -> None:
        """Called by the core under its lock with a new batch's log entry."""
        if self._queue.qsize() >= self.config.max_queue_batches:
            self.dropped_batches += 1
            self.dropped_pages += entry[3]
            return
        self._queue.put((pool, entry[0], entry[1], entry[2]))

    # ---- the publisher thread -------------------------------------------------------------

    def topic(self, pool) -> bytes:
        key = (pool.cfg.pool_id, pool.cfg.model_id)
        topic = self._topics.get(key)
        if topic is None:
            topic = self._topics[key] = self.config.topic.format(
                pool_id=key[0], model_id=key[1]).encode()
        return topic

    def encode(self, pool, timestamp: float, records: list[list], pause=None) -> bytes:
        return self.encoder.batch(timestamp, records, pool.cfg.page_size, pool.cfg.mamba_slots > 0,
                                  pause, pool.cfg.model_id)

    def _run(self) -> None:
        get, send = self._queue.get, self._pub.send_multipart
        replay = self._replay
        while True:
            if replay is not None and replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:  # a bad request must not stop live publishing
                    log.exception(kv("kv_events_replay_failed"))
            try:
                item = get(timeout=0.05)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            pool, seq, timestamp, records = item
            try:
                send((self.topic(pool), seq.to_bytes(8, "big"),
                      self.encode(pool, timestamp, records, _pause)))
            except Exception:
                log.exception(kv("kv_events_publish_failed", pool=pool.cfg.pool_id, seq=seq))
                continue
            self.published_batches += 1
            for r in records:
                self.published_pages += record_pages(r)
            _pause()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        wanted = None
        if len(frames) == 3:  # vLLM's request: every pool
            client, _, start = frames
        elif len(frames) == 4:  # one topic's pool
            client, _, wanted, start = frames
        else:
            log.warning(kv("kv_events_replay_invalid", frames=len(frames)))
            return
        start_seq = int.from_bytes(start, "big", signed=True)
        self.replays += 1
        send = self._replay.send_multipart
        for pool_id in self.core.pool_ids():
            found = self.core.pool_records(pool_id, start_seq - 1)
            if found is None:
                continue
            pool, batches = found
            topic = self.topic(pool)
            if wanted is not None and topic != wanted:
                continue
            for seq, timestamp, records in batches:
                send((client, b"", topic, seq.to_bytes(8, "big"),
                      self.encode(pool, timestamp, records)))
        send((client, b"", b"", END_SEQ, b""))

    def collector(self) -> Collector:
        return _Metrics(self)


class _Metrics(Collector):
    def __init__(self, publisher: ZmqEventPublisher):
        self._p = publisher

    def collect(self):
        p = self._p
        batches = CounterMetricFamily("prefixcache_cache_kv_events_zmq_batches",
                                      "KV event batches on the vLLM-format ZMQ stream, published "
                                      "or dropped on a full queue.", labels=["state"])
        batches.add_metric(["published"], p.published_batches)
        batches.add_metric(["dropped"], p.dropped_batches)
        pages = CounterMetricFamily("prefixcache_cache_kv_events_zmq_pages",
                                    "Page events in those batches.", labels=["state"])
        pages.add_metric(["published"], p.published_pages)
        pages.add_metric(["dropped"], p.dropped_pages)
        replays = CounterMetricFamily("prefixcache_cache_kv_events_zmq_replays",
                                      "Replay requests answered on the ROUTER socket.")
        replays.add_metric([], p.replays)
        queued = GaugeMetricFamily("prefixcache_cache_kv_events_zmq_queued_batches",
                                   "Batches waiting for the publisher thread.")
        queued.add_metric([], p._queue.qsize())
        yield from (batches, pages, replays, queued)


# ---- flags (python -m cache_service) --------------------------------------------------------

def add_kv_events_flags(p: argparse.ArgumentParser) -> None:
    add_flag(p, "--kv-events-zmq-endpoint", "KV_EVENTS_ZMQ_ENDPOINT", "",
             "also publish every pool's KV events in vLLM's format on this ZMQ PUB endpoint, "
             "e.g. tcp://*:5557 (bound) or tcp://proxy:5557 (connected); empty = off")
    add_flag(p, "--kv-events-zmq-replay-endpoint", "KV_EVENTS_ZMQ_REPLAY_ENDPOINT", "",
             "ZMQ ROUTER endpoint answering replay requests from the replay buffer, e.g. "
             "tcp://*:5558; empty = none")
    add_flag(p, "--kv-events-encoding", "KV_EVENTS_ENCODING", "array",
             "events as positional arrays (what llm-d's indexer decodes) or msgpack maps "
             "(vLLM 0.33's own encoding)",
             choices=list(ENCODINGS))
    add_flag(p, "--kv-events-topic", "KV_EVENTS_TOPIC", "kv@{pool_id}@{model_id}",
             "ZMQ topic of a pool's batches; {pool_id} and {model_id} are substituted")
    add_flag(p, "--kv-events-namespace-key-file", "KV_EVENTS_NAMESPACE_KEY_FILE", "",
             "file holding the key (>= 16 bytes) of the opaque namespace ids put in extra_keys; "
             "empty = a random key per process (ids change on restart)")
    add_flag(p, "--kv-events-queue", "KV_EVENTS_QUEUE", 100_000,
             "batches waiting for the ZMQ publisher thread; beyond it batches are dropped "
             "(counted) and subscribers replay them", type=int)
    add_flag(p, "--kv-events-hwm", "KV_EVENTS_HWM", 100_000,
             "ZMQ high-water mark of the PUB socket", type=int)


def kv_events_from_args(p: argparse.ArgumentParser,
                        args: argparse.Namespace) -> ZmqEventsConfig | None:
    """The config the flags describe; None when --kv-events-zmq-endpoint is empty (off)."""
    if not args.kv_events_zmq_endpoint:
        if args.kv_events_zmq_replay_endpoint:
            p.error("--kv-events-zmq-replay-endpoint needs --kv-events-zmq-endpoint")
        return None
    key = b""
    path = args.kv_events_namespace_key_file
    if path:
        try:
            with open(path, "rb") as f:
                key = f.read().strip()
        except OSError as exc:
            p.error(f"--kv-events-namespace-key-file: cannot read '{path}': {exc.strerror}")
        if len(key) < 16:
            p.error(f"--kv-events-namespace-key-file: the key in '{path}' must be at least "
                    "16 bytes")
    try:
        return ZmqEventsConfig(args.kv_events_zmq_endpoint, args.kv_events_zmq_replay_endpoint,
                               args.kv_events_encoding, args.kv_events_topic, key,
                               args.kv_events_queue, args.kv_events_hwm)
    except ValueError as exc:
        p.error(f"--{str(exc).split(':')[0].replace('_', '-')}:{str(exc).split(':', 1)[1]}")
