"""Adapters created and saved by PEFT itself load here and reproduce PEFT's merged model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from compute_service.lora import AdapterRegistry, read_adapter, write_random_adapter
from compute_service.model import ForwardMode, build_preset, load_model, save_model
from tests.compute_service.model.hf_reference import VOCAB, build_hf_model, hf_logits
from tests.compute_service.paged_driver import PagedDriver

peft = pytest.importorskip("peft")
pytestmark = pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing`:FutureWarning")

TOL = {"atol": 1e-4, "rtol": 1e-4}

# HF case (tests/compute_service/model/hf_reference.py) -> LoraConfig arguments: every target
# kind of each family, per-module rank and alpha patterns, rsLoRA.
CASES: dict[str, dict[str, Any]] = {
    "llama": {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        "rank_pattern": {"q_proj": 4},
        "alpha_pattern": {"layers.1.self_attn.v_proj": 3},
    },
    "qwen3-tied-bias-sliding": {
        "r": 4,
        "lora_alpha": 8,
        "target_modules": ["q_proj", "k_proj", "o_proj", "gate_proj", "down_proj"],
    },
    # Attention only: PEFT's LoRA of MoE experts is refused here (test below).
    "qwen3_moe": {
        "r": 4,
        "lora_alpha": 4,
        "target_modules": ["q_proj", "v_proj", "o_proj"],
    },
    "bamba": {
        "r": 6,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["q_proj", "v_proj", "o_proj", "in_proj", "out_proj", "up_proj"],
    },
}


@pytest.mark.parametrize("case", list(CASES))
def test_peft_adapter_matches_peft_merged_model(case: str, tmp_path: Path) -> None:
    """Prefill 13 tokens, then 5 teacher-forced DECODE steps, against PEFT's merge_and_unload."""
    base_dir, adapter_dir = tmp_path / "base", tmp_path / "adapter"
    hf = build_hf_model(case, base_dir, seed=5)
    torch.manual_seed(6)
    # init_lora_weights=False: B random too (PEFT's default B = 0 would make a no-op adapter).
    config = peft.LoraConfig(init_lora_weights=False, **CASES[case])
    peft_model = peft.get_peft_model(hf, config)
    peft_model.save_pretrained(adapter_dir)
    ids = torch.randint(0, VOCAB, (18,), generator=torch.Generator().manual_seed(7)).tolist()
    with peft_model.disable_adapter():
        base_ref = hf_logits(peft_model, ids)
    ref = hf_logits(peft_model.merge_and_unload(), ids)
    assert (ref - base_ref).abs().max() > 0.1, "the adapter should change the logits"

    model = load_model(base_dir)
    registry = AdapterRegistry(model, max_loaded=2, max_rank=8)
    info = registry.load("peft-made", adapter_dir)
    assert info.rank == CASES[case]["r"]
    assert set(info.target_modules) == set(CASES[case]["target_modules"])
    driver = PagedDriver(model, num_pages=16, page_size=4)
    seq = driver.new_sequence()
    lora = registry.lora_batch([info.slot], [13])
    prefill = driver.forward([seq], [ids[:13]], all_logits=True, lora=lora).logits
    torch.testing.assert_close(prefill, ref[:13], **TOL)
    for pos in range(13, 18):
        lora = registry.lora_batch([info.slot], [1])
        step = driver.forward([seq], [[ids[pos]]], mode=ForwardMode.DECODE, lora=lora).logits
        torch.testing.assert_close(step[0], ref[pos], **TOL)


def test_peft_scaling_patterns(tmp_path: Path) -> None:
    """rank_pattern / alpha_pattern resolve per module to PEFT's own r and scaling."""
    hf = build_hf_model("llama", tmp_path / "base", seed=1)
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(init_lora_weights=False, **CASES["llama"]))
    peft_model.save_pretrained(tmp_path / "adapter")
    adapter = read_adapter(tmp_path / "adapter", load_model(tmp_path / "base").config)
    peft_layers = dict(peft_model.base_model.model.named_modules())
    assert len(adapter.modules) == 2 * 7
    for (layer_id, name), module in adapter.modules.items():
        kind = "self_attn" if name in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        peft_layer = peft_layers[f"model.layers.{layer_id}.{kind}.{name}"]
        assert module.rank == peft_layer.r["default"]
        assert module.scaling == pytest.approx(peft_layer.scaling["default"])


@pytest.mark.parametrize("preset", ["tiny-transformer", "tiny-hybrid"])
def test_random_adapter_loads_in_peft(preset: str, tmp_path: Path) -> None:
    """`write_random_adapter` writes real PEFT format: PeftModel loads it onto the transformers
    model of the preset and gives the logits our forward gives with the adapter."""
    transformers = pytest.importorskip("transformers")
    model = build_preset(preset, seed=2)
    save_model(model, tmp_path / "base")
    write_random_adapter(tmp_path / "adapter", preset, rank=4, seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = list(range(100, 111))
    ref = hf_logits(peft_model, ids)

    registry = AdapterRegistry(model, max_loaded=1, max_rank=4)
    slot = registry.load("ours", tmp_path / "adapter").slot
    driver = PagedDriver(model)
    lora = registry.lora_batch([slot], [len(ids)])
    got = driver.forward([driver.new_sequence()], [ids], all_logits=True, lora=lora).logits
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.filterwarnings("ignore:The following:RuntimeWarning")
def test_a_peft_adapter_on_moe_experts_is_refused_by_name(tmp_path: Path) -> None:
    """PEFT puts LoRA on the stacked experts when asked for gate/up/down on a Qwen3-MoE; the
    experts take no LoRA here, so loading names the field instead of serving a partial adapter."""
    from compute_service.lora import AdapterConfigError

    hf = build_hf_model("qwen3_moe", tmp_path / "base", seed=5)
    config = peft.LoraConfig(init_lora_weights=False, r=4,
                             target_modules=["q_proj", "gate_proj", "up_proj", "down_proj"])
    peft.get_peft_model(hf, config).save_pretrained(tmp_path / "adapter")
    registry = AdapterRegistry(load_model(tmp_path / "base"), max_loaded=1, max_rank=4)
    with pytest.raises(AdapterConfigError, match="target_parameters.*MoE experts"):
        registry.load("experts", tmp_path / "adapter")
