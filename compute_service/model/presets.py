"""Small random-weight models, bit-for-bit reproducible from (preset, seed).

    tiny-transformer   llama, 4 attention layers, hidden 128            ~0.9M params (tests)
    tiny-sliding       mistral, as tiny-transformer, sliding window 32  ~0.9M params (tests)
    tiny-mamba2        mamba2, 6 Mamba2 layers, hidden 128              ~0.8M params (tests)
    tiny-hybrid        bamba, mamba/attn/mamba/attn, hidden 128         ~0.8M params (tests)
    tiny-moe           qwen3_moe, 4 layers (MoE 8 experts top-2 but
                       layer 2 dense), head_dim 48, q/k norms, hid 128  ~1.1M params (tests)
    small-transformer  llama, 8 layers, hidden 512                      ~26M params (CPU benchmarks)
    small-hybrid       bamba, 8 layers (attention at 2 and 5), hid 512  ~31M params (CPU benchmarks)

All use the byte-level tokenizer's special ids (pad 256, bos 257, eos 258) and a vocabulary of
at least 259. The initialisation keeps activations O(1) through the stack and gives logits a
spread of a few units, so greedy decoding is not decided by rounding noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from compute_service.model.config import ATTENTION, MAMBA, ModelConfig
from compute_service.model.model import CausalLM
from compute_service.model.tokenizer import ByteTokenizer

_TOK = ByteTokenizer()
_SPECIAL = {"bos_token_id": _TOK.BOS, "eos_token_ids": (_TOK.EOS,), "pad_token_id": _TOK.PAD}


def _transformer(
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    window: int,
    model_type: str,
) -> ModelConfig:
    return ModelConfig(
        model_type=model_type,
        vocab_size=vocab,
        hidden_size=hidden,
        layer_types=(ATTENTION,) * layers,
        intermediate_size=inter,
        rms_norm_eps=1e-6,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rotary_dim=hidden // heads,
        sliding_windows=(window,) * layers,
        max_position_embeddings=8192,
        **_SPECIAL,
    )


def _mamba_fields(
    hidden: int, heads: int, state: int, groups: int, chunk: int
) -> dict[str, object]:
    return {
        "mamba_num_heads": heads,
        "mamba_head_dim": 2 * hidden // heads,
        "mamba_state_size": state,
        "mamba_n_groups": groups,
        "mamba_conv_kernel": 4,
        "mamba_intermediate_size": 2 * hidden,
        "mamba_chunk_size": chunk,
    }


def _hybrid(
    hidden: int,
    layers: int,
    attn_at: tuple[int, ...],
    heads: int,
    kv_heads: int,
    inter: int,
    vocab: int,
    mamba_heads: int,
    state: int,
) -> ModelConfig:
    return ModelConfig(
        model_type="bamba",
        vocab_size=vocab,
        hidden_size=hidden,
        layer_types=tuple(ATTENTION if i in attn_at else MAMBA for i in range(layers)),
        intermediate_size=inter,
        rms_norm_eps=1e-5,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        rotary_dim=hidden // heads // 2,
        sliding_windows=(0,) * layers,
        max_position_embeddings=8192,
        mamba_norm_eps=1e-5,
        **_mamba_fields(hidden, mamba_heads, state, 1, 256),
        **_SPECIAL,
    )


def _tiny_mamba2() -> ModelConfig:
    return ModelConfig(
        model_type="mamba2",
        vocab_size=320,
        hidden_size=128,
        layer_types=(MAMBA,) * 6,
        rms_norm_eps=1e-5,
        residual_in_fp32=True,
        sliding_windows=(0,) * 6,
        mamba_norm_eps=1e-5,
        **_mamba_fields(128, 8, 32, 2, 64),
        **_SPECIAL,
    )


def _tiny_moe() -> ModelConfig:
    cfg = _transformer(128, 4, 4, 2, 256, 320, 0, "qwen3_moe")
    return cfg.replace(
        head_dim=48, rotary_dim=48, qk_norm=True, moe_layer_ids=(0, 1, 3), moe_num_experts=8,
        moe_top_k=2, moe_intermediate_size=64, moe_renormalize=True,
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "tiny-transformer": lambda: _transformer(128, 4, 4, 2, 384, 320, 0, "llama"),
    "tiny-sliding": lambda: _transformer(128, 4, 4, 2, 384, 320, 32, "mistral"),
    "tiny-mamba2": _tiny_mamba2,
    "tiny-hybrid": lambda: _hybrid(128, 4, (1, 3), 4, 2, 256, 320, 8, 32),
    "tiny-moe": _tiny_moe,
    "small-transformer": lambda: _transformer(512, 8, 8, 4, 1536, 512, 0, "llama"),
    "small-hybrid": lambda: _hybrid(512, 8, (2, 5), 8, 4, 1536, 512, 16, 64),
}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"preset {name!r}: unknown (available: {', '.join(PRESETS)})")
    return PRESETS[name]().validate()


def _init_param(
    name: str, shape: torch.Size, cfg: ModelConfig, gen: torch.Generator
) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if name == "lm_head.weight":
        # Logit spread ~2.5: unit-RMS normed hidden times std 2.5/sqrt(hidden).
        return torch.randn(shape, generator=gen) * (2.5 / math.sqrt(cfg.hidden_size))
    if name == "embed.weight":
        return torch.randn(shape, generator=gen)
    if leaf == "A_log":
        return torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
    if leaf == "dt_bias":
        # dt = softplus(dt_bias) log-uniform in [1e-3, 1e-1], as mamba_ssm initialises it.
        dt = torch.exp(torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        return dt + torch.log(-torch.expm1(-dt))
    if leaf == "D" or (leaf == "weight" and len(shape) == 1):  # D and norm weights: around 1
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if leaf == "conv_weight":
        return torch.randn(shape, generator=gen) * 0.5
    if leaf in ("bias", "conv_bias"):
        return 0.02 * torch.randn(shape, generator=gen)
    # Linear [out, in]: variance-preserving.
    return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])  # stacked experts: [E, out, in]


def init_random_(model: CausalLM, seed: int) -> CausalLM:
    """Fill every parameter deterministically from `seed` (CPU generator, fp32, fixed order)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(_init_param(name, p.shape, model.config, gen).to(p.dtype))
    return model


def build_preset(
    name: str, seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> CausalLM:
    """The random-weight model of preset `name`, identical for identical (name, seed, dtype)."""
    model = CausalLM.empty(preset_config(name), torch.float32, "cpu")
    return init_random_(model, seed).cast(dtype).to(device).eval()
