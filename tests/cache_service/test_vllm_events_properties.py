"""The vLLM-format stream over random operation sequences: the core property test
(test_core_properties.CoreMachine) with, beside its gRPC index, one index per encoding built by
decoding every batch's vLLM payload with vLLM 0.33's own classes. After every operation each
equals the tree: group 0 the cached pages per medium, group 1 the pages holding a Mamba
checkpoint."""
from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant

from cache_service.tree import subtree
from cache_service.vllm_events import VllmEncoder
from tests.cache_service.test_core_properties import CoreMachine
from tests.cache_service.test_vllm_events_conformance import MEDIUM, u64, vllm_classes

CLASSES = {encoding: vllm_classes(encoding) for encoding in ("map", "array")}
DECODERS = {e: msgspec.msgpack.Decoder(v.KVEventBatch) for e, v in CLASSES.items()}
ENCODERS = {e: VllmEncoder(e, b"property-test-key-0123456789") for e in CLASSES}


class VllmMachine(CoreMachine):
    vllm_seq = -1

    def _drain_events(self):
        log = self.pool.log
        log.keep_records = True  # before the gRPC side encodes (and would drop) any batch
        if not hasattr(self, "vllm"):
            self.vllm = {e: set() for e in CLASSES}
        batches = log.records_since(self.vllm_seq)
        assert batches is not None, "the replay buffer lost records"
        hybrid = self.pool.cfg.mamba_slots > 0
        for seq, ts, records in batches:
            assert seq == self.vllm_seq + 1
            self.vllm_seq = seq
            for encoding, index in self.vllm.items():
                payload = ENCODERS[encoding].batch(ts, records, self.pool.cfg.page_size, hybrid)
                for ev in DECODERS[encoding].decode(payload).events:
                    self._apply(index, ev)
        super()._drain_events()

    @staticmethod
    def _apply(index: set, ev) -> None:
        kind = type(ev).__name__
        if kind == "AllBlocksCleared":
            index.clear()
            return
        keys = [(ev.group_idx, ev.medium, h) for h in ev.block_hashes]
        if kind == "BlockStored":
            assert ev.kv_cache_spec_kind == ("mamba" if ev.group_idx else "full_attention")
            for key in keys:
                assert key not in index, f"stored twice: {key}"
                index.add(key)
        else:
            for key in keys:
                assert key in index, f"removed a block never stored: {key}"
                index.discard(key)

    @invariant()
    def vllm_stream_equals_tree(self):
        tree = {(0, MEDIUM[n.medium], u64(n.hash)) for root in self.pool.roots.values()
                for n in subtree(root)}
        # An evicted namespace's checkpoints left the index with its pages (an empty hash), even
        # while a lease still holds their slots.
        tree |= {(1, "GPU", u64(h)) for h in self.pool.checkpointed.values() if h}
        for encoding, index in self.vllm.items():
            assert index == tree, encoding


TestVllmEventsProperties = VllmMachine.TestCase
TestVllmEventsProperties.settings = settings(max_examples=150, stateful_step_count=40,
                                             deadline=None,
                                             suppress_health_check=[HealthCheck.too_slow])


class AdaptiveVllmMachine(VllmMachine):
    """The vLLM-format stream equals the tree under the adaptive policy's eviction order too."""
    eviction = "adaptive"


TestVllmEventsPropertiesAdaptive = AdaptiveVllmMachine.TestCase
TestVllmEventsPropertiesAdaptive.settings = settings(max_examples=60, stateful_step_count=40,
                                                     deadline=None,
                                                     suppress_health_check=[HealthCheck.too_slow])
