"""Hugging Face `config.json` <-> ModelConfig, for the families listed in README.md.

Reading is tolerant of fields that do not change inference (initializer ranges, dropout,
`use_cache`, ...) and strict about fields whose value we cannot honour: those raise
`UnsupportedConfigError` naming the field. Both the transformers v4 layout (`rope_theta`,
`rope_scaling`) and the v5 layout (`rope_parameters`) are read.
"""

from __future__ import annotations

import math
from typing import Any

from compute_service.model.config import ATTENTION, MAMBA, MLP, ModelConfig, RopeScaling

SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "mistral", "mamba2", "bamba", "nemotron_h", "granitemoehybrid"
)


class UnsupportedConfigError(ValueError):
    """A config.json field has a value this implementation cannot run; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _get(d: dict[str, Any], key: str, default: Any = None) -> Any:
    value = d.get(key, default)
    return default if value is None else value


def _require(d: dict[str, Any], key: str) -> Any:
    if d.get(key) is None:
        raise UnsupportedConfigError(key, "required field is missing")
    return d[key]


def _eos_ids(d: dict[str, Any]) -> tuple[int, ...]:
    eos = d.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def _check_act(d: dict[str, Any], key: str = "hidden_act") -> None:
    if _get(d, key, "silu") not in ("silu", "swish"):
        raise UnsupportedConfigError(key, f"{d[key]!r} is not supported (only 'silu')")


def _as_float(value: Any) -> float:
    # transformers v5 serialises inf as {"__float__": "Infinity"}; v4 as a bare Infinity.
    if isinstance(value, dict) and "__float__" in value:
        return float(value["__float__"])
    return float(value)


def _check_time_step_limit(d: dict[str, Any]) -> None:
    limit = d.get("time_step_limit")
    if limit is None:
        return
    lo, hi = (_as_float(v) for v in limit)
    if lo != 0.0 or not math.isinf(hi):
        # The scan kernels apply softplus(dt + dt_bias) without a clamp.
        raise UnsupportedConfigError(
            "time_step_limit", f"only (0.0, inf) is supported, got {limit!r}"
        )


def _rope(d: dict[str, Any], head_dim: int, default_partial: float) -> dict[str, Any]:
    """rope_theta, rotary_dim and rope_scaling from either config layout."""
    params = dict(d.get("rope_parameters") or {})
    legacy = dict(d.get("rope_scaling") or {})
    field_name = "rope_parameters" if params else "rope_scaling"
    scaling = {**legacy, **params}
    theta = float(_get(params, "rope_theta", _get(d, "rope_theta", 10000.0)))
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    partial = float(
        _get(params, "partial_rotary_factor", _get(d, "partial_rotary_factor", default_partial))
    )
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or rotary_dim <= 0:
        raise UnsupportedConfigError(
            "partial_rotary_factor", f"gives odd/empty rotary dim {rotary_dim}"
        )
    rope_scaling: RopeScaling | None
    if kind == "default":
        rope_scaling = None
    elif kind == "linear":
        rope_scaling = RopeScaling("linear", float(scaling["factor"]))
    elif kind == "llama3":
        rope_scaling = RopeScaling(
            "llama3",
            float(scaling["factor"]),
            float(scaling["low_freq_factor"]),
            float(scaling["high_freq_factor"]),
            int(scaling["original_max_position_embeddings"]),
        )
    else:
        raise UnsupportedConfigError(
            f"{field_name}.rope_type", f"{kind!r} (supported: default, linear, llama3)"
        )
    return {"rope_theta": theta, "rotary_dim": rotary_dim, "rope_scaling": rope_scaling}


def _attention_fields(d: dict[str, Any], default_partial: float) -> dict[str, Any]:
    hidden = int(_require(d, "hidden_size"))
    heads = int(_require(d, "num_attention_heads"))
    head_dim = int(_get(d, "head_dim", hidden // heads))
    return {
        "num_heads": heads,
        "num_kv_heads": int(_get(d, "num_key_value_heads", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_get(d, "max_position_embeddings", 4096)),
        **_rope(d, head_dim, default_partial),
    }


def _common(d: dict[str, Any], model_type: str) -> dict[str, Any]:
    for key in ("quantization_config", "num_experts", "num_local_experts"):
        if d.get(key):
            raise UnsupportedConfigError(key, "is not supported")
    _check_act(d)
    return {
        "model_type": model_type,
        "vocab_size": int(_require(d, "vocab_size")),
        "hidden_size": int(_require(d, "hidden_size")),
        "tie_word_embeddings": bool(_get(d, "tie_word_embeddings", False)),
        "bos_token_id": d.get("bos_token_id"),
        "eos_token_ids": _eos_ids(d),
        "pad_token_id": d.get("pad_token_id"),
    }


def _transformer(d: dict[str, Any], model_type: str) -> ModelConfig:
    n = int(_require(d, "num_hidden_layers"))
    windows = [0] * n
    if model_type == "mistral":
        windows = [int(_get(d, "sliding_window", 0))] * n
    elif model_type == "qwen2" and d.get("use_sliding_window") and d.get("sliding_window"):
        layer_types = d.get("layer_types") or [
            "sliding_attention" if i >= int(_get(d, "max_window_layers", n)) else "full_attention"
            for i in range(n)
        ]
        windows = [int(d["sliding_window"]) if t == "sliding_attention" else 0 for t in layer_types]
    bias = bool(_get(d, "attention_bias", False))
    return ModelConfig(
        **_common(d, model_type),
        layer_types=(ATTENTION,) * n,
        intermediate_size=int(_require(d, "intermediate_size")),
        mlp_bias=bool(_get(d, "mlp_bias", False)),
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)),
        qkv_bias=True if model_type == "qwen2" else bias,
        o_bias=False if model_type == "qwen2" else bias,
        sliding_windows=tuple(windows),
        **_attention_fields(d, 1.0),
    ).validate()


def _mamba2(d: dict[str, Any]) -> ModelConfig:
    _check_time_step_limit(d)
    if d.get("norm_before_gate"):
        raise UnsupportedConfigError(
            "norm_before_gate", "only False (gate, then normalise) is supported"
        )
    hidden, n = int(_require(d, "hidden_size")), int(_require(d, "num_hidden_layers"))
    eps = float(_get(d, "layer_norm_epsilon", 1e-5))
    return ModelConfig(
        **_common(d, "mamba2"),
        layer_types=(MAMBA,) * n,
        rms_norm_eps=eps,
        residual_in_fp32=bool(_get(d, "residual_in_fp32", True)),
        sliding_windows=(0,) * n,
        mamba_num_heads=int(_require(d, "num_heads")),
        mamba_head_dim=int(_require(d, "head_dim")),
        mamba_state_size=int(_require(d, "state_size")),
        mamba_n_groups=int(_get(d, "n_groups", 1)),
        mamba_conv_kernel=int(_get(d, "conv_kernel", 4)),
        mamba_intermediate_size=int(_get(d, "expand", 2)) * hidden,
        mamba_conv_bias=bool(_get(d, "use_conv_bias", True)),
        mamba_proj_bias=bool(_get(d, "use_bias", False)),
        mamba_chunk_size=int(_get(d, "chunk_size", 256)),
        mamba_norm_eps=eps,
    ).validate()


def _bamba(d: dict[str, Any]) -> ModelConfig:
    _check_time_step_limit(d)
    hidden, n = int(_require(d, "hidden_size")), int(_require(d, "num_hidden_layers"))
    attn = set(_get(d, "attn_layer_indices", []))
    if any(not 0 <= i < n for i in attn):
        raise UnsupportedConfigError("attn_layer_indices", f"indices must be in [0, {n})")
    expand, heads = int(_get(d, "mamba_expand", 2)), int(_require(d, "mamba_n_heads"))
    d_head = d.get("mamba_d_head", "auto")
    eps = float(_get(d, "rms_norm_eps", 1e-5))
    bias = bool(_get(d, "attention_bias", False))
    return ModelConfig(
        **_common(d, "bamba"),
        layer_types=tuple(ATTENTION if i in attn else MAMBA for i in range(n)),
        intermediate_size=int(_require(d, "intermediate_size")),
        mlp_bias=bool(_get(d, "mlp_bias", False)),
        rms_norm_eps=eps,
        qkv_bias=bias,
        o_bias=bias,
        sliding_windows=(0,) * n,
        # Bamba hard-codes partial_rotary_factor = 0.5 in its config class.
        **_attention_fields(d, 0.5),
        mamba_num_heads=heads,
        mamba_head_dim=expand * hidden // heads if d_head in (None, "auto") else int(d_head),
        mamba_state_size=int(_get(d, "mamba_d_state", 256)),
        mamba_n_groups=int(_get(d, "mamba_n_groups", 1)),
        mamba_conv_kernel=int(_get(d, "mamba_d_conv", 4)),
        mamba_intermediate_size=expand * hidden,
        mamba_conv_bias=bool(_get(d, "mamba_conv_bias", True)),
        mamba_proj_bias=bool(_get(d, "mamba_proj_bias", False)),
        mamba_chunk_size=int(_get(d, "mamba_chunk_size", 256)),
        mamba_norm_eps=eps,
    ).validate()


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


def _nemotron_h(d: dict[str, Any]) -> ModelConfig:
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


def _granitemoehybrid(d: dict[str, Any]) -> ModelConfig:
    """Granite 4.0-H, dense: Bamba-style Mamba2/attention layers, each followed by the shared
    SwiGLU MLP, with muP multipliers; transformers' modeling_granitemoehybrid.py."""
    experts = int(_get(d, "num_local_experts", 8))  # the config class defaults to 8 experts
    if experts > 0:
        raise UnsupportedConfigError("num_local_experts", f"{experts}: MoE layers are not supported")
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
    heads, d_head = int(_require(d, "mamba_n_heads")), d.get("mamba_d_head", "auto")
    eps = float(_get(d, "rms_norm_eps", 1e-6))
    bias = bool(_get(d, "attention_bias", False))
    attn = _attention_fields(d, 1.0) if ATTENTION in kinds else {}
    if pos != "rope":
        attn.pop("rope_scaling", None)
    return ModelConfig(
        **_common({**d, "num_local_experts": 0}, "granitemoehybrid"),
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
        mamba_num_heads=heads,
        mamba_head_dim=expand * hidden // heads if d_head in (None, "auto") else int(d_head),
        mamba_state_size=int(_get(d, "mamba_d_state", 256)),
        mamba_n_groups=int(_get(d, "mamba_n_groups", 1)),
        mamba_conv_kernel=int(_get(d, "mamba_d_conv", 4)),
        mamba_intermediate_size=expand * hidden,
        mamba_conv_bias=bool(_get(d, "mamba_conv_bias", True)),
        mamba_proj_bias=bool(_get(d, "mamba_proj_bias", False)),
        mamba_chunk_size=int(_get(d, "mamba_chunk_size", 256)),
        mamba_norm_eps=eps,
    ).validate()


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Parse a config.json dict. Raises UnsupportedConfigError naming the offending field."""
    model_type = d.get("model_type")
    if model_type in ("llama", "qwen2", "mistral"):
        return _transformer(d, model_type)
    if model_type == "mamba2":
        return _mamba2(d)
    if model_type == "bamba":
        return _bamba(d)
    if model_type == "nemotron_h":
        return _nemotron_h(d)
    if model_type == "granitemoehybrid":
        return _granitemoehybrid(d)
    raise UnsupportedConfigError(
        "model_type", f"{model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
    )
