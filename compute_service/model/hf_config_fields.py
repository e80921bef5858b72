"""The field readers every config.json parser shares (hf_config, hf_config_hybrids): lenient
defaults, required fields, and the checks that refuse a value by naming its field."""

from __future__ import annotations

import math
from typing import Any

from compute_service.model.config import RopeScaling


class UnsupportedConfigError(ValueError):
    """A config.json field has a value this implementation cannot run; `field` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


# Families with a mixture-of-experts MLP -> the expert-count fields their modeling code reads
# (read, not refused; the other spellings are refused in them too).
_MOE_FIELDS = {
    "qwen3_moe": ("num_experts", "num_local_experts"),
    "granitemoehybrid": ("num_local_experts",),
}


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
        if d.get(key) and key not in _MOE_FIELDS.get(model_type, ()):
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


def _mamba_fields(d: dict[str, Any], inter: int, eps: float) -> dict[str, Any]:
    """The Mamba2 mixer's fields as the Bamba-derived configs name them (`mamba_n_heads`,
    `mamba_d_head`, ...: bamba, granitemoehybrid, falcon_h1); `inter` is its inner width."""
    heads, d_head = int(_require(d, "mamba_n_heads")), d.get("mamba_d_head", "auto")
    return dict(
        mamba_num_heads=heads,
        mamba_head_dim=inter // heads if d_head in (None, "auto") else int(d_head),
        mamba_state_size=int(_get(d, "mamba_d_state", 256)),
        mamba_n_groups=int(_get(d, "mamba_n_groups", 1)),
        mamba_conv_kernel=int(_get(d, "mamba_d_conv", 4)),
        mamba_intermediate_size=inter,
        mamba_conv_bias=bool(_get(d, "mamba_conv_bias", True)),
        mamba_proj_bias=bool(_get(d, "mamba_proj_bias", False)),
        mamba_chunk_size=int(_get(d, "mamba_chunk_size", 256)),
        mamba_norm_eps=eps,
    )
