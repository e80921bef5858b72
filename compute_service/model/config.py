"""ModelConfig: the one description of every decoder this package runs.

A model is a stack of `num_layers` decoder layers. Each layer is

    h = h + mixer(norm1(h))          mixer = attention, Mamba2, or both summed ("parallel",
                                     Falcon-H1), per `layer_types[i]`
    h = h + mlp(norm2(h))            only when `intermediate_size > 0` (pure Mamba2 has no MLP)

where `mlp` is the family's MLP (`mlp_kind`), or on the layers of `moe_layer_ids` a sparse
mixture of SwiGLU experts (`moe.py`: `moe_num_experts` experts of width
`moe_intermediate_size`, `moe_top_k` per token), summed with the dense MLP as a shared expert
when `moe_shared_mlp` (Granite 4.0-H MoE); or, in families whose blocks hold a single
mixer each (NemotronH), an "mlp" layer `h = h + mlp(norm1(h))`; when any layer is an "mlp"
layer, attention/Mamba layers carry no MLP.
Every residual add is scaled by `residual_multiplier` and the embedding by
`embedding_multiplier` (Granite's muP multipliers; 1.0 elsewhere). The stack is
followed by a final RMSNorm and the LM head (logits divided by `logits_scaling`). Attention is GQA with RoPE (optionally partial,
i.e. only the first `rotary_dim` channels of each head rotate) and an optional per-layer sliding
window. Mamba2 is the SSD mixer of the Mamba2 paper (in_proj -> causal depthwise conv1d -> SSD
scan with dt/A/D -> gated group RMSNorm -> out_proj).

Invariants (checked by `validate()`):
- `len(layer_types) == len(sliding_windows) == num_layers`;
- `num_heads % num_kv_heads == 0`; `rotary_dim` is even and `<= head_dim`;
- `mamba_num_heads * mamba_head_dim == mamba_intermediate_size` and
  `mamba_num_heads % mamba_n_groups == 0`;
- a sliding window is only set on attention layers;
- MoE layers are distinct layer ids in range, and 0 < `moe_top_k` <= `moe_num_experts`;
  `moe_routing` is one of MOE_ROUTINGS; a shared MLP needs `intermediate_size > 0`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

LayerType = Literal["attention", "mamba", "mlp", "parallel"]
ATTENTION: LayerType = "attention"
MAMBA: LayerType = "mamba"
MLP: LayerType = "mlp"
# Attention and Mamba2 side by side on the same normed input, outputs summed (Falcon-H1):
# the layer has both a KV cache and Mamba state slots.
PARALLEL: LayerType = "parallel"
# Mamba2 output gating: "gate_norm" norm(y * silu(z)) (Mamba2, Bamba, NemotronH, Granite);
# "norm_gate" norm(y) * silu(z); "gate" y * silu(z) with no norm (Falcon-H1 options).
MAMBA_NORMS = ("gate_norm", "norm_gate", "gate")
# MoE routing weights: "softmax_topk" softmax over all experts then the top k (Qwen3-MoE);
# "topk_softmax" the top k logits then a softmax over those k (Granite, Mixtral).
MOE_ROUTINGS = ("softmax_topk", "topk_softmax")
# Feed-forward kinds: "swiglu" down(silu(gate(x)) * up(x)); "relu2" down(relu(up(x))^2)
# (NemotronH); "fused_swiglu" the SwiGLU with gate and up in one `input_linear` (Granite).
MLP_KINDS = ("swiglu", "relu2", "fused_swiglu")


@dataclass(slots=True, frozen=True)
class RopeScaling:
    """RoPE frequency scaling. `kind` is "linear" (positions divided by `factor`) or "llama3"
    (the Llama 3.1 wavelength-dependent interpolation, which also uses the three other fields)."""

    kind: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(slots=True)
class ModelConfig:
    """Shapes and options of one decoder. Sizes are in elements; ids are token ids."""

    vocab_size: int
    hidden_size: int
    layer_types: tuple[LayerType, ...]
    # Feed-forward (SwiGLU). 0 means "no MLP sub-layer" (Mamba2 blocks).
    intermediate_size: int = 0
    mlp_bias: bool = False
    mlp_kind: str = "swiglu"
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    # Keep the residual stream in fp32 whatever the weight dtype (HF Mamba2 `residual_in_fp32`).
    residual_in_fp32: bool = False
    # muP multipliers (Granite): embeddings times embedding_multiplier, every residual branch
    # times residual_multiplier, logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # --- attention layers ---
    num_heads: int = 0
    num_kv_heads: int = 0
    head_dim: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    # Softmax scale of q.k; 0.0 means head_dim ** -0.5 (Granite sets attention_multiplier).
    attention_scale: float = 0.0
    # False: attention without positional encoding (NemotronH, Granite "nope").
    use_rope: bool = True
    rope_theta: float = 10000.0
    # Number of leading channels per head that RoPE rotates (NeoX "rotate half" layout within
    # them); the remaining head_dim - rotary_dim channels pass through unchanged.
    rotary_dim: int = 0
    rope_scaling: RopeScaling | None = None
    # Qwen3: RMSNorm over head_dim of each query and key head (own weights), before RoPE.
    qk_norm: bool = False
    # Per layer; 0 = full causal attention, W > 0 = attend to key positions > pos - W.
    sliding_windows: tuple[int, ...] = ()
    max_position_embeddings: int = 4096
    # --- Mamba2 layers ---
    mamba_num_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state_size: int = 0
    mamba_n_groups: int = 1
    mamba_conv_kernel: int = 4
    mamba_intermediate_size: int = 0
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    mamba_chunk_size: int = 256
    mamba_norm_eps: float = 1e-6
    # Floor of the discretisation step softplus(dt + dt_bias) (NemotronH clamps it at
    # time_step_min); 0.0 = no floor.
    mamba_dt_min: float = 0.0
    mamba_norm: str = "gate_norm"
    # --- Falcon-H1 muP multipliers (1.0 / () elsewhere) ---
    # Mamba input times mamba_in_multiplier; in_proj output's z | x | B | C | dt sections times
    # the five mamba_proj_multipliers; Mamba output times mamba_out_multiplier.
    mamba_in_multiplier: float = 1.0
    mamba_proj_multipliers: tuple[float, ...] = ()
    mamba_out_multiplier: float = 1.0
    # Attention input / output and its keys (before RoPE) times these.
    attention_in_multiplier: float = 1.0
    attention_out_multiplier: float = 1.0
    key_multiplier: float = 1.0
    # SwiGLU: up * silu(gate * mlp_gate_multiplier), down output times mlp_down_multiplier.
    mlp_gate_multiplier: float = 1.0
    mlp_down_multiplier: float = 1.0
    # --- mixture of experts (moe.py) ---
    # Layers whose MLP is the sparse MoE block (the others keep the dense SwiGLU, if any).
    moe_layer_ids: tuple[int, ...] = ()
    moe_num_experts: int = 0
    moe_top_k: int = 0
    moe_intermediate_size: int = 0
    # "softmax_topk" routing: divide the top-k probabilities by their sum (Qwen3-MoE
    # `norm_topk_prob`). "topk_softmax" weights sum to 1 already and ignore it.
    moe_renormalize: bool = False
    moe_routing: str = "softmax_topk"
    # The MoE layers keep the dense MLP (`mlp_kind`, `intermediate_size`) beside the routed
    # experts, every token through it, outputs summed (Granite's `shared_mlp`).
    moe_shared_mlp: bool = False
    # --- tokens / provenance ---
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    # The HF family this config was read from / is written as (hf_config.SUPPORTED_MODEL_TYPES).
    model_type: str = "llama"

    # ---- derived views -------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """Model layer indices of the attention layers, in order. The k-th entry's KV cache is
        `ForwardBatch.kv_caches[k]`."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in (ATTENTION, PARALLEL))

    @property
    def mamba_layer_ids(self) -> tuple[int, ...]:
        """Model layer indices of the Mamba2 layers, in order. The k-th entry's state pool is
        `ForwardBatch.mamba_states[k]`."""
        return tuple(i for i, t in enumerate(self.layer_types) if t in (MAMBA, PARALLEL))

    @property
    def mixer_mlp(self) -> bool:
        """Whether attention/Mamba layers carry an MLP sub-layer (no separate "mlp" layers)."""
        return self.intermediate_size > 0 and MLP not in self.layer_types

    @property
    def mamba_conv_dim(self) -> int:
        """Channels that go through the conv1d: x, B and C concatenated."""
        return self.mamba_intermediate_size + 2 * self.mamba_n_groups * self.mamba_state_size

    def replace(self, **changes: object) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def validate(self) -> ModelConfig:
        """Raise ValueError naming the first inconsistent field; return self for chaining."""
        n = self.num_layers
        if n == 0:
            raise ValueError("layer_types: a model needs at least one layer")
        for t in self.layer_types:
            if t not in (ATTENTION, MAMBA, MLP, PARALLEL):
                raise ValueError(f"layer_types: unknown layer type {t!r}")
        if MLP in self.layer_types and self.intermediate_size <= 0:
            raise ValueError("intermediate_size: an mlp layer needs intermediate_size > 0")
        if self.mamba_norm not in MAMBA_NORMS:
            raise ValueError(f"mamba_norm: {self.mamba_norm!r} is not one of {MAMBA_NORMS}")
        if len(self.mamba_proj_multipliers) not in (0, 5):
            raise ValueError("mamba_proj_multipliers: want 5 (z, x, B, C, dt) or none")
        if self.mlp_kind not in MLP_KINDS:
            raise ValueError(f"mlp_kind: {self.mlp_kind!r} is not one of {MLP_KINDS}")
        if len(self.sliding_windows) != n:
            raise ValueError(f"sliding_windows: has {len(self.sliding_windows)} entries, want {n}")
        for i, (t, w) in enumerate(zip(self.layer_types, self.sliding_windows)):
            if w < 0 or (w > 0 and t not in (ATTENTION, PARALLEL)):
                raise ValueError(f"sliding_windows[{i}]: {w} is invalid for a {t} layer")
        if self.vocab_size <= 0 or self.hidden_size <= 0:
            raise ValueError("vocab_size/hidden_size: must be positive")
        if self.attention_layer_ids:
            if self.num_heads <= 0 or self.num_kv_heads <= 0 or self.head_dim <= 0:
                raise ValueError("num_heads/num_kv_heads/head_dim: must be positive")
            if self.num_heads % self.num_kv_heads:
                raise ValueError("num_kv_heads: must divide num_heads")
            if self.use_rope and (self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim):
                raise ValueError(f"rotary_dim: {self.rotary_dim} must be even and in (0, head_dim]")
        if self.mamba_layer_ids:
            if self.mamba_num_heads * self.mamba_head_dim != self.mamba_intermediate_size:
                raise ValueError(
                    "mamba_intermediate_size: must equal mamba_num_heads * mamba_head_dim"
                )
            if self.mamba_n_groups <= 0 or self.mamba_num_heads % self.mamba_n_groups:
                raise ValueError("mamba_n_groups: must divide mamba_num_heads")
            if self.mamba_state_size <= 0 or self.mamba_conv_kernel < 2:
                raise ValueError("mamba_state_size/mamba_conv_kernel: must be >0 and >=2")
        self._validate_moe()
        return self

    def _validate_moe(self) -> None:
        ids = self.moe_layer_ids
        if not ids:
            return
        if len(set(ids)) != len(ids) or not all(0 <= i < self.num_layers for i in ids):
            raise ValueError(f"moe_layer_ids: {ids} must be distinct layer ids < {self.num_layers}")
        if self.moe_num_experts <= 0 or self.moe_intermediate_size <= 0:
            raise ValueError("moe_num_experts/moe_intermediate_size: must be positive")
        if not 0 < self.moe_top_k <= self.moe_num_experts:
            raise ValueError(f"moe_top_k: {self.moe_top_k} must be in [1, moe_num_experts]")
        if self.moe_routing not in MOE_ROUTINGS:
            raise ValueError(f"moe_routing: {self.moe_routing!r} is not one of {MOE_ROUTINGS}")
        if self.moe_shared_mlp and self.intermediate_size <= 0:
            raise ValueError("intermediate_size: a shared MLP beside the experts needs one > 0")

    def num_parameters(self) -> int:
        """Parameter count implied by the shapes (tied embeddings counted once)."""
        h = self.hidden_size
        total = self.vocab_size * h * (1 if self.tie_word_embeddings else 2) + h
        inter = self.intermediate_size
        mlp = (2 + (self.mlp_kind != "relu2")) * h * inter
        mlp += ((1 + (self.mlp_kind != "relu2")) * inter + h) * self.mlp_bias
        for i, t in enumerate(self.layer_types):
            total += h  # norm1
            if t == MLP:
                total += mlp
            if t in (ATTENTION, PARALLEL):
                q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
                total += h * (q + 2 * kv) + q * h
                total += (q + 2 * kv) * self.qkv_bias + h * self.o_bias
                total += 2 * self.head_dim * self.qk_norm
            if t in (MAMBA, PARALLEL):
                nh, di, cd = self.mamba_num_heads, self.mamba_intermediate_size, self.mamba_conv_dim
                total += h * (di + cd + nh) + (di + cd + nh) * self.mamba_proj_bias
                total += cd * self.mamba_conv_kernel + cd * self.mamba_conv_bias
                total += 3 * nh + di * (self.mamba_norm != "gate") + di * h
                total += h * self.mamba_proj_bias
            if i in self.moe_layer_ids:
                e = self.moe_num_experts
                total += h + e * h + 3 * e * h * self.moe_intermediate_size
                total += mlp * self.moe_shared_mlp
            elif t != MLP and self.mixer_mlp:
                total += h + mlp
        return total
