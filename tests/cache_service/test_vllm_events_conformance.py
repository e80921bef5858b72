"""Conformance of the vLLM-format KV event stream (cache_service/zmq_publisher.py) with vLLM's own
event classes: every batch the cache service publishes, in both encodings, decodes with
`msgspec.msgpack.Decoder(KVEventBatch)` of vLLM 0.33.0 (vendored verbatim in
tests/data/vllm_kv_events_v0_33_0.py) and equals, field by field, what the gRPC stream (the
reference) carried in the batch of the same seq."""
from __future__ import annotations

import hashlib
import hmac
import pathlib
import sys
import time
import types

import msgspec
import pytest
import zmq

from cache_service.core import CacheCore
from cache_service.events import CHECKPOINT_DROPPED, CHECKPOINTED
from cache_service.zmq_publisher import ZmqEventPublisher, ZmqEventsConfig
from prefixcache.v1 import common_pb2
from prefixcache_client.hash import chain_hashes, namespace_seed, token_bytes
from tests.cache_service.vllm_events_workload import MODEL, NAMESPACES, P, run_workload

VENDORED = pathlib.Path(__file__).resolve().parents[1] / "data" / "vllm_kv_events_v0_33_0.py"
KEY = b"conformance-test-namespace-key!!"
MEDIUM = {common_pb2.MEDIUM_DEVICE: "GPU", common_pb2.MEDIUM_HOST: "CPU"}


def vllm_classes(encoding: str) -> types.ModuleType:
    """vLLM 0.33's classes; for "array", the same with `array_like=True` on KVCacheEvent, which
    is how vLLM releases before the map encoding declared it (positional events)."""
    source = VENDORED.read_text()
    if encoding == "array":
        header = "    tag=True,\n):"
        assert source.count(header) == 1, "the vendored KVCacheEvent header changed"
        source = source.replace(header, "    tag=True,\n    array_like=True,  # older vLLM\n):")
    module = types.ModuleType(f"vllm_kv_events_{encoding}")
    sys.modules[module.__name__] = module  # msgspec resolves the annotations through it
    exec(compile(source, str(VENDORED), "exec"), module.__dict__)
    return module


def namespace_id(adapter: str, salt: str) -> str:
    seed = namespace_seed(MODEL, adapter, salt)
    return hmac.new(KEY, seed, hashlib.sha256).digest()[:8].hex()


def u64(page_hash: bytes) -> int:
    """The documented mapping: the last 8 bytes of the 16-byte hash, big-endian."""
    return int.from_bytes(page_hash[8:], "big")


class Expect:
    """The vLLM events the gRPC batch of the same seq (plus the checkpoint records, which the
    gRPC stream does not carry) stands for, built independently of cache_service.vllm_events."""

    def __init__(self, v: types.ModuleType):
        self.v = v
        self.namespace_of: dict[bytes, tuple[str, str]] = {}  # page hash -> its namespace

    def _namespace(self, parent: bytes, hashes: list[bytes], tokens: list[int]):
        if parent:
            return self.namespace_of[parent]
        # At a root: the namespace whose seed chains to these hashes (exactly one).
        found = [ns for ns in NAMESPACES
                 if chain_hashes(namespace_seed(MODEL, *ns), token_bytes(tokens[:P]), P)[0]
                 == hashes[0]]
        assert len(found) == 1, found
        return found[0]

    def stored(self, hashes, parent, tokens, medium, group, kind):
        adapter, salt = ns = self._namespace(parent, hashes, tokens)
        for h in hashes:
            self.namespace_of[h] = ns
        # A salted namespace is named on the first block of a run at its root only, where vLLM
        # puts a cache salt; an unsalted one, with or without an adapter, has no extra keys.
        extra = ([(namespace_id(*ns),)] + [None] * (len(hashes) - 1)
                 if salt and not parent else None)
        return self.v.BlockStored(
            block_hashes=[u64(h) for h in hashes], parent_block_hash=u64(parent) if parent
            else None, token_ids=tokens, block_size=P, lora_id=None, medium=medium,
            lora_name=adapter or None, extra_keys=extra, group_idx=group,
            kv_cache_spec_kind=kind)

    def batch(self, grpc_batch, records, hybrid: bool) -> list:
        out = []
        pb_events = iter(grpc_batch.events)
        for record in records:
            if record[0] == CHECKPOINTED:  # [kind, page hash, parent, tokens, adapter, seed]
                tokens = list(memoryview(record[3]).cast("I"))
                out.append(self.stored([record[1]], record[2], tokens, "GPU", 1, "mamba"))
                continue
            if record[0] == CHECKPOINT_DROPPED:
                out.append(self.v.BlockRemoved(block_hashes=[u64(record[1])], medium="GPU",
                                               group_idx=1))
                continue
            ev = next(pb_events)
            kind = ev.WhichOneof("event")
            if kind == "stored":
                s = ev.stored
                out.append(self.stored(list(s.block_hashes), s.parent_block_hash,
                                       list(s.token_ids), MEDIUM[s.medium], 0, "full_attention"))
                assert s.block_size == P and s.model_id == MODEL
            elif kind == "removed":
                r = ev.removed
                out.append(self.v.BlockRemoved(block_hashes=[u64(h) for h in r.block_hashes],
                                               medium=MEDIUM[r.medium], group_idx=0))
            else:
                out.append(self.v.AllBlocksCleared())
        assert next(pb_events, None) is None, "a gRPC event has no vLLM counterpart"
        return out


