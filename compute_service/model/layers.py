"""Stateless building blocks: RMSNorm, gated group RMSNorm, the MLPs and rotary embedding.

Numerics follow the Hugging Face implementations of the supported families: norms compute in
fp32 and cast back to the input dtype *before* multiplying by the weight.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from compute_service import kernels
from compute_service.model.config import ModelConfig, RopeScaling
from compute_service.model.lora_batch import LayerLora, project, project_group


class RMSNorm(nn.Module):
    """y = weight * (x / sqrt(mean(x^2) + eps)) over the last dim."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return kernels.rms_norm(x, self.weight, self.eps)


class GatedGroupRMSNorm(nn.Module):
    """Mamba2's output norm: y = weight * group_rms_norm(x * silu(z)).

    The gate is applied *before* normalising (mamba_ssm `norm_before_gate=False`, which is what
    HF Mamba2 and Bamba run), and the RMS statistic is taken per group of `size // n_groups`
    channels, i.e. per SSM group, not over the whole width.

    With `norm_before_gate` (Falcon-H1's option) it is weight * group_rms_norm(x) * silu(z),
    all in fp32 and cast back at the end, as transformers' FalconH1RMSNormGated computes it.
    """

    def __init__(self, size: int, n_groups: int, eps: float, norm_before_gate: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.n_groups = n_groups
        self.eps = eps
        self.norm_before_gate = norm_before_gate

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """x, z: [T, size] -> [T, size] in x's dtype."""
        dtype = x.dtype
        x = x.float() if self.norm_before_gate else x.float() * F.silu(z.float())
        g = x.view(*x.shape[:-1], self.n_groups, -1)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.norm_before_gate:
            return (self.weight * g.view_as(x) * F.silu(z.float())).to(dtype)
        return self.weight * g.view_as(x).to(dtype)


class SwiGLU(nn.Module):
    """down(silu(gate(x) * gate_multiplier) * up(x)) * down_multiplier (the multipliers are
    Falcon-H1's muP ones, 1.0 elsewhere)."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        bias: bool,
        gate_multiplier: float = 1.0,
        down_multiplier: float = 1.0,
    ) -> None:
        super().__init__()
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; `lora` adds per-token adapter updates of the three
        projections."""
        gate, up = project_group(
            (self.gate_proj, self.up_proj), x, lora, ("gate_proj", "up_proj")
        )
        if self.gate_multiplier != 1.0:
            gate = gate * self.gate_multiplier
        out = project(self.down_proj, up * F.silu(gate), lora, "down_proj")
        return out if self.down_multiplier == 1.0 else out * self.down_multiplier


class ReluSquaredMLP(nn.Module):
    """down(relu(up(x))^2): NemotronH's MLP (no gate)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        h = torch.square(F.relu(project(self.up_proj, x, lora, "up_proj")))
        return project(self.down_proj, h, lora, "down_proj")


class FusedSwiGLU(nn.Module):
    """output_linear(silu(gate) * up) with (gate | up) = input_linear(x): Granite's shared MLP,
    kept fused as its checkpoints store it. Not a LoRA target (its PEFT names differ)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.input_linear = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.output_linear = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.output_linear(F.silu(gate) * up)


def build_mlp(cfg: ModelConfig) -> nn.Module:
    """The feed-forward of `cfg.mlp_kind`."""
    if cfg.mlp_kind == "swiglu":
        return SwiGLU(
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.mlp_bias,
            cfg.mlp_gate_multiplier,
            cfg.mlp_down_multiplier,
        )
    kind = {"relu2": ReluSquaredMLP, "fused_swiglu": FusedSwiGLU}
    return kind[cfg.mlp_kind](cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] (fp32), with linear or Llama-3.1 scaling."""
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
    )
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    # llama3: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """RoPE tables for the first `rotary_dim` channels of each head (see `kernels.rope`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int -> cos, sin [T, 1, rotary_dim] in `dtype` (computed in fp32)."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        return emb.cos().to(dtype), emb.sin().to(dtype)
