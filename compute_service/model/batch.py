"""What the serving engine hands to `CausalLM.forward`, and what it gets back.

Layout of one forward call (B sequences, T new tokens in all, packed sequence-major):

    input_ids [T] int64, positions [T] int64, positions[cu_seqlens_q[b] + j] == prefix_lens[b] + j

Per attention layer k (see `ModelConfig.attention_layer_ids`) the engine owns a paged KV pool
`kv_caches[k] = (k_cache, v_cache)`, each [num_pages, page_size, num_kv_heads, head_dim]. Token
at absolute position p of sequence b lives in page `block_tables[b, p // page_size]` at offset
`p % page_size`; `slot_mapping[t] = page * page_size + offset` for each new token t (the forward
writes the new K/V there before attending). Pages holding a cached prefix are only read.

Per Mamba2 layer k (see `ModelConfig.mamba_layer_ids`) the engine owns state slots
`mamba_states[k] = (ssm_state [S, H, P, N], conv_state [S, conv_dim, W-1])`. Sequence b reads its
initial state from slot `state_indices[b]` when `has_initial_state[b]` (otherwise starts from
zeros) and the forward overwrites that slot with the state after its last new token. To resume
from a checkpoint, the engine copies the checkpoint into the running slot first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

from compute_service.model.config import ModelConfig
from compute_service.model.lora_batch import LoraBatch


class ForwardMode(enum.Enum):
    """EXTEND: any number of new tokens per sequence (prefill chunks; mixed batches with
    decoding sequences too). DECODE: exactly one new token per sequence (T == B), with
    `has_initial_state` all true; uses the single-step kernels."""

    EXTEND = "extend"
    DECODE = "decode"


@dataclass(slots=True)
class ForwardBatch:
    """Paged-cache metadata of one forward call. All index tensors live on the model's device.

    - cu_seqlens_q [B+1] int32: new-token offsets of each sequence in the packed batch.
    - prefix_lens [B] int32: tokens already in the cache before this call (any value, also in
      the middle of a page).
    - block_tables [B, M] int32: page ids of each sequence, covering prefix + new tokens.
    - slot_mapping [T] int64: cache slot of each new token (see the module docstring).
    - state_indices [B] int32: running Mamba state slot of each sequence (ignored without
      Mamba layers).
    - has_initial_state [B] bool: whether that slot holds the state at `prefix_lens[b]`.
    - logits_indices [K] int64 | None: packed token indices whose logits are returned; None
      means the last new token of each sequence (K == B).
    - mamba_checkpoint_interval: when > 0 (EXTEND only), also return the Mamba states at every
      absolute position that is a multiple of it inside this call (normally the page size).
    - lora: per-token LoRA adapters (`AdapterRegistry.lora_batch`); None = base model for all.
    - max_q_len: the most new tokens of one sequence, when the host knows it (the engine
      does): the extend kernel sizes its grid by it and otherwise reads it from
      `cu_seqlens_q`, a device synchronisation in every attention layer.
    """

    mode: ForwardMode
    cu_seqlens_q: torch.Tensor
    prefix_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    mamba_states: list[tuple[torch.Tensor, torch.Tensor]]
    state_indices: torch.Tensor
    has_initial_state: torch.Tensor
    logits_indices: torch.Tensor | None = None
    mamba_checkpoint_interval: int = 0
    lora: LoraBatch | None = None
    max_q_len: int | None = None

    @property
    def batch_size(self) -> int:
        return self.cu_seqlens_q.numel() - 1

    def seq_lens(self) -> torch.Tensor:
        """[B] int32: prefix + new tokens of each sequence (the decode kernel's seq_lens)."""
        return (self.prefix_lens + self.cu_seqlens_q.diff()).to(torch.int32)

    def selected_indices(self) -> torch.Tensor:
        """[K] int64 packed indices whose logits are computed."""
        if self.logits_indices is not None:
            return self.logits_indices
        return self.cu_seqlens_q[1:].long() - 1


@dataclass(slots=True)
class MambaBoundaryStates:
    """Mamba states at checkpoint boundaries inside one EXTEND call.

    Boundary k belongs to batch entry `seq_index[k]` and is the state after the first
    `positions[k]` tokens of that sequence (positions[k] is a multiple of the interval, with
    prefix_lens[b] < positions[k] <= seq_lens[b]). Boundaries are ordered by sequence, then by
    position. Per Mamba layer l (ordinal into `ModelConfig.mamba_layer_ids`):
    `ssm[l]` [K, H, P, N] and `conv[l]` [K, conv_dim, W-1], in the state pools' dtypes, each
    exactly what the layer's slot would hold after processing `positions[k]` tokens.
    """

    seq_index: torch.Tensor
    positions: torch.Tensor
    ssm: list[torch.Tensor]
    conv: list[torch.Tensor]


@dataclass(slots=True)
class ForwardOutput:
    """logits [K, vocab] fp32 for `ForwardBatch.selected_indices()`; boundary states when
    `mamba_checkpoint_interval > 0` and the model has Mamba layers, else None."""

    logits: torch.Tensor
    mamba_boundaries: MambaBoundaryStates | None = None


def allocate_kv_caches(
    cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (k_cache, v_cache) pairs, one per attention layer, [num_pages, page_size, Hkv, D]."""
    shape = (num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    return [
        (
            torch.zeros(shape, dtype=dtype, device=device),
            torch.zeros(shape, dtype=dtype, device=device),
        )
        for _ in cfg.attention_layer_ids
    ]


def allocate_mamba_states(
    cfg: ModelConfig, num_slots: int, dtype: torch.dtype, device: torch.device | str
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Zeroed (ssm_state [S,H,P,N], conv_state [S,conv_dim,W-1]) pairs, one per Mamba layer.
    ssm_state is kept in fp32 whatever `dtype` is: the recurrence accumulates over the whole
    sequence and bf16 state drifts visibly over long generations."""
    ssm = (num_slots, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.mamba_state_size)
    conv = (num_slots, cfg.mamba_conv_dim, cfg.mamba_conv_kernel - 1)
    return [
        (
            torch.zeros(ssm, dtype=torch.float32, device=device),
            torch.zeros(conv, dtype=dtype, device=device),
        )
        for _ in cfg.mamba_layer_ids
    ]
