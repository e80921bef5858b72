"""Tiny random-weight Hugging Face models of every supported family, written in HF format.

Each model is built by transformers itself from a tiny config with a fixed seed, then its norm
weights, biases and Mamba A_log, D and dt_bias are perturbed (HF initialises them to constants,
which would hide a mix-up between them or a loader that drops one) and saved with
save_pretrained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import pytest

transformers = pytest.importorskip("transformers")

VOCAB = 256
_ATTN = {"num_attention_heads": 4, "num_key_value_heads": 2, "initializer_range": 0.2}
_MAMBA2 = {
    "num_heads": 8,
    "head_dim": 16,
    "state_size": 16,
    "n_groups": 2,
    "expand": 2,
    "conv_kernel": 4,
    "chunk_size": 8,
    "initializer_range": 0.2,
}
_BAMBA = {
    "mamba_n_heads": 8,
    "mamba_d_state": 16,
    "mamba_n_groups": 2,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 8,
    "initializer_range": 0.2,
}

# name -> (config class name, config kwargs). The names are the test ids.
HF_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": (
        "LlamaConfig",
        {**_ATTN, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2},
    ),
    "llama-llama3rope-tied-bias": (
        "LlamaConfig",
        {
            **_ATTN,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "mlp_bias": True,
            "head_dim": 8,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
    ),
    "qwen2-sliding-layer": (
        "Qwen2Config",
        {
            **_ATTN,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "use_sliding_window": True,
            "sliding_window": 6,
            "max_window_layers": 1,
        },
    ),
    "mistral-sliding": (
        "MistralConfig",
        {
            **_ATTN,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "sliding_window": 7,
        },
    ),
    # Qwen3: head_dim 24 != 64 / 4, q/k norms, tied embeddings, one attention_bias for q/k/v/o,
    # the second layer windowed.
    "qwen3-tied-bias-sliding": (
        "Qwen3Config",
        {
            **_ATTN,
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "head_dim": 24,
            "tie_word_embeddings": True,
            "attention_bias": True,
            "use_sliding_window": True,
            "sliding_window": 6,
            "max_window_layers": 1,
        },
    ),
    # Qwen3-MoE: 4 experts top-2 renormalised on layers 0 and 2, layer 1 dense (mlp_only_layers).
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {
            **_ATTN,
            "hidden_size": 64,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 3,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        },
    ),
    # Without renormalisation, the MoE on every second layer only (decoder_sparse_step 2).
    "qwen3_moe-sparse-step": (
        "Qwen3MoeConfig",
        {
            **_ATTN,
            "hidden_size": 64,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_hidden_layers": 2,
            "head_dim": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "decoder_sparse_step": 2,
        },
    ),
    "mamba2": ("Mamba2Config", {**_MAMBA2, "hidden_size": 64, "num_hidden_layers": 2}),
    "bamba": (
        "BambaConfig",
        {
            **_ATTN,
            **_BAMBA,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "attn_layer_indices": [1],
        },
    ),
    # NemotronH: single-mixer blocks (Mamba2, NoPE attention, relu^2 MLP), Mamba and MLP
    # biases on; time_step_min high enough that the dt floor bites on some tokens.
    "nemotron_h": (
        "NemotronHConfig",
        {
            **_ATTN,
            "hidden_size": 64,
            "head_dim": 16,
            "intermediate_size": 96,
            "hybrid_override_pattern": "M*-M",
            "mamba_num_heads": 8,
            "mamba_head_dim": 16,
            "ssm_state_size": 16,
            "n_groups": 2,
            "conv_kernel": 4,
            "chunk_size": 8,
            "use_bias": True,
            "mlp_bias": True,
            "time_step_min": 0.3,
            "layer_norm_epsilon": 1e-5,
        },
    ),
    # Granite 4.0-H dense, with muP multipliers away from 1, RoPE and tied embeddings.
    "granitemoehybrid-rope": (
        "GraniteMoeHybridConfig",
        {
            **_ATTN,
            **_BAMBA,
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "layer_types": ["mamba", "attention", "mamba"],
            "num_local_experts": 0,
            "shared_intermediate_size": 96,
            "position_embedding_type": "rope",
            "embedding_multiplier": 3.0,
            "residual_multiplier": 0.6,
            "attention_multiplier": 0.2,
            "logits_scaling": 2.5,
            "attention_bias": True,
            "tie_word_embeddings": True,
        },
    ),
    # ... and NoPE, as Granite-4.0-H ships.
    "granitemoehybrid-nope": (
        "GraniteMoeHybridConfig",
        {
            **_ATTN,
            **_BAMBA,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "layer_types": ["attention", "mamba"],
            "num_local_experts": 0,
            "shared_intermediate_size": 96,
            "embedding_multiplier": 2.0,
            "residual_multiplier": 0.8,
            "logits_scaling": 1.5,
            "mamba_proj_bias": True,
        },
    ),
    # Granite 4.0-H MoE (Tiny / Small style): every layer's MLP is 6 experts routed top-3
    # (top-k logits, then a softmax over those k) beside the shared MLP; NoPE as they ship,
    # muP multipliers away from 1, attention and Mamba projection biases.
    "granitemoehybrid-moe": (
        "GraniteMoeHybridConfig",
        {
            **_ATTN,
            **_BAMBA,
            "hidden_size": 64,
            "num_hidden_layers": 3,
            "layer_types": ["mamba", "attention", "mamba"],
            "num_local_experts": 6,
            "num_experts_per_tok": 3,
            "intermediate_size": 32,
            "shared_intermediate_size": 48,
            "embedding_multiplier": 2.5,
            "residual_multiplier": 0.7,
            "attention_multiplier": 0.3,
            "logits_scaling": 1.8,
            "attention_bias": True,
            "mamba_proj_bias": True,
        },
    ),
    # Falcon-H1: parallel attention + Mamba2 in every layer, every muP multiplier away from 1,
    # the ungated-norm default (y * silu(z)) ...
    "falcon_h1": (
        "FalconH1Config",
        {
            **_ATTN,
            **_BAMBA,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "mamba_d_ssm": 96,
            "mamba_n_heads": 6,
            "mamba_d_head": 16,
            "embedding_multiplier": 1.7,
            "lm_head_multiplier": 0.4,
            "mlp_multipliers": [0.8, 1.3],
            "key_multiplier": 0.7,
            "attention_in_multiplier": 1.2,
            "attention_out_multiplier": 0.9,
            "ssm_multipliers": [0.5, 1.5, 0.9, 1.1, 0.6],
            "ssm_in_multiplier": 1.4,
            "ssm_out_multiplier": 0.75,
            "mlp_bias": True,
            "attention_bias": True,
        },
    ),
    # ... and its gated group norm, normalising before the gate.
    "falcon_h1-rmsnorm": (
        "FalconH1Config",
        {
            **_ATTN,
            **_BAMBA,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "mamba_rms_norm": True,
            "mamba_norm_before_gate": True,
            "ssm_multipliers": [1.2, 0.8, 1.0, 0.9, 1.1],
            "key_multiplier": 1.3,
            "lm_head_multiplier": 2.0,
        },
    ),
}


def _perturb_(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if p.ndim == 1 and leaf in ("weight", "bias", "D", "A_log", "dt_bias"):
                p.add_(0.2 * torch.randn(p.shape, generator=gen))
            elif leaf in ("gate_up_proj", "down_proj") or name.endswith("mlp.gate.weight"):
                # transformers initialises the router to zeros (every expert tied) and the
                # experts at initializer_range: give them the spread of the other projections.
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def build_hf_model(case: str, path: Path, seed: int = 0, **save_kwargs: Any) -> torch.nn.Module:
    """Build HF model `case` with `seed`, save it to `path` in HF format, return it (eval, fp32)."""
    cls_name, kwargs = HF_CASES[case]
    config = getattr(transformers, cls_name)(vocab_size=VOCAB, **kwargs)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    _perturb_(model, seed)
    model.eval()
    model.save_pretrained(path, **save_kwargs)
    return model


def hf_logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab] fp32 logits of one uncached forward over the whole sequence."""
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=False)
    return out.logits[0].float()
