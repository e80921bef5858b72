"""The decoder model of the compute service: config, HF checkpoint I/O, presets, tokenizers and
the paged forward pass. See README.md in this folder for the engine-facing contract."""

from compute_service.model.batch import (
    ForwardBatch,
    ForwardMode,
    ForwardOutput,
    MambaBoundaryStates,
    allocate_kv_caches,
    allocate_mamba_states,
)
from compute_service.model.checkpoint import load_model, read_config, save_model
from compute_service.model.config import ATTENTION, MAMBA, MLP, ModelConfig, RopeScaling
from compute_service.model.hf_config import (
    SUPPORTED_MODEL_TYPES,
    UnsupportedConfigError,
    config_from_hf,
)
from compute_service.model.hf_export import config_to_hf
from compute_service.model.lora_batch import LORA_TARGETS, LayerLora, LoraBatch, LoraWeights
from compute_service.model.model import CausalLM
from compute_service.model.presets import PRESETS, build_preset, init_random_, preset_config
from compute_service.model.generation import SamplingDefaults, read_sampling_defaults
from compute_service.model.tokenizer import (ByteTokenizer, JsonTokenizer, NoTokenizer,
                                            NoTokenizerError, Tokenizer, load_tokenizer)

__all__ = [
    "ATTENTION",
    "LORA_TARGETS",
    "MAMBA",
    "MLP",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "ByteTokenizer",
    "CausalLM",
    "ForwardBatch",
    "ForwardMode",
    "ForwardOutput",
    "JsonTokenizer",
    "LayerLora",
    "LoraBatch",
    "LoraWeights",
    "MambaBoundaryStates",
    "ModelConfig",
    "NoTokenizer",
    "NoTokenizerError",
    "RopeScaling",
    "SamplingDefaults",
    "Tokenizer",
    "UnsupportedConfigError",
    "allocate_kv_caches",
    "allocate_mamba_states",
    "build_preset",
    "config_from_hf",
    "config_to_hf",
    "init_random_",
    "load_model",
    "load_tokenizer",
    "preset_config",
    "read_config",
    "read_sampling_defaults",
    "save_model",
]
