"""GGUF checkpoints (llama.cpp's single-file format) read into `CausalLM`, without transformers.

`--model FILE.gguf` (or a directory holding exactly one .gguf and no config.json) reads:

- the config from the `<arch>.*` metadata keys, as transformers' GGUF loader maps them
  (`transformers/integrations/ggml.py`); only `general.architecture = llama` is read, and GGUF
  keys this code cannot honour (rope scaling) are refused by name;
- the weights, dequantized per tensor through the `gguf` package (Q4_0/Q4_1/Q8_0/K-quants/F16/
  F32: whatever `gguf.quants.dequantize` knows) into fp32 and cast to the dtype asked for. llama.cpp's
  converter permutes the rows of every llama attn_q/attn_k weight (it interleaves each head's two
  rotary halves for its own rope kernel); they are permuted back here, as transformers does, so
  that our half-split rope applies. Without an `output.weight` tensor the embeddings are tied;
- the tokenizer: `tokenizer.ggml.model = gpt2` (byte-level BPE) is rebuilt as a `tokenizer.json`
  the way transformers' GGUF tokenizer builds it (vocabulary, merges, the control tokens as special
  tokens, GPT-2's byte-level pre-tokenizer), and `tokenizer.chat_template` and the bos/eos ids
  become `tokenizer_config.json`. tests/test_gguf_smollm2.py checks both against transformers'
  own GGUF loader on the same file.
"""
from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from compute_service.model.checkpoint import hf_to_ours
from compute_service.model.config import ModelConfig
from compute_service.model.hf_config import UnsupportedConfigError, config_from_hf
from compute_service.model.model import CausalLM

__all__ = ["find_gguf", "forget_files", "gguf_hf_config", "gguf_tokenizer_files", "load_gguf_model",
           "read_gguf_config"]

# GGUF tensor name (after blk.N.) -> HF module name, for the llama family.
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOP_TENSORS = {"token_embd.weight": "model.embed_tokens.weight",
                "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
_REFUSED_KEYS = ("rope.scaling.type", "rope.scaling.factor", "expert_count")
_CONTROL = 3  # llama.cpp's token type for control (special) tokens


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one .gguf in a directory without a
    config.json (ValueError when there are several); None when `path` is neither."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        files = sorted(path.glob("*.gguf"))
        if len(files) > 1:
            raise ValueError(f"--model {path}: several .gguf files ({', '.join(f.name for f in files)}); "
                             "name one")
        return files[0] if files else None
    return None


@functools.lru_cache(maxsize=2)
def _reader(path: Path):
    """The parsed file (memory-mapped; parsing the metadata of a 49k vocabulary takes seconds,
    so the model and the tokenizer share one)."""
    from gguf import GGUFReader  # imported here: only GGUF checkpoints need it
    return GGUFReader(str(path))


@functools.lru_cache(maxsize=2)
def _meta(path: Path) -> dict[str, Any]:
    """The file's metadata, key -> value (cached with the reader, for the same reason)."""
    return {name: field.contents() for name, field in _reader(path).fields.items()
            if not name.startswith("GGUF.")}


def forget_files() -> None:
    """Drops the parsed files (their memory maps and metadata) once the model and tokenizer are
    built, so that a worker does not keep them resident."""
    _meta.cache_clear()
    _reader.cache_clear()


def gguf_hf_config(meta: dict[str, Any], tensor_names: set[str], path: Path) -> dict[str, Any]:
    """The HF config.json of a GGUF file's metadata (`meta`: key -> value)."""
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise UnsupportedConfigError("general.architecture",
                                     f"{path}: {arch!r} GGUF files are not supported (only 'llama')")
    for key in _REFUSED_KEYS:
        if f"{arch}.{key}" in meta:
            raise UnsupportedConfigError(f"{arch}.{key}", f"{path}: not supported in a GGUF file")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise UnsupportedConfigError(f"{arch}.{key}", f"{path}: required GGUF key is missing")
        return meta[f"{arch}.{key}"]

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    vocab = int(meta.get(f"{arch}.vocab_size", len(meta.get("tokenizer.ggml.tokens", ()))))
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    return {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"],
        "vocab_size": vocab, "hidden_size": hidden, "num_attention_heads": heads,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_key_value_heads": int(meta.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length")),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }


