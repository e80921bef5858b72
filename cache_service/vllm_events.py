"""A pool's event records in vLLM's KV event format (`vllm/distributed/kv_events.py`, 0.33.0):
msgpack `KVEventBatch` `[ts, events, data_parallel_rank]` whose events are `BlockStored`,
`BlockRemoved` and `AllBlocksCleared`, tagged by type, as maps (vLLM 0.33's encoding:
`{"type": "BlockStored", "block_hashes": ...}`) or as positional arrays (older vLLM releases:
`["BlockStored", block_hashes, parent_block_hash, ...]`, fields in 0.33's order, defaulted
trailing fields left out as msgspec's `omit_defaults` does). docs/kv-events.md describes the
wire; design.md §4 the mapping.

- Hashes: a 16-byte page hash goes out as the unsigned integer of its LAST 8 bytes, big-endian
  (u64; exactly what vLLM's `maybe_convert_block_hash` does to its own hashes with
  VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES). `parent_block_hash` is null at a namespace root.
- Namespaces, laid out so that llm-d's indexer (llm-d-kv-cache's token processor: block key =
  FNV-64a of CBOR [parent key, tokens, extra], the chain started from the model name, which is
  `lora_name` when set) computes from our events the keys it computes from a request's prompt:
  an unsalted namespace (the anonymous tenant, with or without an adapter) publishes NO
  `extra_keys`, exactly what vLLM publishes for a text request; the adapter travels as
  `lora_name` only (vLLM also repeats the bare name in `extra_keys`, which llm-d reads as a
  multimodal hash, so its keys would match no prompt). A salted namespace (a tenant) puts one
  entry on the FIRST block of a run that starts at the namespace root, `[namespace id]`, where
  vLLM puts the cache salt (on a request's first block only), so every key of the chain differs
  per tenant; the salt itself never goes on the wire. The namespace id is an HMAC-SHA256 of the
  namespace seed under a key configured on the cache service (`NamespaceIds`): opaque, stable
  while the key is, distinct per (model, adapter, salt); a router that knows it matches a
  tenant's prompt by passing it as block 0's extra key (docs/kv-events.md).
- Hybrid pools: attention pages are group 0 (`kv_cache_spec_kind` "full_attention"); a Mamba
  checkpoint is a block of group 1 ("mamba") with the hash of the page whose state it holds,
  stored when the checkpoint appears and removed when it goes (vLLM's own fields for hybrid
  models). A prefix is reusable up to its deepest page present in both groups.
"""
from __future__ import annotations

import hashlib
import hmac
import secrets

import msgspec
import numpy as np

from cache_service.events import (CHECKPOINT_DROPPED, CHECKPOINTED, CLEARED, REMOVED, STORED,
                                   record_pages)
from prefixcache.v1 import common_pb2
from prefixcache_client.hash import namespace_seed

# "array" first: the default, the positional events llm-d's current indexer decodes
# (llm-d-kv-cache engineadapter/vllm_adapter.go unmarshals each event into a list).
ENCODINGS = ("array", "map")
MEDIUM_NAMES = {common_pb2.MEDIUM_DEVICE: "GPU", common_pb2.MEDIUM_HOST: "CPU",
                common_pb2.MEDIUM_REMOTE: "STORAGE"}
ATTENTION_GROUP, MAMBA_GROUP = 0, 1
ATTENTION_KIND, MAMBA_KIND = "full_attention", "mamba"
# BlockStored's fields in vLLM 0.33's order, up to the last one this publisher sets (the array
# encoding is positional; the map encoding uses the same names).
STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                 "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind")
REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
# Pages encoded between two pauses (the publisher thread lets a Step take the interpreter lock).
PAUSE_PAGES = 64


def int_hashes(hashes: bytes) -> list[int]:
    """Concatenated 16-byte page hashes as u64s: the last 8 bytes of each, big-endian."""
    return np.frombuffer(hashes, dtype=">u8")[1::2].tolist() if hashes else []


def int_hash(page_hash: bytes) -> int | None:
    """One page hash as a u64; None for b"" (no parent: a namespace root)."""
    return int.from_bytes(page_hash[8:16], "big") if page_hash else None


def token_ids(tokens: bytes) -> list[int]:
    return np.frombuffer(tokens, dtype="<u4").tolist()


