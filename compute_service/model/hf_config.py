"""Hugging Face `config.json` <-> ModelConfig, for the families listed in README.md.

Reading is tolerant of fields that do not change inference (initializer ranges, dropout,
`use_cache`, ...) and strict about fields whose value we cannot honour: those raise
`UnsupportedConfigError` naming the field. Both the transformers v4 layout (`rope_theta`,
`rope_scaling`) and the v5 layout (`rope_parameters`) are read.
"""

from __future__ import annotations

from typing import Any

from compute_service.model.config import ATTENTION, MAMBA, ModelConfig
from compute_service.model.hf_config_fields import (
    UnsupportedConfigError,
    _attention_fields,
    _mamba_fields,
    _check_time_step_limit,
    _common,
    _get,
    _require,
)
from compute_service.model.hf_config_hybrids import falcon_h1, granitemoehybrid, nemotron_h

SUPPORTED_MODEL_TYPES = (
    "llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mamba2", "bamba", "nemotron_h",
    "granitemoehybrid", "falcon_h1",
)
__all__ = ["SUPPORTED_MODEL_TYPES", "UnsupportedConfigError", "config_from_hf"]


def _transformer(d: dict[str, Any], model_type: str) -> ModelConfig:
    n = int(_require(d, "num_hidden_layers"))
    windows = [0] * n
    if model_type == "mistral":
        windows = [int(_get(d, "sliding_window", 0))] * n
    elif model_type.startswith("qwen") and d.get("use_sliding_window") and d.get("sliding_window"):
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


def _qwen3(d: dict[str, Any], model_type: str) -> ModelConfig:
    """qwen3 (and the attention half of qwen3_moe): llama plus q/k RMSNorm per head, one
    `attention_bias` for q/k/v/o, head_dim defaulting to 128 (not hidden / heads)."""
    if model_type == "qwen3_moe" and d.get("use_sliding_window"):
        # transformers' Qwen3-MoE windows every layer, Qwen3 only those past max_window_layers;
        # no checkpoint uses it and no test shows our reading of it: refused, not guessed.
        raise UnsupportedConfigError("use_sliding_window", "is not supported for qwen3_moe")
    cfg = _transformer({"head_dim": 128, **d}, model_type)
    bias = bool(_get(d, "attention_bias", False))
    moe = _qwen3_moe(d, cfg.num_layers) if model_type == "qwen3_moe" else {}
    return cfg.replace(qk_norm=True, qkv_bias=bias, o_bias=bias, **moe).validate()


def _qwen3_moe(d: dict[str, Any], n: int) -> dict[str, Any]:
    """The MoE fields of a qwen3_moe config: layer i is sparse iff i is not in `mlp_only_layers`
    and (i + 1) % `decoder_sparse_step` == 0 (transformers' Qwen3MoeDecoderLayer rule)."""
    experts = int(_get(d, "num_experts", _get(d, "num_local_experts", 0)))
    step = int(_get(d, "decoder_sparse_step", 1))
    if step <= 0:
        raise UnsupportedConfigError("decoder_sparse_step", f"{step} must be positive")
    dense = {int(i) for i in _get(d, "mlp_only_layers", [])}
    if any(not 0 <= i < n for i in dense):
        raise UnsupportedConfigError("mlp_only_layers", f"indices must be in [0, {n})")
    ids = tuple(i for i in range(n) if experts > 0 and i not in dense and (i + 1) % step == 0)
    if not ids:
        return {}
    top_k = int(_require(d, "num_experts_per_tok"))
    if not 0 < top_k <= experts:
        raise UnsupportedConfigError("num_experts_per_tok", f"{top_k} must be in [1, {experts}]")
    return {
        "moe_layer_ids": ids,
        "moe_num_experts": experts,
        "moe_top_k": top_k,
        "moe_intermediate_size": int(_require(d, "moe_intermediate_size")),
        "moe_renormalize": bool(_get(d, "norm_topk_prob", False)),
    }


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
    expand = int(_get(d, "mamba_expand", 2))
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
        **_mamba_fields(d, expand * hidden, eps),
    ).validate()


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Parse a config.json dict. Raises UnsupportedConfigError naming the offending field."""
    model_type = d.get("model_type")
    if model_type in ("llama", "qwen2", "mistral"):
        return _transformer(d, model_type)
    if model_type in ("qwen3", "qwen3_moe"):
        return _qwen3(d, model_type)
    if model_type == "mamba2":
        return _mamba2(d)
    if model_type == "bamba":
        return _bamba(d)
    if model_type == "nemotron_h":
        return nemotron_h(d)
    if model_type == "granitemoehybrid":
        return granitemoehybrid(d)
    if model_type == "falcon_h1":
        return falcon_h1(d)
    raise UnsupportedConfigError(
        "model_type", f"{model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
    )