def read_gguf_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of GGUF file `path` (its metadata only)."""
    path = Path(path).resolve()
    return config_from_hf(gguf_hf_config(_meta(path), {t.name for t in _reader(path).tensors},
                                          path))


def _hf_name(name: str) -> str:
    if name in _TOP_TENSORS:
        return _TOP_TENSORS[name]
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}"
    raise ValueError(f"GGUF tensor {name!r}: not a known llama weight")


def unpermute_rope_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of a q/k weight: per head, rows [r0 r1 r2 r3 ...] were written
    as pairs (first half, second half) interleaved; this puts each head's halves back."""
    return (w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _tensors(reader, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, fp32 tensor) of every tensor, dequantized one at a time (peak memory: one)."""
    from gguf.quants import dequantize
    for t in reader.tensors:
        hf = _hf_name(t.name)
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).astype("float32"))
        if hf.endswith("q_proj.weight"):
            w = unpermute_rope_rows(w, cfg.num_heads)
        elif hf.endswith("k_proj.weight"):
            w = unpermute_rope_rows(w, cfg.num_kv_heads)
        yield hf, w


def load_gguf_model(path: str | Path, dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu") -> CausalLM:
    """A CausalLM with the weights of GGUF file `path`, in `dtype` on `device`. Every parameter
    must come from the file; an unknown tensor or a shape mismatch is an error naming it."""
    path = Path(path)
    reader = _reader(path.resolve())
    hf_config = gguf_hf_config(_meta(path.resolve()), {t.name for t in reader.tensors}, path)
    cfg = config_from_hf(hf_config)
    model = CausalLM.empty(cfg, dtype, device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    for hf, tensor in _tensors(reader, cfg):
        name = hf_to_ours(hf, "llama")
        target = params.get(name)
        if target is None:
            raise ValueError(f"{path}: tensor {hf!r} has no parameter in this config")
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(f"{path}: tensor {hf!r} has shape {tuple(tensor.shape)}, "
                             f"want {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"{path}: missing tensors for {missing[:8]}")
    return model.eval()


def _byte_level_tokenizer_json(meta: dict[str, Any]) -> str:
    """tokenizer.json of a `gpt2` (byte-level BPE) GGUF vocabulary, built as transformers'
    GGUF tokenizer builds it (GPT2Tokenizer over the file's vocab and merges)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix", False)))
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    types = meta.get("tokenizer.ggml.token_type") or ()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == _CONTROL])
    return tok.to_str()


def gguf_tokenizer_files(path: str | Path) -> dict[str, bytes]:
    """tokenizer.json and tokenizer_config.json (chat template, bos/eos/pad) of GGUF file
    `path`, by file name, for `prefixcache_client.tokenizer.from_files`; {} when the file has
    no tokenizer. ValueError naming the key for a tokenizer model that is not byte-level BPE."""
    path = Path(path)
    meta = _meta(path.resolve())
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return {}
    if kind != "gpt2":
        raise UnsupportedConfigError("tokenizer.ggml.model",
                                     f"{path}: {kind!r} tokenizers are not supported (only 'gpt2')")
    tokens = meta["tokenizer.ggml.tokens"]

    def token(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}")
        return tokens[i] if i is not None else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token("bos_token_id"),
              "eos_token": token("eos_token_id"), "pad_token": token("padding_token_id"),
              "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "clean_up_tokenization_spaces": False}
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    ids = {"bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
           "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
           "pad_token_id": meta.get("tokenizer.ggml.padding_token_id")}
    return {"tokenizer.json": _byte_level_tokenizer_json(meta).encode(),
            "tokenizer_config.json": json.dumps(config).encode(),
            "config.json": json.dumps(ids).encode()}
