"""ModelConfig -> Hugging Face `config.json` of its `model_type` family (the inverse of
`hf_config.config_from_hf`), refusing configs the family cannot express."""

from __future__ import annotations

from typing import Any

from compute_service.model.config import ATTENTION, MAMBA, MLP, PARALLEL, ModelConfig
from compute_service.model.hf_config import SUPPORTED_MODEL_TYPES, UnsupportedConfigError

_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mistral": "MistralForCausalLM",
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "nemotron_h": "NemotronHForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "falcon_h1": "FalconH1ForCausalLM",
}
_PATTERN = {MAMBA: "M", ATTENTION: "*", MLP: "-"}
# Options only some families have: (field, its neutral value, the families that may set it).
_FAMILY_OPTIONS = (
    ("mlp_kind", "swiglu", {"nemotron_h": "relu2", "granitemoehybrid": "fused_swiglu"}),
    ("embedding_multiplier", 1.0, {"granitemoehybrid": None, "falcon_h1": None}),
    ("residual_multiplier", 1.0, {"granitemoehybrid": None}),
    ("logits_scaling", 1.0, {"granitemoehybrid": None, "falcon_h1": None}),
    ("attention_scale", 0.0, {"granitemoehybrid": None}),
    ("use_rope", True, {"granitemoehybrid": None, "nemotron_h": False}),
    ("mamba_dt_min", 0.0, {"nemotron_h": None}),
    ("mamba_norm", "gate_norm", {"falcon_h1": None}),
    ("mamba_in_multiplier", 1.0, {"falcon_h1": None}),
    ("mamba_proj_multipliers", (), {"falcon_h1": None}),
    ("mamba_out_multiplier", 1.0, {"falcon_h1": None}),
    ("attention_in_multiplier", 1.0, {"falcon_h1": None}),
    ("attention_out_multiplier", 1.0, {"falcon_h1": None}),
    ("key_multiplier", 1.0, {"falcon_h1": None}),
    ("mlp_gate_multiplier", 1.0, {"falcon_h1": None}),
    ("mlp_down_multiplier", 1.0, {"falcon_h1": None}),
    ("moe_routing", "softmax_topk", {"granitemoehybrid": None}),
    ("moe_shared_mlp", False, {"granitemoehybrid": None}),
)


def _unrepresentable(field: str, model_type: str, why: str) -> UnsupportedConfigError:
    return UnsupportedConfigError(field, f"cannot be written as model_type {model_type!r}: {why}")


def _rope_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    params: dict[str, Any] = {"rope_theta": cfg.rope_theta, "rope_type": "default"}
    legacy: dict[str, Any] = {"rope_theta": cfg.rope_theta}
    if cfg.rotary_dim != cfg.head_dim:
        params["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        scaling: dict[str, Any] = {"rope_type": s.kind, "factor": s.factor}
        if s.kind == "llama3":
            scaling |= {
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }
        params |= scaling
        legacy["rope_scaling"] = scaling
    # v5 reads rope_parameters; v4 reads the legacy top-level keys. Writing both serves both.
    return {"rope_parameters": params, **legacy}


def _attention_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "intermediate_size": cfg.intermediate_size,
        **_rope_to_hf(cfg),
    }


def _qwen3_moe_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """MoE layers as `mlp_only_layers` (the others) with decoder_sparse_step 1."""
    experts = cfg.moe_num_experts if cfg.moe_layer_ids else 0
    return {
        "attention_bias": cfg.qkv_bias,
        "num_experts": experts,
        "num_experts_per_tok": cfg.moe_top_k if experts else 1,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "norm_topk_prob": cfg.moe_renormalize,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [i for i in range(cfg.num_layers) if i not in cfg.moe_layer_ids],
        "use_sliding_window": False,
    }


_TRANSFORMER_TYPES = ("llama", "qwen2", "mistral", "qwen3", "qwen3_moe")


def _transformer_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    mt = cfg.model_type
    out = _attention_to_hf(cfg)
    windows = sorted({w for w in cfg.sliding_windows if w})
    if mt == "llama":
        out |= {"attention_bias": cfg.qkv_bias, "mlp_bias": cfg.mlp_bias}
    elif mt == "qwen3_moe":
        out |= _qwen3_moe_to_hf(cfg)
    elif mt == "mistral":
        out["sliding_window"] = windows[0] if windows else None
    else:
        if mt == "qwen3":
            out["attention_bias"] = cfg.qkv_bias
        sliding = [w > 0 for w in cfg.sliding_windows]
        out |= {
            "use_sliding_window": bool(windows),
            "sliding_window": windows[0] if windows else None,
            "max_window_layers": sliding.index(True) if windows else cfg.num_layers,
            "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding],
        }
    return out


