"""config.json parsing: supported layouts, and errors that name the unsupported field."""

from __future__ import annotations

import math
from typing import Any

import pytest

from compute_service.model import (
    ATTENTION,
    MAMBA,
    MLP,
    UnsupportedConfigError,
    config_from_hf,
    config_to_hf,
    preset_config,
)

LLAMA: dict[str, Any] = {
    "model_type": "llama",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-5,
}
MAMBA2: dict[str, Any] = {
    "model_type": "mamba2",
    "vocab_size": 300,
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_heads": 8,
    "head_dim": 16,
    "state_size": 16,
    "n_groups": 2,
    "expand": 2,
}
NEMOTRON_H: dict[str, Any] = {
    "model_type": "nemotron_h",
    "vocab_size": 300,
    "hidden_size": 64,
    "hybrid_override_pattern": "M-M*-",
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "mamba_num_heads": 8,
    "mamba_head_dim": 16,
    "ssm_state_size": 16,
    "n_groups": 2,
}
GRANITE_H: dict[str, Any] = {
    "model_type": "granitemoehybrid",
    "vocab_size": 300,
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "layer_types": ["mamba", "attention", "mamba"],
    "num_attention_heads": 4,
    "num_local_experts": 0,
    "shared_intermediate_size": 96,
    "mamba_n_heads": 8,
    "mamba_d_state": 16,
}
GRANITE_H_MOE: dict[str, Any] = {
    **GRANITE_H,
    "num_local_experts": 8,
    "num_experts_per_tok": 3,
    "intermediate_size": 32,
}

QWEN3: dict[str, Any] = {**LLAMA, "model_type": "qwen3"}
QWEN3_MOE: dict[str, Any] = {
    **QWEN3,
    "model_type": "qwen3_moe",
    "num_hidden_layers": 3,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
}


def test_qwen3_head_dim_defaults_to_128_and_one_bias_flag() -> None:
    cfg = config_from_hf(QWEN3)
    assert cfg.head_dim == cfg.rotary_dim == 128 and cfg.qk_norm
    assert not (cfg.qkv_bias or cfg.o_bias) and cfg.moe_layer_ids == ()
    cfg = config_from_hf({**QWEN3, "head_dim": 24, "attention_bias": True})
    assert cfg.head_dim == 24 and cfg.qkv_bias and cfg.o_bias


@pytest.mark.parametrize(
    ("fields", "moe_layers"),
    [
        ({}, (0, 1, 2)),
        ({"mlp_only_layers": [1]}, (0, 2)),
        ({"decoder_sparse_step": 2}, (1,)),
        ({"decoder_sparse_step": 2, "mlp_only_layers": [1]}, ()),
        ({"num_experts": 0}, ()),
    ],
)
def test_qwen3_moe_layers_follow_transformers_rule(fields: dict, moe_layers: tuple) -> None:
    """Layer i is sparse iff i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0."""
    cfg = config_from_hf({**QWEN3_MOE, **fields})
    assert cfg.moe_layer_ids == moe_layers and cfg.qk_norm
    if moe_layers:
        assert (cfg.moe_num_experts, cfg.moe_top_k, cfg.moe_intermediate_size) == (8, 2, 32)
        assert not cfg.moe_renormalize
    # transformers v5 writes num_local_experts and norm_topk_prob; read both.
    v5 = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"}
    cfg = config_from_hf({**v5, "num_local_experts": 4, "norm_topk_prob": True})
    assert cfg.moe_num_experts == 4 and cfg.moe_renormalize


def test_transformers_v4_layout_with_linear_rope_scaling() -> None:
    cfg = config_from_hf(
        {
            **LLAMA,
            "rope_theta": 500000.0,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "eos_token_id": [2, 7],
        }
    )
    assert (
        cfg.rope_theta == 500000.0
        and cfg.rope_scaling.kind == "linear"
        and cfg.rope_scaling.factor == 2.0
    )
    assert cfg.head_dim == 16 and cfg.rotary_dim == 16 and cfg.eos_token_ids == (2, 7)
    assert cfg.layer_types == (ATTENTION, ATTENTION) and cfg.sliding_windows == (0, 0)


def test_mistral_window_and_qwen2_per_layer_window() -> None:
    mistral = config_from_hf({**LLAMA, "model_type": "mistral", "sliding_window": 64})
    assert mistral.sliding_windows == (64, 64)
    assert config_from_hf(
        {**LLAMA, "model_type": "mistral", "sliding_window": None}
    ).sliding_windows == (0, 0)
    qwen = config_from_hf(
        {
            **LLAMA,
            "model_type": "qwen2",
            "use_sliding_window": True,
            "sliding_window": 8,
            "max_window_layers": 1,
        }
    )
    assert qwen.sliding_windows == (0, 8) and qwen.qkv_bias and not qwen.o_bias
    # use_sliding_window false disables the window, as in transformers.
    assert config_from_hf(
        {**LLAMA, "model_type": "qwen2", "sliding_window": 8}
    ).sliding_windows == (0, 0)


