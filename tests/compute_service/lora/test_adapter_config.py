"""Reading PEFT adapters: scaling rules, and a clear error naming the field for every adapter
this server cannot apply exactly."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from compute_service.lora import (
    AdapterConfigError,
    parse_lora_config,
    random_adapter,
    read_adapter,
    save_adapter,
    write_random_adapter,
)
from compute_service.model import preset_config

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model.model.layers"


def _write(
    path: Path,
    preset: str = "tiny-transformer",
    config: dict[str, Any] | None = None,
    add: dict[str, torch.Tensor] | None = None,
    drop: str | None = None,
) -> Path:
    """A valid random rank-8 adapter, then its config updated with `config`, tensors `add`ed and
    the tensor `drop` removed."""
    write_random_adapter(path, preset, rank=8, seed=3)
    raw = json.loads((path / CONFIG).read_text())
    raw.update(config or {})
    (path / CONFIG).write_text(json.dumps(raw))
    tensors = load_file(path / WEIGHTS)
    tensors.update(add or {})
    tensors.pop(drop, None)
    save_file(tensors, path / WEIGHTS)
    return path


BAD_CONFIGS = [
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"use_dora": True}, "use_dora"),
    ({"bias": "all"}, "bias"),
    ({"bias": "lora_only"}, "bias"),
    ({"lora_bias": True}, "lora_bias"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    ({"target_modules": ["lm_head"]}, "target_modules"),
    ({"r": 0}, "r"),
    ({"r": 4}, "r"),  # the weights have rank 8
    ({"rank_pattern": {"q_proj": 4}}, "r"),
    ({"rank_pattern": {"q_proj": -1}}, "rank_pattern"),
    ({"alpha_pattern": ["v_proj", 3]}, "alpha_pattern"),
    ({"lora_alpha": "16"}, "lora_alpha"),
    ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens"),
    ({"layer_replication": [[0, 2]]}, "layer_replication"),
    ({"trainable_token_indices": [5]}, "trainable_token_indices"),
]


@pytest.mark.parametrize("change,field", BAD_CONFIGS, ids=[f for _, f in BAD_CONFIGS])
def test_unsupported_config_fields(tmp_path: Path, change: dict, field: str) -> None:
    path = _write(tmp_path, config=change)
    with pytest.raises(AdapterConfigError, match=f"^{field}: ") as err:
        read_adapter(path, preset_config("tiny-transformer"))
    assert err.value.field == field


_Q0 = f"{PREFIX}.0.self_attn.q_proj"
BAD_TENSORS = [
    # name, preset, added tensors, dropped tensor
    (
        "embedding-lora",
        "tiny-transformer",
        {"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 320)},
        None,
    ),
    (
        "lm-head-lora",
        "tiny-transformer",
        {
            "base_model.model.lm_head.lora_A.weight": torch.zeros(8, 128),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(320, 8),
        },
        None,
    ),
    ("dora-magnitude", "tiny-transformer", {f"{_Q0}.lora_magnitude_vector": torch.ones(128)}, None),
    ("lora-b-bias", "tiny-transformer", {f"{_Q0}.lora_B.bias": torch.zeros(128)}, None),
    ("missing-lora-b", "tiny-transformer", {}, f"{_Q0}.lora_B.weight"),
    (
        "layer-out-of-range",
        "tiny-transformer",
        {
            f"{PREFIX}.9.self_attn.q_proj.lora_A.weight": torch.zeros(8, 128),
            f"{PREFIX}.9.self_attn.q_proj.lora_B.weight": torch.zeros(128, 8),
        },
        None,
    ),
    # tiny-hybrid: layer 0 is Mamba2, so it has no q_proj; conv1d carries no LoRA here.
    (
        "attention-target-on-mamba-layer",
        "tiny-hybrid",
        {f"{_Q0}.lora_A.weight": torch.zeros(8, 128), f"{_Q0}.lora_B.weight": torch.zeros(128, 8)},
        None,
    ),
    (
        "mamba-conv1d",
        "tiny-hybrid",
        {
            f"{PREFIX}.0.mamba.conv1d.lora_A.weight": torch.zeros(8, 1, 4),
            f"{PREFIX}.0.mamba.conv1d.lora_B.weight": torch.zeros(384, 8, 1),
        },
        None,
    ),
]


@pytest.mark.parametrize("name,preset,add,drop", BAD_TENSORS, ids=[c[0] for c in BAD_TENSORS])
def test_tensors_outside_supported_targets(
    tmp_path: Path, name: str, preset: str, add: dict, drop: str | None
) -> None:
    path = _write(tmp_path, preset, add=add, drop=drop)
    with pytest.raises(AdapterConfigError, match="^target_modules: ") as err:
        read_adapter(path, preset_config(preset))
    assert err.value.field == "target_modules"


def test_wrong_projection_shape_names_r(tmp_path: Path) -> None:
    """An adapter made for another model size: shapes disagree with the projection."""
    write_random_adapter(tmp_path, "small-transformer", rank=8, targets=["q_proj"])
    with pytest.raises(AdapterConfigError, match="^r: .*q_proj"):
        read_adapter(tmp_path, preset_config("tiny-transformer"))


def test_missing_or_broken_files_name_path(tmp_path: Path) -> None:
    config = preset_config("tiny-transformer")
    with pytest.raises(AdapterConfigError, match=f"^path: .*{CONFIG}"):
        read_adapter(tmp_path / "nowhere", config)
    path = _write(tmp_path / "broken")
    (path / CONFIG).write_text("{not json")
    with pytest.raises(AdapterConfigError, match="^path: .*not valid JSON"):
        read_adapter(path, config)


def test_scaling_rules() -> None:
    """alpha / r, alpha / sqrt(r) with rsLoRA, per-module patterns as PEFT matches them."""
    cfg = parse_lora_config({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"]})
    assert cfg.scaling("model.layers.0.self_attn.q_proj") == 2.0
    rs = parse_lora_config(
        {"r": 16, "lora_alpha": 8, "use_rslora": True, "target_modules": "all-linear"}
    )
    assert rs.scaling("model.layers.0.mlp.up_proj") == pytest.approx(8 / math.sqrt(16))
    patterned = parse_lora_config(
        {
            "r": 8,
            "lora_alpha": 16,
            "target_modules": ["q_proj", "v_proj"],
            "rank_pattern": {"q_proj": 4},
            "alpha_pattern": {"layers.1.self_attn.v_proj": 4},
        }
    )
    assert patterned.rank("model.layers.3.self_attn.q_proj") == 4
    assert patterned.scaling("model.layers.3.self_attn.q_proj") == 4.0
    assert patterned.scaling("model.layers.1.self_attn.v_proj") == 0.5
    assert patterned.scaling("model.layers.11.self_attn.v_proj") == 2.0  # dotted boundary


@pytest.mark.parametrize("preset", ["tiny-transformer", "tiny-hybrid", "tiny-mamba2"])
def test_save_then_read_round_trip(tmp_path: Path, preset: str) -> None:
    """Every target kind of each family survives the PEFT format (names, factors, scaling)."""
    adapter = random_adapter(preset, rank=4, alpha=6, use_rslora=True, seed=9)
    save_adapter(adapter, tmp_path, preset_config(preset))
    back = read_adapter(tmp_path, preset_config(preset))
    assert back.modules.keys() == adapter.modules.keys()
    for target, module in adapter.modules.items():
        assert torch.equal(back.modules[target].A, module.A)
        assert torch.equal(back.modules[target].B, module.B)
        assert back.modules[target].scaling == pytest.approx(module.scaling)
