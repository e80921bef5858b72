"""Tenants on the vLLM-format stream: no salt (nor a namespace seed, which is a hash of it) in any
published or replayed byte; each salted namespace named in extra_keys by an opaque id that is
stable under one key and differs per namespace; and the flags that configure the stream."""
from __future__ import annotations

import msgspec
import pytest
import zmq

from cache_service.__main__ import parse_args
from cache_service.core import CacheCore
from cache_service.zmq_publisher import ZmqEventPublisher, ZmqEventsConfig
from prefixcache_client.hash import namespace_seed
from tests.cache_service.test_vllm_events_conformance import wait_subscribed
from tests.cache_service.vllm_events_workload import MODEL, NAMESPACES, SALTS, run_workload


def published_frames(encoding: str, key: bytes) -> list[bytes]:
    """Every frame a workload publishes live, then a full replay of every pool."""
    core = CacheCore()
    pub = ZmqEventPublisher(core, ZmqEventsConfig("tcp://127.0.0.1:*", "tcp://127.0.0.1:*",
                                                  encoding=encoding, namespace_key=key))
    ctx = zmq.Context()
    sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    frames: list[bytes] = []
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub.endpoint)
        wait_subscribed(pub, sub)
        run_workload(core.step, core.evict_namespace, core.register_pool, "hyb", rounds=2)
        pub.start()
        while sub.poll(500):
            frames += sub.recv_multipart()
        dealer.connect(pub.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        while True:
            assert dealer.poll(5000)
            reply = dealer.recv_multipart()
            frames += reply
            if reply[1] == b"":
                break
        assert pub.published_batches > 10
        return frames
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        ctx.term()
        pub.close()


def namespace_ids(frames: list[bytes]) -> set[str]:
    ids = set()
    for frame in frames:
        try:
            batch = msgspec.msgpack.decode(frame)
        except msgspec.DecodeError:
            continue  # a topic or a seq frame
        if not isinstance(batch, list) or len(batch) != 3:
            continue
        for ev in batch[1]:
            keys = ev.get("extra_keys") if isinstance(ev, dict) else (
                ev[8] if ev[0] == "BlockStored" else None)
            ids |= {k[-1] for k in keys or () if k}
    return ids


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_no_salt_nor_seed_in_any_published_byte(encoding):
    frames = published_frames(encoding, b"k" * 32)
    blob = b"\x00".join(frames)
    for salt in SALTS:
        for form in (salt.encode(), salt.encode().hex().encode(), salt.encode("utf-16-le")):
            assert form not in blob, f"salt {salt!r} on the wire"
    for adapter, salt in NAMESPACES:
        seed = namespace_seed(MODEL, adapter, salt)
        assert seed not in blob and seed.hex().encode() not in blob
        assert seed[8:] not in blob  # nor as the u64 a hash would be sent as
    # One opaque id per salted namespace (an unsalted one publishes no extra keys).
    assert len(namespace_ids(frames)) == len(SALTS)


def test_namespace_ids_are_stable_under_a_key_and_change_with_it():
    one, again = namespace_ids(published_frames("map", b"a" * 32)), namespace_ids(
        published_frames("map", b"a" * 32))
    other = namespace_ids(published_frames("map", b"b" * 32))
    assert one == again and len(one) == len(SALTS)
    assert not one & other


def test_flags_and_environment(monkeypatch, tmp_path):
    assert parse_args([]).kv_events is None  # off by default
    key = tmp_path / "key"
    key.write_bytes(b"0123456789abcdef0123\n")
    monkeypatch.setenv("PREFIXCACHE_KV_EVENTS_ZMQ_ENDPOINT", "tcp://*:5557")
    monkeypatch.setenv("PREFIXCACHE_KV_EVENTS_ZMQ_REPLAY_ENDPOINT", "tcp://*:5558")
    monkeypatch.setenv("PREFIXCACHE_KV_EVENTS_ENCODING", "array")
    monkeypatch.setenv("PREFIXCACHE_KV_EVENTS_NAMESPACE_KEY_FILE", str(key))
    cfg = parse_args(["--kv-events-topic", "kv@{pool_id}"]).kv_events
    assert (cfg.endpoint, cfg.replay_endpoint, cfg.encoding, cfg.topic, cfg.namespace_key) == (
        "tcp://*:5557", "tcp://*:5558", "array", "kv@{pool_id}", b"0123456789abcdef0123")


@pytest.mark.parametrize("argv, message", [
    (["--kv-events-zmq-replay-endpoint", "tcp://*:1"], "needs --kv-events-zmq-endpoint"),
    (["--kv-events-zmq-endpoint", "tcp://*:1", "--kv-events-encoding", "json"],
     "--kv-events-encoding"),
    (["--kv-events-zmq-endpoint", "tcp://*:1", "--kv-events-namespace-key-file", "/nonexistent"],
     "--kv-events-namespace-key-file: cannot read"),
    (["--kv-events-zmq-endpoint", "tcp://*:1", "--kv-events-topic", "kv@{pod}"],
     "--kv-events-topic"),
    (["--kv-events-zmq-endpoint", "tcp://*:1", "--kv-events-queue", "0"], "--kv-events-queue"),
])
def test_bad_flags_name_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err
