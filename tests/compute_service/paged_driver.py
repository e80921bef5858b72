"""A minimal single-process driver of `CausalLM.forward`: pages from a free list, one Mamba slot
per sequence, no scheduler. Only the tests use it (the reference the engine is checked against),
so it lives here, outside compute_service; it is also the executable example of how
to fill a `ForwardBatch` (the serving engine builds the same tensors from its own allocator).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from compute_service.model.batch import (
    ForwardBatch,
    ForwardMode,
    ForwardOutput,
    MambaBoundaryStates,
    allocate_kv_caches,
    allocate_mamba_states,
)
from compute_service.model.lora_batch import LoraBatch
from compute_service.model.model import CausalLM


@dataclass(slots=True)
class SequenceState:
    """Pages (in order) covering tokens [0, length); `slot` is the running Mamba state slot;
    `has_state` says whether that slot holds the state at `length`."""

    slot: int
    pages: list[int] = field(default_factory=list)
    length: int = 0
    has_state: bool = False


class PagedDriver:
    """Owns a KV page pool and Mamba slots for `model`; runs EXTEND and DECODE calls."""

    def __init__(
        self, model: CausalLM, num_pages: int = 64, page_size: int = 16, num_slots: int = 8
    ) -> None:
        self.model, self.page_size = model, page_size
        cfg, dtype, device = model.config, model.dtype, model.device
        self.kv_caches = allocate_kv_caches(cfg, num_pages, page_size, dtype, device)
        self.mamba_states = allocate_mamba_states(cfg, num_slots, dtype, device)
        self.free_pages = list(range(num_pages))
        self.free_slots = list(range(num_slots))

    def new_sequence(self) -> SequenceState:
        return SequenceState(slot=self.free_slots.pop(0))

    def fork(
        self,
        src: SequenceState,
        num_tokens: int,
        boundary: tuple[MambaBoundaryStates, int] | None = None,
    ) -> SequenceState:
        """A new sequence whose first `num_tokens` (a multiple of the page size) are `src`'s,
        sharing its pages read-only, as a prefix-cache hit does. For Mamba models pass
        `boundary = (states, k)`: boundary k of an earlier EXTEND output, at position num_tokens."""
        if num_tokens % self.page_size or num_tokens > src.length:
            raise ValueError("num_tokens: must be a page multiple within the source sequence")
        seq = self.new_sequence()
        seq.pages = src.pages[: num_tokens // self.page_size]
        seq.length = num_tokens
        if boundary is not None:
            states, k = boundary
            if int(states.positions[k]) != num_tokens:
                raise ValueError(f"boundary {k} is at {int(states.positions[k])}, not {num_tokens}")
            for (ssm, conv), b_ssm, b_conv in zip(
                self.mamba_states, states.ssm, states.conv, strict=True
            ):
                ssm[seq.slot] = b_ssm[k]
                conv[seq.slot] = b_conv[k]
            seq.has_state = True
        return seq

    def _grow(self, seq: SequenceState, new_len: int) -> None:
        while len(seq.pages) * self.page_size < new_len:
            seq.pages.append(self.free_pages.pop(0))

    def forward(
        self,
        seqs: list[SequenceState],
        tokens: list[list[int]],
        mode: ForwardMode = ForwardMode.EXTEND,
        all_logits: bool = False,
        checkpoint_interval: int = 0,
        lora: LoraBatch | None = None,
    ) -> ForwardOutput:
        """Append `tokens[b]` to `seqs[b]` for every b in one call. `all_logits` returns the logits
        of every new token (packed order) instead of each sequence's last one. `lora` (built for
        these tokens, e.g. by `AdapterRegistry.lora_batch`) applies LoRA adapters."""
        device = self.model.device
        prefix, ids, positions, slots, cu = [], [], [], [], [0]
        for seq, toks in zip(seqs, tokens, strict=True):
            self._grow(seq, seq.length + len(toks))
            prefix.append(seq.length)
            for j, tok in enumerate(toks):
                pos = seq.length + j
                ids.append(tok)
                positions.append(pos)
                slots.append(
                    seq.pages[pos // self.page_size] * self.page_size + pos % self.page_size
                )
            cu.append(cu[-1] + len(toks))
        width = max(len(s.pages) for s in seqs)
        block_tables = [s.pages + [0] * (width - len(s.pages)) for s in seqs]

        def i32(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=device)

        batch = ForwardBatch(
            mode=mode,
            cu_seqlens_q=i32(cu),
            prefix_lens=i32(prefix),
            block_tables=i32(block_tables),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            kv_caches=self.kv_caches,
            mamba_states=self.mamba_states,
            state_indices=i32([s.slot for s in seqs]),
            has_initial_state=torch.tensor(
                [s.has_state for s in seqs], dtype=torch.bool, device=device
            ),
            logits_indices=torch.arange(len(ids), device=device) if all_logits else None,
            mamba_checkpoint_interval=checkpoint_interval,
            lora=lora,
        )
        out = self.model(
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            batch,
        )
        for seq, toks in zip(seqs, tokens, strict=True):
            seq.length += len(toks)
            seq.has_state = True
        return out

    def generate_greedy(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        """Prefill `prompt` in one call, then decode greedily; returns the new token ids."""
        seq = self.new_sequence()
        logits = self.forward([seq], [prompt]).logits
        out = [int(logits[0].argmax())]
        while len(out) < max_new_tokens:
            logits = self.forward([seq], [[out[-1]]], mode=ForwardMode.DECODE).logits
            out.append(int(logits[0].argmax()))
        return out[:max_new_tokens]
