"""What `--model` names (compute_service/model/source.py) and GGUF files written the way
llama.cpp writes them (compute_service/model/gguf_checkpoint.py), on tiny models: a preset, a
checkpoint directory, a .gguf file or a directory holding one, a hub id from a fake local
Hugging Face cache (at a revision too), and the offline error naming the cache it looked in."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from compute_service.model import build_preset, save_model
from compute_service.model.checkpoint import ours_to_hf
from compute_service.model.gguf_checkpoint import find_gguf, load_gguf_model
from compute_service.model.source import ModelNotFoundError, resolve_model

gguf = pytest.importorskip("gguf")


def llama_cpp_permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's `LlamaModel.permute` (convert_hf_to_gguf.py, ggml-org/llama.cpp, MIT): the
    row order it writes attn_q / attn_k in."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


_GGUF_NAMES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
               "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def write_llama_gguf(model, path) -> None:
    """`model` (a llama preset) as llama.cpp's converter writes it: F32 tensors, q/k permuted,
    the metadata keys of a llama file, no tokenizer."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(len(cfg.layer_types))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, p in model.named_parameters():
        hf = ours_to_hf(name, "llama")
        t = p.detach().clone()
        if hf.endswith("q_proj.weight"):
            t = llama_cpp_permute(t, cfg.num_heads)
        elif hf.endswith("k_proj.weight"):
            t = llama_cpp_permute(t, cfg.num_kv_heads)
        if hf == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif hf == "model.norm.weight":
            out = "output_norm.weight"
        elif hf == "lm_head.weight":
            out = "output.weight"
        else:
            layer, rest = hf.removeprefix("model.layers.").split(".", 1)
            module = rest.removesuffix(".weight")
            out = f"blk.{layer}.{_GGUF_NAMES[module]}.weight"
        w.add_tensor(out, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny():
    return build_preset("tiny-transformer", seed=5)


def test_a_gguf_written_like_llama_cpp_loads_to_the_same_weights(tiny, tmp_path):
    write_llama_gguf(tiny, tmp_path / "tiny.gguf")
    loaded = load_gguf_model(tmp_path / "tiny.gguf")
    assert loaded.config.num_heads == tiny.config.num_heads
    theirs = dict(loaded.named_parameters())
    for name, p in tiny.named_parameters():
        assert torch.equal(theirs[name], p), name  # q/k rows back in HF order


def test_model_specs_resolve_to_what_they_name(tiny, tmp_path):
    assert resolve_model("tiny-hybrid").kind == "preset"
    save_model(tiny, tmp_path / "ckpt")
    assert (resolve_model(str(tmp_path / "ckpt")).kind, resolve_model(str(tmp_path / "ckpt")).name) \
        == ("hf", "ckpt")
    (tmp_path / "g").mkdir()
    write_llama_gguf(tiny, tmp_path / "g" / "m.gguf")
    for spec in (tmp_path / "g", tmp_path / "g" / "m.gguf"):
        src = resolve_model(str(spec))
        assert (src.kind, src.path, src.name) == ("gguf", tmp_path / "g" / "m.gguf", "m")
    write_llama_gguf(tiny, tmp_path / "g" / "other.gguf")
    with pytest.raises(ValueError, match="several .gguf files"):
        find_gguf(tmp_path / "g")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFoundError, match="neither a .gguf file nor a directory"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(ModelNotFoundError, match="nor a hub id"):
        resolve_model("not a model")


def fake_hub_cache(root, repo: str, files_from, commit: str = "a" * 40) -> None:
    """The layout huggingface_hub keeps: models--org--name/{refs/main, snapshots/<commit>/...}."""
    base = root / f"models--{repo.replace('/', '--')}"
    snap = base / "snapshots" / commit
    snap.mkdir(parents=True)
    (base / "refs").mkdir()
    (base / "refs" / "main").write_text(commit)
    for f in files_from.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # no network in tests
    return cache


def test_a_hub_id_resolves_from_the_local_cache(tiny, tmp_path, hub_cache):
    save_model(tiny, tmp_path / "ckpt")
    fake_hub_cache(hub_cache, "acme/tiny-llama", tmp_path / "ckpt")
    src = resolve_model("acme/tiny-llama")
    assert src.kind == "hf" and src.name == "acme/tiny-llama"
    assert src.path == hub_cache / "models--acme--tiny-llama" / "snapshots" / ("a" * 40)
    assert json.loads((src.path / "config.json").read_text())["model_type"] == "llama"
    assert resolve_model(f"acme/tiny-llama@{'a' * 40}").path == src.path


def test_a_hub_id_not_cached_offline_names_the_cache_it_looked_in(hub_cache):
    with pytest.raises(ModelNotFoundError) as err:
        resolve_model("acme/not-downloaded@main")
    assert str(hub_cache) in str(err.value) and "acme/not-downloaded@main" in str(err.value)