def test_bamba_pattern_and_partial_rotary() -> None:
    cfg = config_from_hf(
        {
            **LLAMA,
            "model_type": "bamba",
            "num_hidden_layers": 4,
            "attn_layer_indices": [1, 3],
            "mamba_n_heads": 8,
            "mamba_d_state": 16,
            "mamba_d_head": "auto",
            "time_step_limit": [0.0, {"__float__": "Infinity"}],
        }
    )
    assert cfg.layer_types == (MAMBA, ATTENTION, MAMBA, ATTENTION)
    assert cfg.rotary_dim == 8 and cfg.mamba_head_dim == 16 and cfg.mamba_norm_eps == 1e-5


def test_mamba2_accepts_a_bare_infinity_limit() -> None:
    cfg = config_from_hf({**MAMBA2, "time_step_limit": [0.0, math.inf]})
    assert (
        cfg.residual_in_fp32 and cfg.intermediate_size == 0 and cfg.mamba_intermediate_size == 128
    )

FALCON_H1: dict[str, Any] = {
    "model_type": "falcon_h1",
    "vocab_size": 300,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mamba_n_heads": 8,
    "mamba_d_state": 16,
    "ssm_multipliers": [1.0, 2.0, 3.0, 4.0, 5.0],
    "lm_head_multiplier": 0.5,
}


def test_falcon_h1_parallel_layers_and_multipliers() -> None:
    cfg = config_from_hf(FALCON_H1)
    assert cfg.attention_layer_ids == cfg.mamba_layer_ids == (0, 1)
    assert (cfg.mamba_proj_multipliers, cfg.logits_scaling, cfg.mamba_norm) == (
        (1.0, 2.0, 3.0, 4.0, 5.0), 2.0, "gate")
    assert config_from_hf({**FALCON_H1, "mamba_rms_norm": True}).mamba_norm == "norm_gate"
    assert config_from_hf(
        {**FALCON_H1, "mamba_rms_norm": True, "mamba_norm_before_gate": False}
    ).mamba_norm == "gate_norm"
    assert config_from_hf({**FALCON_H1, "mamba_d_ssm": 96}).mamba_intermediate_size == 96