def _check_family_options(cfg: ModelConfig) -> None:
    """Each family-specific option holds its neutral value, or the value its family needs
    (None: any value the family can write)."""
    mt = cfg.model_type
    for field, neutral, families in _FAMILY_OPTIONS:
        value = getattr(cfg, field)
        if mt in families:
            want = families[mt]
            if want is not None and value != want:
                raise _unrepresentable(field, mt, f"needs {want!r}")
        elif value != neutral:
            raise _unrepresentable(field, mt, f"needs {neutral!r}")
    if MLP in cfg.layer_types and mt != "nemotron_h":
        raise _unrepresentable("layer_types", mt, "no separate mlp layers")
    if (PARALLEL in cfg.layer_types) != (mt == "falcon_h1") or (
        mt == "falcon_h1" and set(cfg.layer_types) != {PARALLEL}
    ):
        raise _unrepresentable("layer_types", mt, "parallel layers are falcon_h1's, all of them")


def _check_hybrid_writable(cfg: ModelConfig) -> None:
    mt = cfg.model_type
    if {w for w in cfg.sliding_windows if w} or cfg.mamba_norm_eps != cfg.rms_norm_eps:
        raise _unrepresentable("sliding_windows/mamba_norm_eps", mt, "no window, one eps")
    if mt == "nemotron_h" and (cfg.qkv_bias or cfg.o_bias or cfg.residual_in_fp32):
        raise _unrepresentable("qkv_bias/o_bias/residual_in_fp32", mt, "all False")
    if mt == "falcon_h1" and (
        cfg.qkv_bias != cfg.o_bias
        or not cfg.intermediate_size
        or cfg.rotary_dim != cfg.head_dim
        or cfg.head_dim * cfg.num_heads != cfg.hidden_size
    ):
        raise _unrepresentable("qkv_bias/rotary_dim/head_dim", mt, "one bias, full rotary, hidden/heads")
    if mt == "granitemoehybrid":
        if cfg.qkv_bias != cfg.o_bias or MLP in cfg.layer_types or not cfg.intermediate_size:
            raise _unrepresentable("qkv_bias/intermediate_size", mt, "one bias, MLP everywhere")
        if cfg.mamba_intermediate_size % cfg.hidden_size or (
            cfg.use_rope and cfg.rotary_dim != cfg.head_dim
        ):
            raise _unrepresentable("mamba_intermediate_size/rotary_dim", mt, "integer expand, full rotary")
        moe = bool(cfg.moe_layer_ids)
        if moe and (
            cfg.moe_layer_ids != tuple(range(cfg.num_layers))
            or cfg.moe_routing != "topk_softmax"
            or not cfg.moe_renormalize
        ) or cfg.moe_shared_mlp != moe:
            raise _unrepresentable(
                "moe_layer_ids/moe_routing/moe_shared_mlp", mt,
                "none, or every layer routed by topk_softmax beside the shared MLP",
            )


