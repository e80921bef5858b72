"""Presets are reproducible from a seed; HF-format export round-trips through our loader and
through transformers itself."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compute_service.model import (
    PRESETS,
    ForwardMode,
    NoTokenizer,
    UnsupportedConfigError,
    build_preset,
    load_model,
    load_tokenizer,
    preset_config,
    read_config,
    save_model,
)
from compute_service.model.tokenizer import ByteTokenizer
from tests.compute_service.paged_driver import PagedDriver

TINY = ["tiny-transformer", "tiny-sliding", "tiny-mamba2", "tiny-hybrid", "tiny-moe"]


def _logits(model, ids: list[int]) -> torch.Tensor:
    driver = PagedDriver(model, page_size=16)
    return driver.forward([driver.new_sequence()], [ids], all_logits=True).logits


@pytest.mark.parametrize("name", TINY)
def test_preset_is_deterministic_in_seed(name: str) -> None:
    a, b, c = build_preset(name, seed=11), build_preset(name, seed=11), build_preset(name, seed=12)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["embed.weight"], sc["embed.weight"])


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_sizes(name: str) -> None:
    """Tiny presets ~1M parameters, small ones 20-50M; counted from shapes, no weights built."""
    n = preset_config(name).num_parameters()
    low, high = (0.5e6, 1.5e6) if name.startswith("tiny") else (20e6, 50e6)
    assert low <= n <= high, n
    assert preset_config(name).vocab_size >= ByteTokenizer().vocab_size


def test_preset_parameter_count_matches_model() -> None:
    for name in TINY:
        model = build_preset(name)
        assert sum(p.numel() for p in model.parameters()) == model.config.num_parameters()


def test_unknown_preset_names_the_choices() -> None:
    with pytest.raises(ValueError, match="tiny-hybrid"):
        preset_config("huge-hybrid")


@pytest.mark.parametrize("name", TINY)
def test_save_load_round_trip(name: str, tmp_path: Path) -> None:
    model = build_preset(name, seed=3)
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert read_config(tmp_path) == model.config
    ours, theirs = model.state_dict(), loaded.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # No tokenizer.json: token ids only, with the checkpoint's EOS (never a byte fallback).
    tok = load_tokenizer(tmp_path, loaded.config)
    assert isinstance(tok, NoTokenizer) and tok.eos_token_ids == (ByteTokenizer.EOS,)


@pytest.mark.parametrize("name", TINY)
def test_exported_preset_runs_in_transformers(name: str, tmp_path: Path) -> None:
    """Our export is a valid checkpoint of its family: transformers loads it and agrees."""
    transformers = pytest.importorskip("transformers")
    model = build_preset(name, seed=6)
    save_model(model, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, attn_implementation="eager"
    ).eval()
    ids = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), use_cache=False).logits[0].float()
    torch.testing.assert_close(_logits(model, ids), ref, atol=2e-4, rtol=1e-4)


def test_bf16_cast_keeps_ssm_parameters_fp32() -> None:
    model = build_preset("tiny-hybrid", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    mamba = model.layers[0].mamba
    assert mamba.A_log.dtype == mamba.D.dtype == mamba.dt_bias.dtype == torch.float32
    assert mamba.in_proj.weight.dtype == torch.bfloat16
    driver = PagedDriver(model, page_size=16)
    seq = driver.new_sequence()
    logits = driver.forward([seq], [list(range(20))]).logits
    step = driver.forward([seq], [[int(logits[0].argmax())]], mode=ForwardMode.DECODE).logits
    assert logits.dtype == step.dtype == torch.float32 and torch.isfinite(step).all()


def test_save_refuses_unrepresentable_config(tmp_path: Path) -> None:
    model = build_preset("tiny-sliding")
    model.config = model.config.replace(model_type="llama")  # llama has no sliding window
    with pytest.raises(UnsupportedConfigError, match="sliding_windows"):
        save_model(model, tmp_path)


def test_missing_tensor_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_model(build_preset("tiny-transformer"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.up_proj\.weight"):
        load_model(tmp_path)


def test_unknown_tensor_is_an_error(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_model(build_preset("tiny-transformer"), tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="q_norm"):
        load_model(tmp_path)
