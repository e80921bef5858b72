"""GQA self-attention over the paged KV cache (optional sliding window, RoPE incl. partial)."""

from __future__ import annotations

import torch
from torch import nn

from compute_service import kernels
from compute_service.model.batch import ForwardBatch, ForwardMode
from compute_service.model.config import ModelConfig
from compute_service.model.layers import RMSNorm
from compute_service.model.lora_batch import LayerLora, project, project_group


class PagedAttention(nn.Module):
    """q/k/v projections, RoPE, K/V write into the pages, paged attention, o projection.

    `window` > 0 limits each query at position p to keys at positions > p - window (the
    Mistral/HF convention); the kernels apply it, so out-of-window pages are never read.
    """

    def __init__(self, cfg: ModelConfig, window: int) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, d
        self.window = window
        self.scale = cfg.attention_scale or d**-0.5
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        # Qwen3: each query and key head is RMS-normalised over head_dim before RoPE.
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps) if cfg.qk_norm else None
        # Falcon-H1's muP multipliers of the input, the keys (before RoPE) and the output.
        self.in_multiplier, self.out_multiplier = cfg.attention_in_multiplier, cfg.attention_out_multiplier
        self.key_multiplier = cfg.key_multiplier

    def forward(
        self,
        x: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
        batch: ForwardBatch,
        cache: tuple[torch.Tensor, torch.Tensor],
        seq_lens: torch.Tensor | None,
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Writes this call's K/V into `cache` at
        `batch.slot_mapping`. `cos_sin` are the RoPE tables of this call's positions and
        `seq_lens` [B] int32 is `batch.seq_lens()` in DECODE mode (None otherwise); both are
        computed once per call, not per layer. `lora` adds the per-token adapter updates of
        q/k/v/o (before the q/k norms and RoPE, as PEFT does)."""
        t = x.shape[0]
        if self.in_multiplier != 1.0:
            x = x * self.in_multiplier
        q, k, v = project_group(
            (self.q_proj, self.k_proj, self.v_proj), x, lora, ("q_proj", "k_proj", "v_proj")
        )
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if cos_sin is not None:  # None: no positional encoding (NoPE)
            q, k = kernels.rope(q, *cos_sin), kernels.rope(k, *cos_sin)
        k_cache, v_cache = cache
        kernels.write_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        if batch.mode is ForwardMode.DECODE:
            out = kernels.paged_decode_attention(
                q, k_cache, v_cache, batch.block_tables, seq_lens, self.scale, window=self.window
            )
        else:
            out = kernels.extend_attention(
                q,
                k_cache,
                v_cache,
                batch.block_tables,
                batch.cu_seqlens_q,
                batch.prefix_lens,
                self.scale,
                window=self.window,
                max_q_len=batch.max_q_len,
            )
        out = project(self.o_proj, out.reshape(t, self.num_heads * self.head_dim), lora, "o_proj")
        return out if self.out_multiplier == 1.0 else out * self.out_multiplier
