"""AdapterRegistry: up to `max_loaded` LoRA adapters in the slots of stacked device buffers, and
the `LoraBatch` of a forward call whose sequences use any mix of them.

Memory is allocated once, at construction, for every enabled target projection:
`max_loaded * max_rank * (in + out)` elements of the model dtype per projection, so loading an
adapter never allocates. A slot holds one adapter; an adapter of rank r < max_rank, or one that
does not target some projection, leaves the rest of its slot zero (the kernel then adds 0).

Lifetime (design.md lesson 5, defer what is pinned): the engine pins a slot per running
sequence with `acquire(name)` and unpins it with `release(slot)` when the sequence ends.
`unload(name)` removes the name at once (new requests get AdapterNotFoundError), but the slot,
and the weights running sequences still read, stay until the last pin is released. All methods
are thread-safe (load/unload may come from RPC threads while the engine runs forwards).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from compute_service import kernels
from compute_service.lora.adapter import LoraAdapter, read_adapter
from compute_service.lora.config import AdapterConfigError, validate_adapter_name
from compute_service.lora.targets import Target, target_linears
from compute_service.model.lora_batch import LORA_TARGETS, LayerLora, LoraBatch, LoraWeights
from compute_service.model.model import CausalLM


class AdapterNotFoundError(LookupError):
    """No adapter of that name is loaded."""


class AdapterExistsError(AdapterConfigError):
    """An adapter of that name is already loaded (unload it first)."""

    def __init__(self, name: str) -> None:
        super().__init__("name", f"adapter {name!r} is already loaded")


class NoFreeSlotError(RuntimeError):
    """All `max_loaded` slots hold an adapter (or one unloaded but still pinned)."""


@dataclass(slots=True, frozen=True)
class AdapterInfo:
    """A loaded adapter: its slot, rank, PEFT module names it updates, and source path."""

    name: str
    slot: int
    rank: int
    target_modules: tuple[str, ...]
    path: str


@dataclass(slots=True)
class _Slot:
    info: AdapterInfo
    targets: frozenset[Target]
    loaded: bool = True  # False once unloaded; the slot is freed when pins drop to 0
    pins: int = 0


class AdapterRegistry:
    """Stacked LoRA weights for `model`, one slot per loaded adapter.

    `targets`: PEFT module names to reserve memory for (default: every LoRA-capable projection
    the model has); adapters that update others are refused. `max_rank`: the largest adapter
    rank accepted.
    """

    def __init__(
        self,
        model: CausalLM,
        max_loaded: int = 4,
        max_rank: int = 16,
        targets: Iterable[str] | None = None,
    ) -> None:
        if max_loaded <= 0 or max_rank <= 0:
            raise ValueError("max_loaded/max_rank: must be positive")
        enabled = set(LORA_TARGETS) if targets is None else set(targets)
        if not enabled <= set(LORA_TARGETS):
            raise ValueError(f"targets: {sorted(enabled - set(LORA_TARGETS))} are not LoRA targets")
        self.model_config = model.config
        self.max_loaded, self.max_rank = max_loaded, max_rank
        self._device = model.device
        self._weights: dict[Target, LoraWeights] = {}
        for target, linear in target_linears(model).items():
            if target[1] not in enabled:
                continue
            kw = {"dtype": model.dtype, "device": model.device}
            self._weights[target] = LoraWeights(
                A=torch.zeros(max_loaded, max_rank, linear.in_features, **kw),
                B=torch.zeros(max_loaded, linear.out_features, max_rank, **kw),
                scaling=torch.zeros(max_loaded, dtype=torch.float32, device=model.device),
                # The CPU kernel reads B transposed (contiguous along out); GPUs need no copy.
                B_t=(torch.zeros(max_loaded, max_rank, linear.out_features, **kw)
                     if model.device.type == "cpu" else None),
            )
        self._slots: list[_Slot | None] = [None] * max_loaded
        self._by_name: dict[str, int] = {}
        self._lock = threading.Lock()

    # ---- loading ---------------------------------------------------------------------------
    def load(self, name: str, path: str | Path) -> AdapterInfo:
        """Read the PEFT adapter at `path` into a free slot under `name`.

        Raises AdapterConfigError (bad name, files or config, naming the field),
        AdapterExistsError, NoFreeSlotError. Nothing is changed when it raises."""
        validate_adapter_name(name)
        with self._lock:
            if name in self._by_name:  # fail fast, before reading the files
                raise AdapterExistsError(name)
        adapter = read_adapter(path, self.model_config)
        return self.add(name, adapter, str(path))

    def add(self, name: str, adapter: LoraAdapter, path: str = "") -> AdapterInfo:
        """Put an in-memory adapter (read for this model's config) into a free slot."""
        validate_adapter_name(name)
        if adapter.rank > self.max_rank:
            raise AdapterConfigError("r", f"rank {adapter.rank} exceeds max_rank {self.max_rank}")
        missing = sorted({t for t in adapter.modules if t not in self._weights})
        if missing:
            raise AdapterConfigError(
                "target_modules",
                f"{sorted({n for _, n in missing})} are not enabled on this worker "
                f"(enabled: {sorted({n for _, n in self._weights})})",
            )
        with self._lock:
            if name in self._by_name:
                raise AdapterExistsError(name)
            slot = next((s for s, used in enumerate(self._slots) if used is None), None)
            if slot is None:
                raise NoFreeSlotError(
                    f"all {self.max_loaded} adapter slots are in use; unload one first"
                )
            self._write_slot(slot, adapter)
            info = AdapterInfo(name, slot, adapter.rank, adapter.target_modules, path)
            self._slots[slot] = _Slot(info, frozenset(adapter.modules))
            self._by_name[name] = slot
        return info

    def _write_slot(self, slot: int, adapter: LoraAdapter) -> None:
        """Overwrite every enabled projection's slot: the adapter's factors zero-padded to
        max_rank, or zeros (and scaling 0) where it has none, so nothing of a previous occupant
        survives."""
        for target, w in self._weights.items():
            w.A[slot].zero_()
            w.B[slot].zero_()
            if w.B_t is not None:
                w.B_t[slot].zero_()
            module = adapter.modules.get(target)
            if module is None:
                w.scaling[slot] = 0.0
                continue
            r = module.rank
            w.A[slot, :r].copy_(module.A)
            w.B[slot, :, :r].copy_(module.B)
            if w.B_t is not None:
                w.B_t[slot, :r].copy_(module.B.T)
            w.scaling[slot] = module.scaling

    def unload(self, name: str) -> AdapterInfo:
        """Forget `name` now; its slot is reused once no sequence pins it any more."""
        with self._lock:
            slot = self._slot_index(name)
            entry = self._slots[slot]
            assert entry is not None
            del self._by_name[name]
            entry.loaded = False
            if entry.pins == 0:
                self._slots[slot] = None
            return entry.info

    # ---- lookups and pins ------------------------------------------------------------------
    def _slot_index(self, name: str) -> int:
        slot = self._by_name.get(name)
        if slot is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not loaded")
        return slot

    def slot_of(self, name: str) -> int:
        """The slot of loaded adapter `name` (AdapterNotFoundError if none)."""
        with self._lock:
            return self._slot_index(name)

    def info(self, name: str) -> AdapterInfo:
        with self._lock:
            entry = self._slots[self._slot_index(name)]
            assert entry is not None
            return entry.info

    def names(self) -> list[str]:
        """Loaded adapter names, sorted (unloaded-but-pinned ones are not listed)."""
        with self._lock:
            return sorted(self._by_name)

    def acquire(self, name: str) -> int:
        """Pin the slot of loaded adapter `name` for one running sequence; returns the slot."""
        with self._lock:
            slot = self._slot_index(name)
            entry = self._slots[slot]
            assert entry is not None
            entry.pins += 1
            return slot

    def release(self, slot: int) -> None:
        """Unpin one `acquire` of `slot`; frees the slot if its adapter was unloaded meanwhile."""
        with self._lock:
            entry = self._slots[slot]
            if entry is None or entry.pins == 0:
                raise ValueError(f"slot: {slot} is not pinned")
            entry.pins -= 1
            if entry.pins == 0 and not entry.loaded:
                self._slots[slot] = None

    # ---- forward batches -------------------------------------------------------------------
    def lora_batch(self, seq_slots: Sequence[int], num_tokens: Sequence[int]) -> LoraBatch | None:
        """The `ForwardBatch.lora` of a call whose b-th sequence has `num_tokens[b]` new tokens
        (packed in this order) and uses adapter slot `seq_slots[b]` (-1 = base model).

        Returns None when no sequence uses an adapter (the forward is then the base model's,
        with no LoRA cost). Only projections some adapter of the batch targets get an update.
        Raises ValueError for a slot that holds no adapter."""
        if len(seq_slots) != len(num_tokens):
            raise ValueError("seq_slots/num_tokens: one entry per sequence")
        used = {s for s in seq_slots if s != -1}
        if not used:
            return None
        with self._lock:
            targets: set[Target] = set()
            for s in used:
                entry = self._slots[s] if 0 <= s < self.max_loaded else None
                if entry is None:
                    raise ValueError(f"seq_slots: slot {s} holds no adapter")
                targets |= entry.targets
        token_slot = torch.repeat_interleave(
            torch.tensor(seq_slots, dtype=torch.int32), torch.tensor(num_tokens, dtype=torch.int64)
        ).to(self._device)
        segments = kernels.lora_segments(token_slot, self.max_loaded)
        per_layer: list[dict[str, LoraWeights]] = [{} for _ in range(self.model_config.num_layers)]
        for layer_id, name in targets:
            per_layer[layer_id][name] = self._weights[(layer_id, name)]
        return LoraBatch([LayerLora(token_slot, segments, w) if w else None for w in per_layer])
