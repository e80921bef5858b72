"""config.json -> ModelConfig for the hybrid families whose layers are not all attention +
SwiGLU or all Mamba2: nemotron_h, granitemoehybrid (dense and MoE) and falcon_h1. Each parser follows
that family's transformers modeling file and refuses, by field name, what it cannot run."""

from __future__ import annotations

from typing import Any

from compute_service.model.config import ATTENTION, MAMBA, MLP, PARALLEL, ModelConfig
from compute_service.model.hf_config_fields import (
    UnsupportedConfigError,
    _attention_fields,
    _mamba_fields,
    _check_act,
    _check_time_step_limit,
    _common,
    _get,
    _require,
)

# Layer kinds of the hybrid families, in both the transformers v5 spelling and the older one.
_LAYER_KINDS = {
    "linear_attention": MAMBA, "mamba": MAMBA, "M": MAMBA,
    "full_attention": ATTENTION, "attention": ATTENTION, "*": ATTENTION,
    "mlp": MLP, "-": MLP,
}


def _layer_kinds(field: str, values: Any, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """Our layer types of a family's per-layer list (or NemotronH pattern string)."""
    kinds = []
    for i, v in enumerate(values):
        kind = _LAYER_KINDS.get(v)
        if kind not in allowed:
            raise UnsupportedConfigError(
                field, f"layer {i} is {v!r}: {'MoE layers are' if v in ('moe', 'E') else 'that is'}"
                " not supported"
            )
        kinds.append(kind)
    if not kinds:
        raise UnsupportedConfigError(field, "no layers")
    return tuple(kinds)


def nemotron_h(d: dict[str, Any]) -> ModelConfig:
    """NemotronH: blocks of one mixer each (M Mamba2, * attention without positional encoding,
    - relu^2 MLP), each `h += mixer(norm(h))`; transformers' modeling_nemotron_h.py."""
    if d.get("layers_block_type"):
        kinds = _layer_kinds("layers_block_type", d["layers_block_type"], (ATTENTION, MAMBA, MLP))
    else:
        kinds = _layer_kinds(
            "hybrid_override_pattern", _require(d, "hybrid_override_pattern"), (ATTENTION, MAMBA, MLP)
        )
    if _get(d, "mlp_hidden_act", "relu2") != "relu2":
        raise UnsupportedConfigError("mlp_hidden_act", f"{d['mlp_hidden_act']!r} (only 'relu2')")
    _check_act(d, "mamba_hidden_act")
    if int(_get(d, "num_nextn_predict_layers", 0)) > 0:
        raise UnsupportedConfigError("num_nextn_predict_layers", "multi-token prediction layers")
    heads, n = int(_require(d, "mamba_num_heads")), len(kinds)
    head_dim = int(_get(d, "mamba_head_dim", 64))
    eps = float(_get(d, "layer_norm_epsilon", 1e-5))
    alias = lambda new, old, default: _get(d, new, _get(d, old, default))  # noqa: E731
    attn = (
        {
            "num_heads": int(_require(d, "num_attention_heads")),
            "num_kv_heads": int(_get(d, "num_key_value_heads", d["num_attention_heads"])),
            # The config class defaults head_dim to 128, not hidden / heads.
            "head_dim": int(_get(d, "head_dim", 128)),
            "max_position_embeddings": int(_get(d, "max_position_embeddings", 4096)),
        }
        if ATTENTION in kinds
        else {}
    )
    return ModelConfig(
        **_common(d, "nemotron_h"),
        layer_types=kinds,
        # Without "-" blocks the config's intermediate_size sizes nothing.
        intermediate_size=int(_require(d, "intermediate_size")) if MLP in kinds else 0,
        mlp_bias=bool(_get(d, "mlp_bias", False)),
        mlp_kind="relu2",
        rms_norm_eps=eps,
        sliding_windows=(0,) * n,
        use_rope=False,
        **attn,
        mamba_num_heads=heads,
        mamba_head_dim=head_dim,
        mamba_state_size=int(_get(d, "ssm_state_size", 128)),
        mamba_n_groups=int(alias("n_groups", "mamba_n_groups", 8)),
        mamba_conv_kernel=int(alias("conv_kernel", "mamba_d_conv", 4)),
        mamba_intermediate_size=heads * head_dim,
        mamba_conv_bias=bool(alias("use_conv_bias", "mamba_conv_bias", True)),
        mamba_proj_bias=bool(_get(d, "use_bias", False)),
        mamba_chunk_size=int(alias("chunk_size", "mamba_chunk_size", 128)),
        mamba_norm_eps=eps,
        # The mixer clamps softplus(dt + dt_bias) at time_step_min (its time_step_limit field
        # is not read by the modeling code).
        mamba_dt_min=float(alias("time_step_min", "mamba_dt_min", 0.001)),
    ).validate()


def granitemoehybrid(d: dict[str, Any]) -> ModelConfig:
    """Granite 4.0-H: Bamba-style Mamba2/attention layers, each followed by the fused SwiGLU
    `shared_mlp` and, with `num_local_experts` > 0 (Tiny, Small), a sparse MoE block beside it
    (routed by top-k logits then a softmax over those k), with muP multipliers;
    transformers' modeling_granitemoehybrid.py."""
    _check_time_step_limit(d)
    n = int(_require(d, "num_hidden_layers"))
    field = "layer_types" if d.get("layer_types") else "layers_block_type"
    kinds = _layer_kinds(field, d.get(field) or ["mamba"] * n, (ATTENTION, MAMBA))
    if len(kinds) != n:
        raise UnsupportedConfigError(field, f"{len(kinds)} entries for {n} layers")
    pos = d.get("position_embedding_type")
    if pos not in (None, "nope", "rope"):
        raise UnsupportedConfigError("position_embedding_type", f"{pos!r} (supported: rope, nope)")
    if pos == "rope" and float(_get(d, "partial_rotary_factor", 1.0)) != 1.0:
        # Its rotary embedding rotates the whole head whatever this says.
        raise UnsupportedConfigError("partial_rotary_factor", "only 1.0 is supported")
    hidden, expand = int(_require(d, "hidden_size")), int(_get(d, "mamba_expand", 2))
    eps = float(_get(d, "rms_norm_eps", 1e-6))
    bias = bool(_get(d, "attention_bias", False))
    attn = _attention_fields(d, 1.0) if ATTENTION in kinds else {}
    if pos != "rope":
        attn.pop("rope_scaling", None)
    return ModelConfig(
        **_common(d, "granitemoehybrid"),
        layer_types=kinds,
        intermediate_size=int(_get(d, "shared_intermediate_size", 1024)),
        mlp_kind="fused_swiglu",
        rms_norm_eps=eps,
        embedding_multiplier=float(_get(d, "embedding_multiplier", 1.0)),
        residual_multiplier=float(_get(d, "residual_multiplier", 1.0)),
        logits_scaling=float(_get(d, "logits_scaling", 1.0)),
        attention_scale=float(_get(d, "attention_multiplier", 1.0)),
        use_rope=pos == "rope",
        qkv_bias=bias,
        o_bias=bias,
        sliding_windows=(0,) * n,
        **attn,
        **_mamba_fields(d, expand * hidden, eps),
        **_granite_moe(d, n),
    ).validate()


def _granite_moe(d: dict[str, Any], n: int) -> dict[str, Any]:
    """The MoE fields of a granitemoehybrid config: with `num_local_experts` > 0 (the config
    class defaults to 8) every layer has the sparse block, experts of width `intermediate_size`,
    beside the shared MLP of width `shared_intermediate_size`."""
    experts = int(_get(d, "num_local_experts", 8))
    if experts <= 0:
        return {}
    top_k = int(_get(d, "num_experts_per_tok", 2))  # the config class's default
    if not 0 < top_k <= experts:
        raise UnsupportedConfigError("num_experts_per_tok", f"{top_k} must be in [1, {experts}]")
    if int(_get(d, "shared_intermediate_size", 1024)) <= 0:
        # transformers runs a zero-width shared MLP (it adds zeros); no checkpoint has one.
        raise UnsupportedConfigError("shared_intermediate_size", "MoE layers need a shared MLP")
    return {
        "moe_layer_ids": tuple(range(n)),
        "moe_num_experts": experts,
        "moe_top_k": top_k,
        # The config class defaults this to 11008; a config without it is refused, not guessed.
        "moe_intermediate_size": int(_require(d, "intermediate_size")),
        "moe_routing": "topk_softmax",
        "moe_renormalize": True,
        "moe_shared_mlp": True,
    }


def _multipliers(d: dict[str, Any], key: str, n: int) -> tuple[float, ...]:
    values = _get(d, key, [1.0] * n)
    if len(values) != n:
        raise UnsupportedConfigError(key, f"want {n} values, got {len(values)}")
    return tuple(float(v) for v in values)


def falcon_h1(d: dict[str, Any]) -> ModelConfig:
    """Falcon-H1: every layer runs attention and Mamba2 side by side on one normed input, then a
    SwiGLU, with muP multipliers throughout; transformers' modeling_falcon_h1.py."""
    _check_time_step_limit(d)
    if bool(_get(d, "projectors_bias", False)) != bool(_get(d, "mamba_proj_bias", False)):
        # Mamba's out_proj takes its bias from projectors_bias, its in_proj from mamba_proj_bias.
        raise UnsupportedConfigError("projectors_bias", "must equal mamba_proj_bias")
    if float(_get(d, "partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedConfigError("partial_rotary_factor", "only 1.0 is supported")
    hidden, n = int(_require(d, "hidden_size")), int(_require(d, "num_hidden_layers"))
    d_ssm = d.get("mamba_d_ssm")
    inter = int(_get(d, "mamba_expand", 2)) * hidden if d_ssm is None else int(d_ssm)
    eps = float(_get(d, "rms_norm_eps", 1e-5))
    bias = bool(_get(d, "attention_bias", False))
    gate_m, down_m = _multipliers(d, "mlp_multipliers", 2)
    if not _get(d, "mamba_rms_norm", False):
        norm = "gate"
    else:
        norm = "norm_gate" if _get(d, "mamba_norm_before_gate", True) else "gate_norm"
    return ModelConfig(
        **_common(d, "falcon_h1"),
        layer_types=(PARALLEL,) * n,
        intermediate_size=int(_require(d, "intermediate_size")),
        mlp_bias=bool(_get(d, "mlp_bias", False)),
        rms_norm_eps=eps,
        embedding_multiplier=float(_get(d, "embedding_multiplier", 1.0)),
        logits_scaling=1.0 / float(_get(d, "lm_head_multiplier", 1.0)),
        qkv_bias=bias,
        o_bias=bias,
        sliding_windows=(0,) * n,
        **_attention_fields(d, 1.0),
        attention_in_multiplier=float(_get(d, "attention_in_multiplier", 1.0)),
        attention_out_multiplier=float(_get(d, "attention_out_multiplier", 1.0)),
        key_multiplier=float(_get(d, "key_multiplier", 1.0)),
        mlp_gate_multiplier=gate_m,
        mlp_down_multiplier=down_m,
        **_mamba_fields(d, inter, eps),
        mamba_norm=norm,
        mamba_in_multiplier=float(_get(d, "ssm_in_multiplier", 1.0)),
        mamba_proj_multipliers=_multipliers(d, "ssm_multipliers", 5),
        mamba_out_multiplier=float(_get(d, "ssm_out_multiplier", 1.0)),
    ).validate()
