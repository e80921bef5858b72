"""PEFT `adapter_config.json` -> `LoraConfig`, strict about every field whose value would change
the adapter's output in a way the batched LoRA kernel cannot express.

Read: `r`, `lora_alpha`, `use_rslora`, `rank_pattern`, `alpha_pattern`, `target_modules`,
`base_model_name_or_path`. Ignored (training-only or initialisation-only): `lora_dropout`,
`init_lora_weights`, `inference_mode`, `task_type`, `layers_to_transform`, `layers_pattern`,
`exclude_modules` (which modules carry LoRA is read from the weights), LoftQ/EVA/CorDA/LoRA-GA
init configs, `runtime_config`, `revision`, `peft_version`. Everything else listed in
`_UNSUPPORTED` must be unset, and `peft_type` must be LORA.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from compute_service.model.lora_batch import LORA_TARGETS
from prefixcache_client.limits import quote_untrusted

_NAME = re.compile(r"[A-Za-z0-9._-]{1,256}")

# Fields that must be unset (None / False / empty), with why we refuse them.
_UNSUPPORTED: dict[str, str] = {
    "fan_in_fan_out": "weights stored transposed (GPT-2 Conv1D layout) are not supported",
    "use_dora": "DoRA (weight-decomposed LoRA) is not supported",
    "lora_bias": "a bias on lora_B is not supported",
    "modules_to_save": "fully fine-tuned extra modules are not supported",
    "trainable_token_indices": "trainable embedding tokens are not supported",
    "layer_replication": "layer replication is not supported",
    "target_parameters": "LoRA on raw parameters (MoE experts) is not supported",
    "alora_invocation_tokens": "activated LoRA (aLoRA) is not supported",
    "use_qalora": "QA-LoRA is not supported",
    "use_bdlora": "block-diagonal LoRA is not supported",
    "velora_config": "the VeLoRA variant is not supported",
    "monteclora_config": "the MonteCLoRA variant is not supported",
    "arrow_config": "Arrow routing is not supported",
    "kasa_config": "the KaSA variant is not supported",
}


class AdapterConfigError(ValueError):
    """An adapter (its config, its weights, or the request naming it) cannot be served; `field`
    names the offending config field or argument, and starts the message."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def validate_adapter_name(name: str) -> str:
    """`name` if it is 1..256 characters of [A-Za-z0-9._-], else AdapterConfigError("name")."""
    if not isinstance(name, str) or _NAME.fullmatch(name) is None:
        raise AdapterConfigError("name", f"{quote_untrusted(str(name))} must be 1..256 characters "
                                         "of [A-Za-z0-9._-]")
    return name


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup (peft.utils.other.get_pattern_key): the first
    key that matches the end of the module name, on a dotted boundary, as a regex."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return patterns[key]
    return default


@dataclass(slots=True, frozen=True)
class LoraConfig:
    """What of a PEFT LoRA config affects inference. `target_modules` is a tuple of PEFT module
    names, or a string (a regex, "all-linear", or "" for PEFT's architecture default) as PEFT
    allows; the weights say which modules an adapter really targets."""

    r: int
    lora_alpha: float
    use_rslora: bool = False
    target_modules: tuple[str, ...] | str = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    def rank(self, module: str) -> int:
        """The rank PEFT gives the module named `module` (e.g. model.layers.0.self_attn.q_proj)."""
        return int(_pattern_value(self.rank_pattern, module, self.r))

    def scaling(self, module: str) -> float:
        """lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA, using the module's own r and
        alpha (rank_pattern / alpha_pattern)."""
        r = self.rank(module)
        alpha = float(_pattern_value(self.alpha_pattern, module, self.lora_alpha))
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r

    def to_json(self) -> dict[str, Any]:
        """The adapter_config.json PEFT writes for this config (and loads back)."""
        targets = self.target_modules
        return {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": self.base_model_name_or_path,
            "r": self.r,
            "lora_alpha": self.lora_alpha,
            "use_rslora": self.use_rslora,
            "target_modules": (targets or None) if isinstance(targets, str) else sorted(targets),
            "rank_pattern": dict(self.rank_pattern),
            "alpha_pattern": dict(self.alpha_pattern),
            "lora_dropout": 0.0,
            "bias": "none",
            "fan_in_fan_out": False,
            "use_dora": False,
            "modules_to_save": None,
            "inference_mode": True,
        }


def _unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {} or value == ""


def _positive_int(key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise AdapterConfigError(key, f"{value!r} must be a positive integer")
    return value


def _finite(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AdapterConfigError(key, f"{value!r} must be a finite number")
    return float(value)


def _target_modules(value: Any) -> tuple[str, ...] | str:
    if value is None or isinstance(value, str):
        # A regex, "all-linear", or PEFT's per-architecture default: which modules it hit is
        # read from the weights.
        return value or ""
    if not isinstance(value, list) or not value:
        raise AdapterConfigError("target_modules", f"{value!r} must be a non-empty list or a str")
    for name in value:
        # PEFT matches list entries as module-name suffixes, so compare the last component.
        if str(name).rsplit(".", 1)[-1] not in LORA_TARGETS:
            raise AdapterConfigError(
                "target_modules",
                f"{name!r} is not a supported LoRA target (supported: {', '.join(LORA_TARGETS)})",
            )
    return tuple(value)


def parse_lora_config(raw: dict[str, Any]) -> LoraConfig:
    """Validate a parsed adapter_config.json; raises AdapterConfigError naming the field."""
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterConfigError("peft_type", f"{peft_type!r} is not supported (only 'LORA')")
    for key, why in _UNSUPPORTED.items():
        if not _unset(raw.get(key)):
            raise AdapterConfigError(key, f"{raw[key]!r}: {why}")
    bias = raw.get("bias", "none")
    if bias != "none":
        raise AdapterConfigError("bias", f"{bias!r}: only 'none' is supported")
    if "r" not in raw or "lora_alpha" not in raw:
        raise AdapterConfigError("r" if "r" not in raw else "lora_alpha", "required field")
    rank_pattern = raw.get("rank_pattern") or {}
    alpha_pattern = raw.get("alpha_pattern") or {}
    for key, pattern, check in (
        ("rank_pattern", rank_pattern, _positive_int),
        ("alpha_pattern", alpha_pattern, _finite),
    ):
        if not isinstance(pattern, dict):
            raise AdapterConfigError(key, f"{pattern!r} must be an object")
        for value in pattern.values():
            check(key, value)
    return LoraConfig(
        r=_positive_int("r", raw["r"]),
        lora_alpha=_finite("lora_alpha", raw["lora_alpha"]),
        use_rslora=bool(raw.get("use_rslora", False)),
        target_modules=_target_modules(raw.get("target_modules")),
        rank_pattern=dict(rank_pattern),
        alpha_pattern=dict(alpha_pattern),
        base_model_name_or_path=raw.get("base_model_name_or_path"),
    )
