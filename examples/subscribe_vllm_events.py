"""Follow the cache service's KV events in vLLM's format (ZMQ + msgpack), as a router would.

    .venv/bin/python examples/subscribe_vllm_events.py --endpoint tcp://localhost:5557 \\
        --replay tcp://localhost:5558 [--topic kv@worker-0@] [--max-batches N]

The cache service must run with --kv-events-zmq-endpoint (and --kv-events-zmq-replay-endpoint
for --replay); docs/kv-events.md describes the wire. This subscriber needs only pyzmq and
msgspec, reads both encodings (maps and positional arrays), keeps one index per topic (a pool),
and when a batch's seq skips ahead it asks the replay socket for the missed batches before
going on. `VllmSubscriber` is what tests/cache_service/test_vllm_events_loopback.py drives.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import msgspec
import zmq

END_SEQ = -1
# BlockStored / BlockRemoved fields in vLLM 0.33's order (positional in the array encoding).
STORED = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
          "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind")
REMOVED = ("block_hashes", "medium", "group_idx")


def as_fields(event) -> tuple[str, dict]:
    """(type, fields) of one event in either encoding."""
    if isinstance(event, dict):
        return event["type"], event
    kind, *values = event
    names = STORED if kind == "BlockStored" else REMOVED if kind == "BlockRemoved" else ()
    return kind, dict(zip(names, values))


@dataclass
class TopicIndex:
    """One pool's blocks: (group_idx, medium, block hash) per cached block. Group 0 holds the
    attention pages; on hybrid pools group 1 ("mamba") holds the pages with a checkpoint."""
    blocks: set[tuple[int, str, int]] = field(default_factory=set)
    last_seq: int = -1
    replayed_to: int = -1  # live batches up to this seq were applied from a replay
    batches: int = 0
    events: int = 0  # block events (hashes in BlockStored/BlockRemoved), clears count one

    def apply(self, seq: int, payload: bytes) -> None:
        ts, events, *_ = msgspec.msgpack.decode(payload)
        for event in events:
            kind, f = as_fields(event)
            if kind == "AllBlocksCleared":
                self.blocks.clear()
                self.events += 1
                continue
            group, medium = f.get("group_idx") or 0, f.get("medium") or "GPU"
            keys = {(group, medium, h) for h in f["block_hashes"]}
            if kind == "BlockStored":
                self.blocks |= keys
            elif kind == "BlockRemoved":
                self.blocks -= keys
            self.events += len(keys)
        self.last_seq = seq
        self.batches += 1


class VllmSubscriber:
    """A SUB socket on `endpoint` (topics starting with `topic`) and, for gaps, a DEALER on the
    replay ROUTER at `replay_endpoint`."""

    def __init__(self, endpoint: str, replay_endpoint: str = "", topic: bytes = b"",
                 ctx: zmq.Context | None = None):
        self.ctx = ctx or zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.indexes: dict[bytes, TopicIndex] = {}
        self.replayed = 0  # batches applied from replays
        self.gaps = 0

    def close(self) -> None:
        self.sub.close(linger=0)

    def poll(self, timeout_ms: int = 1000) -> bool:
        """Receives and applies one message; False when none came within `timeout_ms`."""
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        self.receive(topic, int.from_bytes(seq_bytes, "big"), payload)
        return True

    def receive(self, topic: bytes, seq: int, payload: bytes) -> None:
        index = self.indexes.setdefault(topic, TopicIndex())
        if seq <= index.replayed_to:
            return  # applied already, from a replay
        index.replayed_to = -1
        if seq == 0:
            pass  # a new epoch (the pool's worker restarted) starts over from AllBlocksCleared
        elif seq <= index.last_seq:
            # seq went back without a seq 0: a new epoch whose start this subscriber missed.
            self.gaps += 1
            index.last_seq = -1
            self.replay(topic, 0)
        elif seq > index.last_seq + 1:  # a gap (or joining mid-stream): fetch what is missing
            self.gaps += 1
            self.replay(topic, index.last_seq + 1)
        if seq <= index.replayed_to:
            return
        index.apply(seq, payload)

    def replay(self, topic: bytes, start_seq: int) -> None:
        """Asks for `topic`'s batches from `start_seq` on and applies them (the 4-frame request;
        vLLM's 3-frame one, without the topic, replays every pool)."""
        if not self.replay_endpoint:
            return  # no replay socket: the gap stays (a router would re-learn the pool)
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", topic, start_seq.to_bytes(8, "big")))
            while True:
                if not dealer.poll(10_000):
                    raise TimeoutError(f"no replay answer from {self.replay_endpoint}")
                _, got_topic, seq_bytes, payload = dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    return
                index = self.indexes.setdefault(got_topic, TopicIndex())
                if seq > index.last_seq:
                    index.apply(seq, payload)
                    index.replayed_to = seq
                    self.replayed += 1
        finally:
            dealer.close(linger=0)


def namespace_of(f: dict) -> str:
    """The opaque id a salted namespace's root run carries on its first block; "plain" for an
    unsalted root, "(parent's)" for a run that continues its parent."""
    keys = f.get("extra_keys")
    if keys and keys[0]:
        return keys[0][-1]
    return "plain" if f["parent_block_hash"] is None else "(parent's)"


def describe(topic: bytes, seq: int, payload: bytes) -> list[str]:
    ts, events, *_ = msgspec.msgpack.decode(payload)
    lines = []
    for event in events:
        kind, f = as_fields(event)
        if kind == "BlockStored":
            parent = f["parent_block_hash"]
            lines.append(f"{topic.decode()} seq {seq}: stored {len(f['block_hashes'])} blocks on "
                         f"{f['medium']} (group {f.get('group_idx')}, "
                         f"{f.get('kv_cache_spec_kind')}) parent "
                         f"{'root' if parent is None else format(parent, '016x')}, "
                         f"lora {f['lora_name']!r}, namespace {namespace_of(f)}")
        elif kind == "BlockRemoved":
            lines.append(f"{topic.decode()} seq {seq}: removed {len(f['block_hashes'])} blocks "
                         f"from {f['medium']} (group {f.get('group_idx')})")
        else:
            lines.append(f"{topic.decode()} seq {seq}: all blocks cleared")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--endpoint", default="tcp://localhost:5557", help="the PUB endpoint")
    parser.add_argument("--replay", default="", help="the replay ROUTER endpoint (optional)")
    parser.add_argument("--topic", default="", help="topic prefix to follow (default: all)")
    parser.add_argument("--max-batches", type=int, default=0, help="stop after N (0 = never)")
    args = parser.parse_args()
    sub = VllmSubscriber(args.endpoint, args.replay, args.topic.encode())
    seen = 0
    try:
        while not args.max_batches or seen < args.max_batches:
            if not sub.sub.poll(1000):
                continue
            topic, seq_bytes, payload = sub.sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            print("\n".join(describe(topic, seq, payload)), flush=True)
            sub.receive(topic, seq, payload)
            index = sub.indexes[topic]
            print(f"  index: {len(index.blocks)} blocks, head seq {index.last_seq}", flush=True)
            seen += 1
    finally:
        sub.close()


if __name__ == "__main__":
    main()
