"""A LoRA adapter in memory, and its PEFT on-disk format (adapter_config.json +
adapter_model.safetensors).

Tensor names: `base_model.model.<HF module path>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r] (an older layout also puts the PEFT adapter name before `.weight`). Every tensor must
be such a factor of a LoRA-capable projection of the model; anything else (embedding LoRA,
DoRA magnitudes, lora_B biases, modules_to_save copies) is an error naming it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from compute_service.lora.config import AdapterConfigError, LoraConfig, parse_lora_config
from compute_service.lora.targets import (
    Target,
    hf_module_of_target,
    target_of_hf_module,
    target_shapes,
)
from compute_service.model.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(slots=True)
class LoraModule:
    """One projection's update `scaling * B @ A`: A [r, in], B [out, r] (as stored)."""

    A: torch.Tensor
    B: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.A.shape[0]


@dataclass(slots=True)
class LoraAdapter:
    """A parsed, validated adapter for one model config: `modules` maps each target
    (layer id, PEFT module name) it updates to its factors."""

    config: LoraConfig
    modules: dict[Target, LoraModule]

    @property
    def rank(self) -> int:
        """The largest rank over its modules (what a registry slot must hold)."""
        return max(m.rank for m in self.modules.values())

    @property
    def target_modules(self) -> tuple[str, ...]:
        """PEFT module names it updates in at least one layer, sorted."""
        return tuple(sorted({name for _, name in self.modules}))


def _read_factors(file: Path) -> dict[str, dict[str, torch.Tensor]]:
    """HF module path -> {"A": tensor, "B": tensor} as found in the file."""
    factors: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(file), framework="pt") as f:
        for key in f.keys():
            match = _FACTOR.match(key.removeprefix(_PREFIX))
            if match is None:
                raise AdapterConfigError(
                    "target_modules", f"tensor {key!r} is not a lora_A/lora_B weight"
                )
            factors.setdefault(match["module"], {})[match["ab"]] = f.get_tensor(key)
    return factors


def read_adapter(path: str | Path, model_config: ModelConfig) -> LoraAdapter:
    """Read and validate a PEFT LoRA adapter directory for a model of `model_config`.

    Raises AdapterConfigError naming the field: `path` (missing files), the config field that
    is unsupported, `target_modules` (a module this model has no LoRA-capable projection for,
    or a stray tensor), `r` (factor shapes that disagree with the config's rank or with the
    projection's in/out features).
    """
    path = Path(path)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / name).is_file():
            raise AdapterConfigError("path", f"{path}: no {name}")
    try:
        raw = json.loads((path / CONFIG_FILE).read_text())
    except json.JSONDecodeError as e:
        raise AdapterConfigError("path", f"{path / CONFIG_FILE}: not valid JSON ({e})") from e
    config = parse_lora_config(raw)
    shapes = target_shapes(model_config)
    modules: dict[Target, LoraModule] = {}
    for hf_module, ab in _read_factors(path / WEIGHTS_FILE).items():
        target = target_of_hf_module(hf_module, model_config)
        if target not in shapes:
            raise AdapterConfigError(
                "target_modules", f"{hf_module!r}: layer {target[0]} has no {target[1]}"
            )
        if set(ab) != {"A", "B"}:
            raise AdapterConfigError("target_modules", f"{hf_module!r}: needs lora_A and lora_B")
        A, B = ab["A"], ab["B"]
        d_in, d_out = shapes[target]
        r = config.rank(hf_module)
        if A.shape != (r, d_in) or B.shape != (d_out, r):
            raise AdapterConfigError(
                "r",
                f"{hf_module!r}: lora_A {tuple(A.shape)} / lora_B {tuple(B.shape)}, "
                f"want ({r}, {d_in}) / ({d_out}, {r})",
            )
        modules[target] = LoraModule(A=A, B=B, scaling=config.scaling(hf_module))
    if not modules:
        raise AdapterConfigError("target_modules", f"{path / WEIGHTS_FILE}: no LoRA weights")
    return LoraAdapter(config=config, modules=modules)


def save_adapter(adapter: LoraAdapter, path: str | Path, model_config: ModelConfig) -> None:
    """Write `adapter` in PEFT format (which `read_adapter` and `peft.PeftModel` load)."""
    tensors: dict[str, torch.Tensor] = {}
    for target, module in adapter.modules.items():
        prefix = _PREFIX + hf_module_of_target(target, model_config)
        tensors[f"{prefix}.lora_A.weight"] = module.A.detach().contiguous().cpu()
        tensors[f"{prefix}.lora_B.weight"] = module.B.detach().contiguous().cpu()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_FILE).write_text(json.dumps(adapter.config.to_json(), indent=2) + "\n")
    save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