def wait_subscribed(pub: ZmqEventPublisher, sub: zmq.Socket, timeout_s: float = 10.0) -> None:
    """Until `sub` (subscribed to everything) receives from `pub`, whose thread has not started:
    ZMQ drops what a PUB sends before a subscription reaches it (the slow joiner)."""
    deadline = time.monotonic() + timeout_s
    while not sub.poll(20):
        assert time.monotonic() < deadline, "the SUB socket never got a probe"
        pub._pub.send_multipart((b"probe", b"", b""))  # the test's thread owns it until start()
    while sub.poll(100):
        sub.recv_multipart()  # the probes


def check_raw_shape(payload: bytes, v: types.ModuleType, encoding: str) -> None:
    """No field the classes do not know (msgspec would skip it silently), tags first."""
    batch = msgspec.msgpack.decode(payload)
    assert isinstance(batch, list) and len(batch) == 3 and batch[2] == 0
    for event in batch[1]:
        if encoding == "map":
            assert isinstance(event, dict) and next(iter(event)) == "type"
            cls = getattr(v, event["type"])
            assert set(event) - {"type"} <= set(cls.__struct_fields__), event.keys()
        else:
            assert isinstance(event, list)
            cls = getattr(v, event[0])
            assert len(event) - 1 <= len(cls.__struct_fields__)


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_every_published_batch_decodes_with_vllms_classes(encoding):
    v = vllm_classes(encoding)
    decoder = msgspec.msgpack.Decoder(v.KVEventBatch)
    core = CacheCore()
    pub = ZmqEventPublisher(core, ZmqEventsConfig("tcp://127.0.0.1:*", encoding=encoding,
                                                  namespace_key=KEY))
    captured = []  # (topic, seq, gRPC batch, records, hybrid) in publishing order

    def capture(pool, entry):
        grpc_batch = pool.log.since(entry[0] - 1)[0]
        assert grpc_batch.seq == entry[0]
        captured.append((f"kv@{pool.cfg.pool_id}@{MODEL}".encode(), entry[0], grpc_batch,
                         entry[2], pool.cfg.mamba_slots > 0))

    core.event_sinks.append(capture)
    run_workload(core.step, core.evict_namespace, core.register_pool, "hyb")
    run_workload(core.step, core.evict_namespace, core.register_pool, "plain", rounds=1)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    wait_subscribed(pub, sub)  # the batches wait in the publisher's queue meanwhile
    pub.start()
    try:
        expect = Expect(v)
        kinds: set[tuple[str, int]] = set()
        for topic, seq, grpc_batch, records, hybrid in captured:
            assert sub.poll(5000), f"batch {topic!r} seq {seq} never arrived"
            got_topic, seq_bytes, payload = sub.recv_multipart()
            assert (got_topic, seq_bytes) == (topic, seq.to_bytes(8, "big"))
            check_raw_shape(payload, v, encoding)
            batch = decoder.decode(payload)
            assert batch.ts == grpc_batch.timestamp and batch.data_parallel_rank == 0
            assert batch.events == expect.batch(grpc_batch, records, hybrid), (topic, seq)
            kinds |= {(type(e).__name__, getattr(e, "group_idx", None) or 0)
                      for e in batch.events}
        assert not sub.poll(200), "a batch the gRPC stream does not have"
        assert kinds >= {("BlockStored", 0), ("BlockRemoved", 0), ("AllBlocksCleared", 0),
                         ("BlockStored", 1), ("BlockRemoved", 1)}
        media = {e.medium for _, _, b, _, _ in captured for e in
                 [x.stored for x in b.events if x.HasField("stored")]}
        assert media == {common_pb2.MEDIUM_DEVICE, common_pb2.MEDIUM_HOST}
        # The epoch change: the old epoch ends with AllBlocksCleared, the new one starts with it.
        hyb = [(seq, b) for t, seq, b, _, _ in captured if t == b"kv@hyb@m"]
        restart = next(i for i, (seq, _) in enumerate(hyb) if i and seq == 0)
        assert hyb[restart - 1][1].events[-1].HasField("cleared")
        assert [e.WhichOneof("event") for e in hyb[restart][1].events] == ["cleared"]
    finally:
        sub.close(linger=0)
        pub.close()
        ctx.term()
