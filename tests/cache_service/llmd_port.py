"""llm-d's KV-cache indexer, ported to Python for conformance tests: what llm-d computes from a
vLLM event stream and from a prompt, rule for rule.

Ported from https://github.com/llm-d/llm-d-kv-cache at 7be76e119ca50c5700b3bca65a19b6a0218a9b62
(Apache-2.0), the indexer llm-d's router runs:
- pkg/kvcache/kvblock/token_processor.go: a block key is FNV-64a over the canonical CBOR
  encoding of [parent key, block tokens, extra]; the chain of a prompt starts from
  hash(FNV-64a(hash seed), nil, model name); only full blocks get keys.
- pkg/kvcache/kvblock/extra_keys.go: `ParseRawExtraKeys` (a bare string in a block's extra keys
  is a multimodal hash; anything else is skipped) and `ComputeBlockExtraFeatures` (the
  multimodal items overlapping each block).
- pkg/kvevents/engineadapter/vllm_adapter.go + common.go: each event is decoded as a POSITIONAL
  array (a map-encoded event fails), the topic `kv@<pod>@<model>` names pod and model, hashes
  are u64 / i64 / the last 8 bytes of a byte string.
- pkg/kvevents/pool.go `processEventBatch`: the model of a BlockStored is its `lora_name` when
  set, else the topic's; the parent's request key comes from the engine-key map (an unknown
  parent drops the event); extra features are realigned to llm-d's block count.
- pkg/kvcache/kvblock/in_memory.go (Add / Evict / GetRequestKey) and kvblock_scorer.go
  (longest consecutive prefix, per pod).
Checked against llm-d's own golden vectors (tests/data/llm_d_kv_cache_7be76e1_vectors.json).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

import msgspec

FNV64_OFFSET, FNV64_PRIME, MASK64 = 0xCBF29CE484222325, 0x100000001B3, (1 << 64) - 1


class LlmdDecodeError(ValueError):
    """What llm-d logs as "Failed to parse message" / "failed to decode vLLM event": the whole
    batch is dropped (pool.go)."""


def fnv64a(data: bytes) -> int:
    h = FNV64_OFFSET
    for b in data:
        h = ((h ^ b) * FNV64_PRIME) & MASK64
    return h


def _head(major: int, n: int) -> bytes:
    if n < 24:
        return bytes([major << 5 | n])
    for info, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if n < 1 << (8 * struct.calcsize(fmt)):
            return bytes([major << 5 | info]) + struct.pack(fmt, n)
    raise ValueError(f"{n} does not fit CBOR")


def cbor(obj) -> bytes:
    """Canonical CBOR (RFC 7049 §3.9, fxamacker/cbor's CanonicalEncOptions) of the values the
    token processor hashes: unsigned ints, text, nil, arrays and string-keyed maps (a Go struct
    such as MMHash{Hash} encodes as the map {"Hash": ...})."""
    if obj is None:
        return b"\xf6"
    if isinstance(obj, bool):
        raise TypeError("booleans are not hashed by the token processor")
    if isinstance(obj, int):
        return _head(0, obj) if obj >= 0 else _head(1, -1 - obj)
    if isinstance(obj, str):
        raw = obj.encode()
        return _head(3, len(raw)) + raw
    if isinstance(obj, (list, tuple)):
        return _head(4, len(obj)) + b"".join(cbor(x) for x in obj)
    if isinstance(obj, dict):
        items = sorted((cbor(k), cbor(v)) for k, v in obj.items())
        items.sort(key=lambda kv: len(kv[0]))  # length first, then bytes (stable sort)
        return _head(5, len(items)) + b"".join(k + v for k, v in items)
    raise TypeError(f"cannot encode {type(obj).__name__}")


@dataclass
class TokenProcessor:
    """kvblock.chunkedTokenDatabase."""
    block_size: int = 16
    hash_seed: str = ""

    def hash(self, parent: int, tokens, extra) -> int:
        return fnv64a(cbor([parent, tokens, extra]))

    def init_hash(self, model: str) -> int:
        return self.hash(fnv64a(self.hash_seed.encode()), None, model)

    def keys(self, parent: int, tokens: list[int], model: str,
             extra: list[list[str] | None] | None = None) -> list[int]:
        """TokensToKVBlockKeys: `extra` is one entry per full block (multimodal hashes or None)."""
        chunks = [tokens[i:i + self.block_size]
                  for i in range(0, len(tokens) - self.block_size + 1, self.block_size)]
        if not chunks:
            return []
        extra = extra if extra is not None else [None] * len(chunks)
        if len(extra) != len(chunks):
            raise ValueError(f"extraFeatures length {len(extra)} does not match token chunk "
                             f"count {len(chunks)}")
        prefix = parent if parent else self.init_hash(model)
        out = []
        for chunk, mm in zip(chunks, extra):
            prefix = self.hash(prefix, chunk, None if mm is None else [{"Hash": h} for h in mm])
            out.append(prefix)
        return out


def parse_raw_extra_keys(raw: list | None) -> list[list[str] | None] | None:
    """ParseRawExtraKeys: per block, its bare strings (and [string, offset] pairs) are multimodal
    hashes; any other entry is skipped; a block without one is None."""
    if raw is None:
        return None
    out: list[list[str] | None] = []
    for block in raw:
        hashes = []
        for entry in block or ():
            if isinstance(entry, str):
                hashes.append(entry)
            elif isinstance(entry, list) and entry and isinstance(entry[0], str):
                hashes.append(entry[0])
        out.append(hashes or None)
    return out


def compute_block_extra_features(mm_hashes: dict[str, list[str]],
                                 placeholders: dict[str, list[tuple[int, int]]],
                                 block_size: int, num_tokens: int) -> list[list[str] | None] | None:
    """ComputeBlockExtraFeatures: (offset, length) placeholders per modality."""
    items = sorted((off, off + length, h) for modality, hashes in mm_hashes.items()
                   for h, (off, length) in zip(hashes, placeholders.get(modality, ())))
    if not items or block_size <= 0 or num_tokens <= 0:
        return None
    out = []
    for b in range(num_tokens // block_size):
        start, end = b * block_size, (b + 1) * block_size
        hit = [h for s, e, h in items if e > start and s < end]
        out.append(hit or None)
    return out


def realign(features, count: int):
    """pool.go realignExtraFeatures: engine blocks -> llm-d's block count."""
    n = len(features)
    if count == 0:
        return None
    if n == 0 or n == count:
        return features
    out: list = [None] * count
    if n < count:
        return [features[i * n // count] for i in range(count)]
    for i, f in enumerate(features):
        if f is not None:
            out[i * count // n] = (out[i * count // n] or []) + f
    return out


def _u64(raw) -> int:
    if isinstance(raw, int):
        return raw & MASK64
    if isinstance(raw, (bytes, bytearray)) and raw:
        return int.from_bytes(bytes(raw[-8:]).rjust(8, b"\0"), "big")
    raise LlmdDecodeError(f"unsupported hash type: {type(raw).__name__}")


def _at(fields: list, i: int):
    return fields[i] if i < len(fields) else None


def decode_event(raw) -> dict:
    """VLLMAdapter.decodeVLLMEvent + the converters: one event, positionally."""
    if not isinstance(raw, list):
        raise LlmdDecodeError(f"failed to decode tagged union: {type(raw).__name__} is not an array")
    if not raw or not isinstance(raw[0], str):
        raise LlmdDecodeError("malformed tagged union")
    tag = raw[0]
    if tag == "BlockStored":
        if len(raw) < 5:
            raise LlmdDecodeError(f"BlockStored: need at least 5 fields, got {len(raw)}")
        extra = _at(raw, 8)
        if extra is not None and not all(b is None or isinstance(b, list) for b in extra):
            raise LlmdDecodeError("extra_keys entry is neither an array nor nil")
        return {"type": tag, "block_hashes": [_u64(h) for h in raw[1]],
                "parent": 0 if raw[2] is None else _u64(raw[2]),
                "tokens": [int(t) & 0xFFFFFFFF for t in raw[3]], "block_size": int(raw[4]),
                "medium": _at(raw, 6), "lora_name": _at(raw, 7), "extra_keys": extra,
                "group_idx": _at(raw, 9), "kind": _at(raw, 10)}
    if tag == "BlockRemoved":
        if len(raw) < 2:
            raise LlmdDecodeError(f"BlockRemoved: need at least 2 fields, got {len(raw)}")
        return {"type": tag, "block_hashes": [_u64(h) for h in raw[1]], "medium": _at(raw, 2),
                "group_idx": _at(raw, 3)}
    if tag == "AllBlocksCleared":
        return {"type": tag}
    raise LlmdDecodeError(f"unknown vLLM event tag: {tag}")


def parse_message(topic: str, payload: bytes) -> tuple[str, str, list[dict]]:
    """VLLMAdapter.ParseMessage: (pod, model, events); any bad event drops the whole batch."""
    parts = topic.split("@")
    pod, model = (parts[1], parts[2]) if len(parts) == 3 else (topic, "")
    batch = msgspec.msgpack.decode(payload)
    if not isinstance(batch, list) or len(batch) < 2:
        raise LlmdDecodeError("failed to decode vLLM event batch")
    return pod, model, [decode_event(ev) for ev in batch[1]]


@dataclass
class Index:
    """in_memory.go + pool.go: request key -> {(pod, tier, group)}, engine key -> request keys."""
    processor: TokenProcessor
    pods_of: dict[int, set] = field(default_factory=dict)
    request_keys_of: dict[int, list[int]] = field(default_factory=dict)
    dropped_events: int = 0

    def apply(self, topic: str, payload: bytes) -> None:
        pod, model, events = parse_message(topic, payload)
        for ev in events:
            getattr(self, "_" + ev["type"])(pod, model, ev)

    def _BlockStored(self, pod: str, model: str, ev: dict) -> None:
        entry = (pod, (ev["medium"] or "gpu").lower(), ev["group_idx"])
        effective_model = ev["lora_name"] or model
        parent = 0
        if ev["parent"]:
            known = self.request_keys_of.get(ev["parent"])
            if not known:
                self.dropped_events += 1  # "Failed to get request key for parent block"
                return
            parent = known[-1]
        extra = parse_raw_extra_keys(ev["extra_keys"])
        if extra is not None:
            extra = realign(extra, len(ev["tokens"]) // self.processor.block_size)
        keys = self.processor.keys(parent, ev["tokens"], effective_model, extra)
        if not keys:
            return
        engine = ev["block_hashes"]
        n = max(len(engine), len(keys))
        mapping: dict[int, list[int]] = {}
        for i in range(n):
            mapping.setdefault(engine[i * len(engine) // n], []).append(keys[i * len(keys) // n])
        for ek, rks in mapping.items():
            self.request_keys_of[ek] = rks
        for rk in keys:
            self.pods_of.setdefault(rk, set()).add(entry)

    def _BlockRemoved(self, pod: str, model: str, ev: dict) -> None:
        entry = (pod, (ev["medium"] or "gpu").lower(), ev["group_idx"])
        for ek in ev["block_hashes"]:
            rks = self.request_keys_of.get(ek)
            if rks is None:
                continue
            for rk in rks:
                self.pods_of.get(rk, set()).discard(entry)
            if not any(self.pods_of.get(rk) for rk in rks):
                del self.request_keys_of[ek]

    def _AllBlocksCleared(self, pod: str, model: str, ev: dict) -> None:
        for entries in self.pods_of.values():
            for e in [e for e in entries if e[0] == pod]:
                entries.discard(e)

    def score(self, keys: list[int]) -> dict[str, int]:
        """LongestPrefixScorer with unit weights: per pod, the number of consecutive leading
        keys it holds (any tier; attention groups only, as a text-only scorer would use)."""
        scores: dict[str, int] = {}
        active: set[str] | None = None
        for key in keys:
            here = {e[0] for e in self.pods_of.get(key, ()) if not e[2]}
            active = here if active is None else active & here
            if not active:
                break
            for pod in active:
                scores[pod] = scores.get(pod, 0) + 1
        return scores
