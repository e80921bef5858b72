"""LoRA adapters for the compute service: PEFT adapter I/O and validation, the slot registry
that builds each forward call's `LoraBatch`, random adapters and the merged-weights reference.
See README.md in this folder for the engine-facing API."""

from compute_service.lora.adapter import LoraAdapter, LoraModule, read_adapter, save_adapter
from compute_service.lora.config import (
    AdapterConfigError,
    LoraConfig,
    parse_lora_config,
    validate_adapter_name,
)
from compute_service.lora.merge import merged_model
from compute_service.lora.registry import (
    AdapterExistsError,
    AdapterInfo,
    AdapterNotFoundError,
    AdapterRegistry,
    NoFreeSlotError,
)
from compute_service.lora.synthetic import random_adapter, write_random_adapter
from compute_service.lora.targets import target_linears, target_shapes

__all__ = [
    "AdapterConfigError",
    "AdapterExistsError",
    "AdapterInfo",
    "AdapterNotFoundError",
    "AdapterRegistry",
    "LoraAdapter",
    "LoraConfig",
    "LoraModule",
    "NoFreeSlotError",
    "merged_model",
    "parse_lora_config",
    "random_adapter",
    "read_adapter",
    "save_adapter",
    "target_linears",
    "target_shapes",
    "validate_adapter_name",
    "write_random_adapter",
]