def _check_writable(cfg: ModelConfig) -> None:
    mt = cfg.model_type
    kinds = set(cfg.layer_types)
    windows = {w for w in cfg.sliding_windows if w}
    _check_family_options(cfg)
    if mt in ("nemotron_h", "granitemoehybrid", "falcon_h1"):
        _check_hybrid_writable(cfg)
    if mt in _TRANSFORMER_TYPES:
        if kinds != {ATTENTION}:
            raise _unrepresentable("layer_types", mt, "needs attention layers only")
        if cfg.intermediate_size <= 0:
            raise _unrepresentable("intermediate_size", mt, "needs an MLP")
        if cfg.rotary_dim != cfg.head_dim:
            raise _unrepresentable("rotary_dim", mt, "needs rotary_dim == head_dim")
    if mt == "llama" and (windows or cfg.qkv_bias != cfg.o_bias):
        raise _unrepresentable(
            "sliding_windows/qkv_bias", mt, "no sliding window, one attention_bias"
        )
    if mt == "mistral" and (
        cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or len(set(cfg.sliding_windows)) != 1
    ):
        raise _unrepresentable(
            "sliding_windows/qkv_bias", mt, "no biases, one window for all layers"
        )
    if mt == "qwen2" and (not cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or len(windows) > 1):
        raise _unrepresentable(
            "qkv_bias/o_bias/sliding_windows", mt, "qkv bias only, one window value"
        )
    moe_families = ("qwen3_moe", "granitemoehybrid")
    if (mt in ("qwen3", "qwen3_moe")) != cfg.qk_norm or (mt not in moe_families and cfg.moe_layer_ids):
        raise _unrepresentable(
            "qk_norm/moe_layer_ids", mt, "qk_norm is Qwen3's, MoE qwen3_moe's and granitemoehybrid's"
        )
    if mt in ("qwen3", "qwen3_moe") and (cfg.qkv_bias != cfg.o_bias or cfg.mlp_bias):
        raise _unrepresentable("qkv_bias/o_bias/mlp_bias", mt, "one attention_bias, no MLP bias")
    if (mt == "qwen3_moe" and windows) or (mt == "qwen3" and len(windows) > 1):
        raise _unrepresentable("sliding_windows", mt, "qwen3: one window value; qwen3_moe: none")
    if mt == "mamba2":
        if kinds != {MAMBA} or cfg.intermediate_size:
            raise _unrepresentable("layer_types", mt, "needs Mamba2 layers only and no MLP")
        if cfg.mamba_intermediate_size % cfg.hidden_size or cfg.mamba_norm_eps != cfg.rms_norm_eps:
            raise _unrepresentable(
                "mamba_intermediate_size/mamba_norm_eps", mt, "integer expand, one eps"
            )
    if mt == "bamba":
        if cfg.intermediate_size <= 0 or windows or cfg.qkv_bias != cfg.o_bias:
            raise _unrepresentable(
                "intermediate_size/sliding_windows", mt, "MLP everywhere, no window"
            )
        if cfg.attention_layer_ids and (
            cfg.head_dim * cfg.num_heads != cfg.hidden_size or cfg.rotary_dim != cfg.head_dim // 2
        ):
            raise _unrepresentable(
                "head_dim/rotary_dim", mt, "head_dim = hidden/heads, rotary = head_dim/2"
            )
        if cfg.mamba_intermediate_size % cfg.hidden_size or cfg.mamba_norm_eps != cfg.rms_norm_eps:
            raise _unrepresentable(
                "mamba_intermediate_size/mamba_norm_eps", mt, "integer expand, one eps"
            )
    if mt not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfigError(
            "model_type", f"{mt!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
        )


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json dict of `cfg` in its `model_type` family; raises UnsupportedConfigError if
    `cfg` uses a feature that family cannot express."""
    _check_writable(cfg)
    mt = cfg.model_type
    eos: int | list[int] | None = (
        list(cfg.eos_token_ids)
        if len(cfg.eos_token_ids) > 1
        else (cfg.eos_token_ids[0] if cfg.eos_token_ids else None)
    )
    out: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[mt]],
        "model_type": mt,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": eos,
        "pad_token_id": cfg.pad_token_id,
    }
    if mt in _TRANSFORMER_TYPES:
        out |= _transformer_to_hf(cfg)
    elif mt == "nemotron_h":
        out |= _nemotron_h_to_hf(cfg)
    elif mt == "granitemoehybrid":
        out |= _granitemoehybrid_to_hf(cfg)
    elif mt == "falcon_h1":
        out |= _falcon_h1_to_hf(cfg)
    elif mt == "mamba2":
        out |= {
            "num_heads": cfg.mamba_num_heads,
            "head_dim": cfg.mamba_head_dim,
            "state_size": cfg.mamba_state_size,
            "n_groups": cfg.mamba_n_groups,
            "conv_kernel": cfg.mamba_conv_kernel,
            "expand": cfg.mamba_intermediate_size // cfg.hidden_size,
            "use_bias": cfg.mamba_proj_bias,
            "use_conv_bias": cfg.mamba_conv_bias,
            "chunk_size": cfg.mamba_chunk_size,
            "layer_norm_epsilon": cfg.rms_norm_eps,
            "residual_in_fp32": cfg.residual_in_fp32,
        }
    else:
        out |= _bamba_to_hf(cfg)
    return out


def _nemotron_h_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    return {
        # Read by transformers v4 and v5 alike (v5 turns it into layers_block_type).
        "hybrid_override_pattern": "".join(_PATTERN[t] for t in cfg.layer_types),
        "num_attention_heads": cfg.num_heads or 1,
        "num_key_value_heads": cfg.num_kv_heads or 1,
        "head_dim": cfg.head_dim or 1,
        "max_position_embeddings": cfg.max_position_embeddings,
        "intermediate_size": cfg.intermediate_size,
        "mlp_hidden_act": "relu2",
        "mlp_bias": cfg.mlp_bias,
        "mamba_hidden_act": "silu",
        "mamba_num_heads": cfg.mamba_num_heads,
        "mamba_head_dim": cfg.mamba_head_dim,
        "ssm_state_size": cfg.mamba_state_size,
        "n_groups": cfg.mamba_n_groups,
        "conv_kernel": cfg.mamba_conv_kernel,
        "use_conv_bias": cfg.mamba_conv_bias,
        "use_bias": cfg.mamba_proj_bias,
        "chunk_size": cfg.mamba_chunk_size,
        "layer_norm_epsilon": cfg.rms_norm_eps,
        "time_step_min": cfg.mamba_dt_min,
        "residual_in_fp32": False,
        "attention_bias": False,
    }


def _granitemoehybrid_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = (
        _attention_to_hf(cfg)
        if cfg.attention_layer_ids
        else {"num_attention_heads": 1, "num_key_value_heads": 1, "rms_norm_eps": cfg.rms_norm_eps}
    )
    out.pop("head_dim", None)  # the attention derives it from hidden_size / num_attention_heads
    if cfg.attention_layer_ids and cfg.head_dim * cfg.num_heads != cfg.hidden_size:
        raise _unrepresentable("head_dim", "granitemoehybrid", "head_dim = hidden / heads")
    return out | {
        "layer_types": ["attention" if t == ATTENTION else "mamba" for t in cfg.layer_types],
        "position_embedding_type": "rope" if cfg.use_rope else "nope",
        "num_local_experts": cfg.moe_num_experts if cfg.moe_layer_ids else 0,
        "num_experts_per_tok": cfg.moe_top_k if cfg.moe_layer_ids else 1,
        # The experts' width; the dense variant reads only shared_intermediate_size.
        "intermediate_size": cfg.moe_intermediate_size if cfg.moe_layer_ids else cfg.intermediate_size,
        "shared_intermediate_size": cfg.intermediate_size,
        "attention_bias": cfg.qkv_bias,
        "embedding_multiplier": cfg.embedding_multiplier,
        "residual_multiplier": cfg.residual_multiplier,
        "logits_scaling": cfg.logits_scaling,
        "attention_multiplier": cfg.attention_scale or (cfg.head_dim**-0.5 if cfg.head_dim else 1.0),
        **_mamba_to_hf(cfg),
        "mamba_expand": cfg.mamba_intermediate_size // cfg.hidden_size,
    }


def _mamba_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The Mamba2 mixer as the Bamba-derived configs name it (the inverse of
    hf_config_fields._mamba_fields, but for its inner width: `mamba_expand` or `mamba_d_ssm`)."""
    return {
        "mamba_n_heads": cfg.mamba_num_heads,
        "mamba_d_head": cfg.mamba_head_dim,
        "mamba_n_groups": cfg.mamba_n_groups,
        "mamba_d_state": cfg.mamba_state_size,
        "mamba_d_conv": cfg.mamba_conv_kernel,
        "mamba_chunk_size": cfg.mamba_chunk_size,
        "mamba_conv_bias": cfg.mamba_conv_bias,
        "mamba_proj_bias": cfg.mamba_proj_bias,
    }


