"""Mamba2 mixer over per-sequence state slots, with optional checkpoint-boundary states."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from compute_service import kernels
from compute_service.model.batch import ForwardBatch, ForwardMode
from compute_service.model.config import ModelConfig
from compute_service.model.layers import GatedGroupRMSNorm
from compute_service.model.lora_batch import LayerLora, project


@dataclass(slots=True)
class BoundarySelection:
    """The checkpoint boundaries of one EXTEND call, shared by all Mamba layers.

    chunk_size: the scan chunk size, chosen so that every boundary is a chunk end;
    chunk_ids [K] int64 index the scan's chunk_states; seq_index [K] int64 is the batch entry of
    each boundary; positions [K] int64 its absolute position (tokens processed).
    """

    chunk_size: int
    chunk_ids: torch.Tensor
    seq_index: torch.Tensor
    positions: torch.Tensor


def select_boundaries(batch: ForwardBatch, model_chunk_size: int) -> BoundarySelection:
    """Boundaries at the absolute multiples of `batch.mamba_checkpoint_interval` inside the call.

    The scan chunk size is gcd(interval, model chunk size): the largest divisor of the interval
    not above the model's chunk size, so every boundary falls on a chunk end of the scan.
    """
    interval = batch.mamba_checkpoint_interval
    chunk_size = math.gcd(interval, model_chunk_size)
    layout = kernels.mamba_chunk_layout(batch.cu_seqlens_q, batch.prefix_lens, chunk_size)
    ends = layout.chunk_end_pos.long()
    chunk_ids = torch.nonzero(ends % interval == 0).flatten()
    return BoundarySelection(
        chunk_size, chunk_ids, layout.chunk_seq.long()[chunk_ids], ends[chunk_ids]
    )


class Mamba2Mixer(nn.Module):
    """in_proj -> (z | xBC | dt); xBC -> causal depthwise conv1d + silu -> (x | B | C);
    SSD scan with dt/A/D -> gated group RMSNorm with z -> out_proj.

    Parameters: A_log, D and dt_bias are kept in fp32 whatever the model dtype (they enter the
    exponentials of the recurrence); conv_weight is [conv_dim, W] (HF stores [conv_dim, 1, W]).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, di, nh = cfg.hidden_size, cfg.mamba_intermediate_size, cfg.mamba_num_heads
        self.intermediate, self.conv_dim, self.num_heads = di, cfg.mamba_conv_dim, nh
        self.head_dim, self.n_groups = cfg.mamba_head_dim, cfg.mamba_n_groups
        self.state_size = cfg.mamba_state_size
        self.chunk_size = cfg.mamba_chunk_size
        # softplus(dt + dt_bias) >= dt_min  <=>  dt >= softplus^-1(dt_min) - dt_bias (monotone),
        # so the floor is applied to the raw dt and the kernels stay unchanged.
        self.dt_floor = math.log(math.expm1(cfg.mamba_dt_min)) if cfg.mamba_dt_min > 0 else None
        self.in_proj = nn.Linear(h, di + self.conv_dim + nh, bias=cfg.mamba_proj_bias)
        self.conv_weight = nn.Parameter(torch.zeros(self.conv_dim, cfg.mamba_conv_kernel))
        self.conv_bias = nn.Parameter(torch.zeros(self.conv_dim)) if cfg.mamba_conv_bias else None
        self.dt_bias = nn.Parameter(torch.zeros(nh))
        self.A_log = nn.Parameter(torch.zeros(nh))
        self.D = nn.Parameter(torch.ones(nh))
        # None: Falcon-H1 without mamba_rms_norm, y * silu(z) only.
        self.norm = (
            None
            if cfg.mamba_norm == "gate"
            else GatedGroupRMSNorm(
                di, cfg.mamba_n_groups, cfg.mamba_norm_eps, cfg.mamba_norm == "norm_gate"
            )
        )
        self.out_proj = nn.Linear(di, h, bias=cfg.mamba_proj_bias)
        # Falcon-H1's muP multipliers (None / 1.0: none).
        self.in_multiplier, self.out_multiplier = cfg.mamba_in_multiplier, cfg.mamba_out_multiplier
        self.proj_multipliers = cfg.mamba_proj_multipliers or None

    def forward(
        self,
        hidden: torch.Tensor,
        batch: ForwardBatch,
        state: tuple[torch.Tensor, torch.Tensor],
        boundaries: BoundarySelection | None,
        lora: LayerLora | None = None,
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """hidden [T, hidden] -> (out [T, hidden], boundary states or None).

        Updates the slots `batch.state_indices` of `state = (ssm_state, conv_state)` to the
        state after each sequence's last new token. With `boundaries` (EXTEND only) also returns
        (ssm [K, H, P, N], conv [K, conv_dim, W-1]) at the selected boundaries, in the pools'
        dtypes. `lora` adds per-token adapter updates of in_proj and out_proj.
        """
        t = hidden.shape[0]
        ssm_state, conv_state = state
        if self.in_multiplier != 1.0:
            hidden = hidden * self.in_multiplier
        z, xbc, dt = self._scale_projection(project(self.in_proj, hidden, lora, "in_proj")).split(
            [self.intermediate, self.conv_dim, self.num_heads], dim=-1
        )
        if self.dt_floor is not None:
            dt = torch.maximum(dt.float(), self.dt_floor - self.dt_bias.float()).to(dt.dtype)
        xbc, dt = xbc.contiguous(), dt.contiguous()
        A = -torch.exp(self.A_log.float())
        boundary_states = None
        if batch.mode is ForwardMode.DECODE:
            conv_out = kernels.causal_conv1d_update(
                xbc, conv_state, self.conv_weight, self.conv_bias, batch.state_indices, "silu"
            )
            x, B, C = self._split_xbc(conv_out)
            y = kernels.selective_state_update(
                ssm_state, x, dt, self.dt_bias, A, B, C, self.D, batch.state_indices
            )
        else:
            # The conv kernel overwrites the slots, so the prior conv state must be read first.
            conv_before = self._initial_conv(conv_state, batch) if boundaries is not None else None
            conv_out = kernels.causal_conv1d(
                xbc,
                self.conv_weight,
                self.conv_bias,
                batch.cu_seqlens_q,
                conv_state,
                batch.state_indices,
                batch.has_initial_state,
                "silu",
            )
            x, B, C = self._split_xbc(conv_out)
            idx = batch.state_indices.long()
            # where, not a multiply: a never-written slot may hold NaN/inf garbage.
            init = torch.where(batch.has_initial_state[:, None, None, None], ssm_state[idx], 0.0)
            chunk_size = boundaries.chunk_size if boundaries is not None else self.chunk_size
            y, final, chunk_states, _, _ = kernels.mamba_chunk_scan(
                x,
                dt,
                self.dt_bias,
                A,
                B,
                C,
                self.D,
                batch.cu_seqlens_q,
                init,
                batch.prefix_lens,
                chunk_size,
            )
            ssm_state[idx] = final.to(ssm_state.dtype)
            if boundaries is not None:
                boundary_states = (
                    chunk_states[boundaries.chunk_ids].to(ssm_state.dtype),
                    self._boundary_conv(xbc, conv_before, batch, boundaries).to(conv_state.dtype),
                )
        y = y.reshape(t, self.intermediate)
        y = y * F.silu(z) if self.norm is None else self.norm(y, z)
        out = project(self.out_proj, y, lora, "out_proj")
        if self.out_multiplier != 1.0:
            out = out * self.out_multiplier
        return out, boundary_states

    def _scale_projection(self, zxbcdt: torch.Tensor) -> torch.Tensor:
        """Falcon-H1's mup vector: the z, x, B, C and dt sections of in_proj's output each times
        its own multiplier (no-op elsewhere)."""
        if self.proj_multipliers is None:
            return zxbcdt
        gn = self.n_groups * self.state_size
        sizes = [self.intermediate, self.intermediate, gn, gn, self.num_heads]
        vector = torch.repeat_interleave(
            torch.tensor(self.proj_multipliers, dtype=torch.float32),
            torch.tensor(sizes),
        )
        return zxbcdt * vector.to(device=zxbcdt.device, dtype=zxbcdt.dtype)

    def _split_xbc(self, xbc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, conv_dim] -> x [T, H, P], B [T, G, N], C [T, G, N] (contiguous, as kernels want)."""
        t = xbc.shape[0]
        gn = self.n_groups * self.state_size
        x, B, C = xbc.split([self.intermediate, gn, gn], dim=-1)
        return (
            x.reshape(t, self.num_heads, self.head_dim).contiguous(),
            B.reshape(t, self.n_groups, self.state_size).contiguous(),
            C.reshape(t, self.n_groups, self.state_size).contiguous(),
        )

    @staticmethod
    def _initial_conv(conv_state: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """[B, C, W-1]: each sequence's conv state before this call (zeros without one)."""
        prior = conv_state[batch.state_indices.long()]
        return torch.where(batch.has_initial_state[:, None, None], prior, 0.0)

    @staticmethod
    def _boundary_conv(
        xbc: torch.Tensor, conv_before: torch.Tensor, batch: ForwardBatch, sel: BoundarySelection
    ) -> torch.Tensor:
        """[K, C, W-1]: the conv state after `sel.positions[k]` tokens, i.e. the conv *inputs*
        (pre-activation xBC) at the W-1 positions before it, oldest first. Inputs before this
        call's first token come from the sequence's prior conv state, so a boundary closer than
        W-1 tokens to the start of the call is still exact (design.md lesson 10)."""
        w1 = conv_before.shape[-1]
        b = sel.seq_index
        # Index of each needed input relative to the sequence's first new token: may be negative.
        rel = (
            (sel.positions - batch.prefix_lens.long()[b])[:, None]
            - w1
            + torch.arange(w1, device=xbc.device)
        )
        # rel < p - prefix <= this call's length, so clamping at 0 keeps rows inside the sequence.
        from_call = xbc[batch.cu_seqlens_q.long()[b][:, None] + rel.clamp(min=0)]  # [K, W-1, C]
        from_prior = conv_before[b[:, None], :, (rel + w1).clamp(max=w1 - 1)]  # [K, W-1, C]
        picked = torch.where((rel >= 0)[:, :, None], from_call, from_prior.to(xbc.dtype))
        return picked.transpose(1, 2).contiguous()