def test_nemotron_h_blocks_and_granite_multipliers() -> None:
    nh = config_from_hf(NEMOTRON_H)
    assert nh.layer_types == (MAMBA, MLP, MAMBA, ATTENTION, MLP)
    assert (nh.mlp_kind, nh.use_rope, nh.mixer_mlp, nh.mamba_dt_min) == ("relu2", False, False, 1e-3)
    v5 = {**NEMOTRON_H, "layers_block_type": ["linear_attention", "full_attention"]}
    assert config_from_hf(v5).layer_types == (MAMBA, ATTENTION)
    assert config_from_hf({**v5, "layers_block_type": ["linear_attention"]}).intermediate_size == 0
    g = config_from_hf({**GRANITE_H, "embedding_multiplier": 12.0, "attention_multiplier": 0.1})
    assert (g.embedding_multiplier, g.attention_scale, g.use_rope, g.mixer_mlp) == (
        12.0, 0.1, False, True)
    assert config_from_hf({**GRANITE_H, "position_embedding_type": "rope"}).use_rope


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({**NEMOTRON_H, "hybrid_override_pattern": "M*E"}, "hybrid_override_pattern"),
        ({**NEMOTRON_H, "layers_block_type": ["moe"]}, "layers_block_type"),
        ({**NEMOTRON_H, "mlp_hidden_act": "gelu"}, "mlp_hidden_act"),
        ({**NEMOTRON_H, "mamba_hidden_act": "gelu"}, "mamba_hidden_act"),
        ({**NEMOTRON_H, "num_nextn_predict_layers": 1}, "num_nextn_predict_layers"),
        # Without num_local_experts the config class's 8 experts need their width.
        ({k: v for k, v in GRANITE_H.items() if k != "num_local_experts"}, "intermediate_size"),
        ({**GRANITE_H_MOE, "num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({**GRANITE_H_MOE, "num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({**GRANITE_H_MOE, "shared_intermediate_size": 0}, "shared_intermediate_size"),
        ({**GRANITE_H_MOE, "num_experts": 8}, "num_experts"),  # not a field Granite reads
        ({**GRANITE_H, "position_embedding_type": "alibi"}, "position_embedding_type"),
        (
            {**GRANITE_H, "position_embedding_type": "rope", "partial_rotary_factor": 0.5},
            "partial_rotary_factor",
        ),
        ({**GRANITE_H, "time_step_limit": [0.0, 0.1]}, "time_step_limit"),
        ({**GRANITE_H, "layer_types": ["mamba"]}, "layer_types"),
        ({**GRANITE_H, "hidden_act": "gelu"}, "hidden_act"),
        ({**FALCON_H1, "projectors_bias": True}, "projectors_bias"),
        ({**FALCON_H1, "ssm_multipliers": [1.0, 2.0]}, "ssm_multipliers"),
        ({**FALCON_H1, "mlp_multipliers": [1.0]}, "mlp_multipliers"),
        ({**FALCON_H1, "partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({**FALCON_H1, "time_step_limit": [0.0, 1.0]}, "time_step_limit"),
        ({**FALCON_H1, "num_experts": 4}, "num_experts"),
    ],
)
def test_hybrid_family_refusals_name_the_field(config: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedConfigError) as err:
        config_from_hf(config)
    assert err.value.field == field and str(err.value).startswith(field)


def test_granite_moe_routes_every_layer_beside_the_shared_mlp() -> None:
    """num_local_experts > 0: every layer is sparse, experts of width intermediate_size, top-k
    logits then softmax, the dense shared MLP (shared_intermediate_size) kept beside them."""
    g = config_from_hf(GRANITE_H_MOE)
    assert g.moe_layer_ids == (0, 1, 2) and (g.moe_num_experts, g.moe_top_k) == (8, 3)
    assert (g.moe_intermediate_size, g.intermediate_size, g.mlp_kind) == (32, 96, "fused_swiglu")
    assert (g.moe_routing, g.moe_shared_mlp) == ("topk_softmax", True)
    # The config class's defaults: 8 experts, 2 per token.
    defaults = {k: v for k, v in GRANITE_H_MOE.items()
                if k not in ("num_local_experts", "num_experts_per_tok")}
    assert (config_from_hf(defaults).moe_num_experts, config_from_hf(defaults).moe_top_k) == (8, 2)
    dense = config_from_hf(GRANITE_H)
    assert (dense.moe_layer_ids, dense.moe_shared_mlp) == ((), False)


@pytest.mark.parametrize("config", [NEMOTRON_H, GRANITE_H, GRANITE_H_MOE, FALCON_H1])
def test_hybrid_family_configs_round_trip(config: dict[str, Any]) -> None:
    cfg = config_from_hf(config)
    assert config_from_hf(config_to_hf(cfg)) == cfg


@pytest.mark.parametrize(
    ("config", "field"),
    [
        ({**LLAMA, "model_type": "gpt2"}, "model_type"),
        ({**LLAMA, "hidden_act": "gelu"}, "hidden_act"),
        (
            {**LLAMA, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "rope_parameters.rope_type",
        ),
        ({**LLAMA, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_scaling.rope_type"),
        ({**LLAMA, "quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ({k: v for k, v in LLAMA.items() if k != "intermediate_size"}, "intermediate_size"),
        ({**MAMBA2, "time_step_limit": [0.0, 0.1]}, "time_step_limit"),
        ({**LLAMA, "num_local_experts": 8}, "num_local_experts"),  # a MoE llama (Mixtral-like)
        ({**QWEN3_MOE, "use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
        ({**QWEN3_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({**QWEN3_MOE, "mlp_only_layers": [3]}, "mlp_only_layers"),
        ({**QWEN3_MOE, "num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({**QWEN3_MOE, "moe_intermediate_size": None}, "moe_intermediate_size"),
        ({**QWEN3_MOE, "hidden_act": "gelu"}, "hidden_act"),
        ({**QWEN3, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type"),
        ({**MAMBA2, "norm_before_gate": True}, "norm_before_gate"),
        (
            {
                **MAMBA2,
                "model_type": "bamba",
                "intermediate_size": 64,
                "attn_layer_indices": [5],
                "num_attention_heads": 4,
                "mamba_n_heads": 8,
            },
            "attn_layer_indices",
        ),
    ],
)
def test_unsupported_field_is_named(config: dict[str, Any], field: str) -> None:
    with pytest.raises(UnsupportedConfigError) as err:
        config_from_hf(config)
    assert err.value.field == field and str(err.value).startswith(field)


@pytest.mark.parametrize(
    "name", ["tiny-transformer", "tiny-sliding", "tiny-mamba2", "tiny-hybrid", "tiny-moe"]
)
def test_config_round_trips_through_hf_dict(name: str) -> None:
    cfg = preset_config(name)
    assert config_from_hf(config_to_hf(cfg)) == cfg


def test_invalid_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        preset_config("tiny-transformer").replace(num_kv_heads=3).validate()
    with pytest.raises(ValueError, match=r"sliding_windows\[0\]"):
        preset_config("tiny-hybrid").replace(sliding_windows=(8, 0, 0, 0)).validate()