def _bamba_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if cfg.attention_layer_ids:
        out |= _attention_to_hf(cfg)
    else:
        out |= {
            "num_attention_heads": 1,
            "num_key_value_heads": 1,
            "rms_norm_eps": cfg.rms_norm_eps,
            "intermediate_size": cfg.intermediate_size,
        }
    out.pop("head_dim", None)  # BambaConfig derives it from hidden_size / num_attention_heads.
    out |= {
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": cfg.mlp_bias,
        "attn_layer_indices": list(cfg.attention_layer_ids),
        **_mamba_to_hf(cfg),
        "mamba_expand": cfg.mamba_intermediate_size // cfg.hidden_size,
    }
    return out


def _falcon_h1_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    out = _attention_to_hf(cfg)
    out.pop("head_dim", None)  # its decoder layer derives it from hidden_size / heads
    return out | {
        "attention_bias": cfg.qkv_bias,
        "mlp_bias": cfg.mlp_bias,
        "mamba_d_ssm": cfg.mamba_intermediate_size,
        **_mamba_to_hf(cfg),
        "projectors_bias": cfg.mamba_proj_bias,
        "mamba_rms_norm": cfg.mamba_norm != "gate",
        "mamba_norm_before_gate": cfg.mamba_norm == "norm_gate",
        "embedding_multiplier": cfg.embedding_multiplier,
        "lm_head_multiplier": 1.0 / cfg.logits_scaling,
        "mlp_multipliers": [cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier],
        "key_multiplier": cfg.key_multiplier,
        "attention_in_multiplier": cfg.attention_in_multiplier,
        "attention_out_multiplier": cfg.attention_out_multiplier,
        "ssm_multipliers": list(cfg.mamba_proj_multipliers or (1.0,) * 5),
        "ssm_in_multiplier": cfg.mamba_in_multiplier,
        "ssm_out_multiplier": cfg.mamba_out_multiplier,
    }