class NamespaceIds:
    """namespace seed -> opaque id: the first 8 bytes of HMAC-SHA256(key, seed), as hex. The
    seed is itself a hash of (model, adapter, salt) (prefixcache_client.hash.namespace_seed);
    the key keeps anyone without it from testing guessed salts against the id."""

    def __init__(self, key: bytes = b""):
        # No key configured: a random one, so ids are stable for this process only.
        self.key = key or secrets.token_bytes(32)
        self._ids: dict[bytes, str] = {}

    def __call__(self, seed: bytes) -> str:
        ns = self._ids.get(seed)
        if ns is None:
            if len(self._ids) >= 65536:  # namespaces come and go: keep the memo bounded
                self._ids.clear()
            ns = self._ids[seed] = hmac.new(self.key, seed, hashlib.sha256).digest()[:8].hex()
        return ns


class VllmEncoder:
    """Encodes one batch of records (cache_service.events) as a msgpack KVEventBatch."""

    def __init__(self, encoding: str = "array", namespace_key: bytes = b"",
                 data_parallel_rank: int = 0):
        if encoding not in ENCODINGS:
            raise ValueError(f"kv events encoding: must be one of {', '.join(ENCODINGS)}, "
                             f"got '{encoding}'")
        self.encoding = encoding
        self.as_map = encoding == "map"
        self.namespace_id = NamespaceIds(namespace_key)
        self.data_parallel_rank = data_parallel_rank
        self._encode = msgspec.msgpack.Encoder().encode
        self._unsalted: dict[tuple[str, str], bytes] = {}

    def batch(self, timestamp: float, records: list[list], page_size: int,
              hybrid: bool = False, pause=None, model_id: str = "") -> bytes:
        return self._encode([timestamp, self.events(records, page_size, hybrid, pause, model_id),
                             self.data_parallel_rank])

    def extra_keys(self, namespace: bytes, adapter: str, model_id: str, at_root: bool,
                   blocks: int) -> list | None:
        """The `extra_keys` of a run of `blocks` blocks (see the module docstring): None for an
        unsalted namespace, else the namespace id on the first block of a run at the root."""
        unsalted = self._unsalted.get((model_id, adapter))
        if unsalted is None:
            if len(self._unsalted) >= 4096:  # adapters come and go: keep the memo bounded
                self._unsalted.clear()
            unsalted = self._unsalted[(model_id, adapter)] = namespace_seed(model_id, adapter)
        if namespace == unsalted or not at_root:
            return None
        return [[self.namespace_id(namespace)]] + [None] * (blocks - 1)

    def events(self, records: list[list], page_size: int, hybrid: bool = False,
               pause=None, model_id: str = "") -> list:
        """`pause()`, when given, is called between records every PAUSE_PAGES pages or so."""
        out = []
        budget = PAUSE_PAGES
        for r in records:
            if pause is not None:
                budget -= record_pages(r)
                if budget <= 0:
                    pause()
                    budget = PAUSE_PAGES
            kind = r[0]
            if kind == STORED:
                hashes = int_hashes(b"".join(r[3]))
                out.append(self._stored(hashes, r[2], token_ids(b"".join(r[4])), page_size,
                                        r[1], r[5], r[6], model_id, ATTENTION_GROUP,
                                        ATTENTION_KIND))
            elif kind == REMOVED:
                out.append(self._removed(int_hashes(b"".join(r[2])), r[1], ATTENTION_GROUP))
            elif kind == CLEARED:
                out.append({"type": "AllBlocksCleared"} if self.as_map else ["AllBlocksCleared"])
            elif kind == CHECKPOINTED:
                out.append(self._stored([int_hash(r[1])], r[2], token_ids(r[3]), page_size,
                                        common_pb2.MEDIUM_DEVICE, r[4], r[5], model_id,
                                        MAMBA_GROUP, MAMBA_KIND))
            elif kind == CHECKPOINT_DROPPED:
                out.append(self._removed([int_hash(r[1])], common_pb2.MEDIUM_DEVICE, MAMBA_GROUP))
        return out

    def _stored(self, hashes: list[int], parent: bytes, tokens: list[int], page_size: int,
                medium: int, adapter: str, namespace: bytes, model_id: str, group: int,
                spec_kind: str):
        extra = self.extra_keys(namespace, adapter, model_id, not parent, len(hashes))
        values = (hashes, int_hash(parent), tokens, page_size, None, MEDIUM_NAMES[medium],
                  adapter or None, extra, group, spec_kind)
        if self.as_map:
            # The tag first, where vLLM's encoder puts it (some decoders read it first).
            event = {"type": "BlockStored"}
            event.update(zip(STORED_FIELDS, values))
            return event
        return ["BlockStored", *values]

    def _removed(self, hashes: list[int], medium: int, group: int):
        values = (hashes, MEDIUM_NAMES[medium], group)
        if self.as_map:
            event = {"type": "BlockRemoved"}
            event.update(zip(REMOVED_FIELDS, values))
            return event
        return ["BlockRemoved", *values]
