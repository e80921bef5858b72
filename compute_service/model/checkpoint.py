"""Hugging Face format checkpoints: config.json + *.safetensors (single file or sharded with
model.safetensors.index.json), read into `CausalLM` and written back.

Tensor names are mapped per family between HF's modules and ours (see `CausalLM`):

    llama/qwen2/mistral  model.embed_tokens | model.layers.i.{input_layernorm, self_attn,
                         post_attention_layernorm, mlp} | model.norm | lm_head
    bamba                model.embed_tokens | model.layers.i.{input_layernorm, self_attn | mamba,
                         pre_ff_layernorm, feed_forward} | model.final_layernorm | lm_head
    mamba2               backbone.embeddings (or .embedding) | backbone.layers.i.{norm, mixer} |
                         backbone.norm_f | lm_head
    nemotron_h           model.embeddings | model.layers.i.{norm, mixer} | model.norm_f | lm_head
                         (NVIDIA's own files say backbone. for model.); `mixer` is the layer's
                         attention, Mamba2 or MLP, by the config's layer kinds
    falcon_h1            model.embed_tokens | model.layers.i.{input_layernorm, self_attn, mamba,
                         pre_ff_layernorm, feed_forward} | model.final_layernorm | lm_head
    granitemoehybrid     model.embed_tokens | model.layers.i.{input_layernorm, self_attn | mamba,
                         post_attention_layernorm, shared_mlp, block_sparse_moe} | model.norm |
                         lm_head; block_sparse_moe.{router.layer, input_linear, output_linear}
                         are our moe.{gate, experts.gate_up_proj, experts.down_proj} (stacked)

    qwen3/qwen3_moe      as llama, plus self_attn.{q,k}_norm; MoE layers' mlp.gate (router) and
                         mlp.experts (see below)

Mamba's conv1d.weight [C, 1, W] becomes conv_weight [C, W]. With tied embeddings an `lm_head`
tensor in the file is ignored (HF ties it to the embedding too). MoE experts are read either
stacked (`mlp.experts.{gate_up_proj,down_proj}`, transformers v5's in-memory names) or one
tensor per expert (`mlp.experts.{e}.{gate,up,down}_proj.weight`, the hub layout, which
save_model writes); every expert's three tensors must be present.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from compute_service.model.config import ModelConfig
from compute_service.model.hf_config import config_from_hf
from compute_service.model.hf_export import config_to_hf
from compute_service.model.model import CausalLM

_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
# Buffers some exporters wrote next to the weights; recomputed here, so skipped.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One expert's projection in the hub layout (our name after mapping) -> a slice of the stack.
_EXPERT = re.compile(r"^(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


@dataclass(frozen=True, slots=True)
class _NameMap:
    prefix: str
    top: tuple[tuple[str, str], ...]  # (hf name without prefix, our name)
    layer: tuple[tuple[str, str], ...]  # (hf sub-module prefix, our sub-module prefix)
    # Other spellings of `prefix` accepted when reading.
    aliases: tuple[str, ...] = ()


# Our prefix standing for "the module of this layer's kind" (NemotronH's single `mixer`).
_BY_KIND = "<kind>."
_KIND_MODULE = {"attention": "attn.", "mamba": "mamba.", "mlp": "mlp."}


_TRANSFORMER = _NameMap(
    "model.",
    (("embed_tokens.weight", "embed.weight"), ("norm.weight", "final_norm.weight")),
    (
        ("input_layernorm.", "norm1."),
        ("self_attn.", "attn."),
        ("post_attention_layernorm.", "norm2."),
        ("mlp.", "mlp."),
    ),
)
# Bamba's names; Falcon-H1 writes its parallel attention + Mamba block with the same ones.
_BAMBA = _NameMap(
    "model.",
    (("embed_tokens.weight", "embed.weight"), ("final_layernorm.weight", "final_norm.weight")),
    (
        ("input_layernorm.", "norm1."),
        ("self_attn.", "attn."),
        ("mamba.", "mamba."),
        ("pre_ff_layernorm.", "norm2."),
        ("feed_forward.", "mlp."),
    ),
)
_NAME_MAPS = {
    "llama": _TRANSFORMER,
    "qwen2": _TRANSFORMER,
    "qwen3": _TRANSFORMER,
    "qwen3_moe": _TRANSFORMER,
    "mistral": _TRANSFORMER,
    "bamba": _BAMBA,
    "mamba2": _NameMap(
        "backbone.",
        (
            ("embeddings.weight", "embed.weight"),
            ("embedding.weight", "embed.weight"),  # older exports
            ("norm_f.weight", "final_norm.weight"),
        ),
        (("norm.", "norm1."), ("mixer.", "mamba.")),
    ),
    "nemotron_h": _NameMap(
        "model.",
        (("embeddings.weight", "embed.weight"), ("norm_f.weight", "final_norm.weight")),
        (("norm.", "norm1."), ("mixer.", _BY_KIND)),
        aliases=("backbone.",),
    ),
    "falcon_h1": _BAMBA,
    "granitemoehybrid": _NameMap(
        "model.",
        (("embed_tokens.weight", "embed.weight"), ("norm.weight", "final_norm.weight")),
        (
            ("input_layernorm.", "norm1."),
            ("self_attn.", "attn."),
            ("mamba.", "mamba."),
            ("post_attention_layernorm.", "norm2."),
            ("shared_mlp.", "mlp."),
            # The MoE block beside the shared MLP: hub names first (what save_model and
            # transformers' save_pretrained write), then transformers v5's in-memory names.
            ("block_sparse_moe.router.layer.", "moe.gate."),
            ("block_sparse_moe.input_linear.weight", "moe.experts.gate_up_proj"),
            ("block_sparse_moe.output_linear.weight", "moe.experts.down_proj"),
            ("block_sparse_moe.router.", "moe.gate."),
            ("block_sparse_moe.experts.", "moe.experts."),
        ),
    ),
}
_MIXER_RENAMES = (
    ("mamba.conv1d.weight", "mamba.conv_weight"),
    ("mamba.conv1d.bias", "mamba.conv_bias"),
)


def _kind_module(layer: str, layer_types: tuple[str, ...], name: str) -> str:
    i = int(layer)
    if i >= len(layer_types):
        raise ValueError(f"tensor {name!r}: layer {i} is not in this config")
    return _KIND_MODULE[layer_types[i]]


def hf_to_ours(name: str, model_type: str, layer_types: tuple[str, ...] = ()) -> str | None:
    """Our parameter name for HF tensor `name`, None for tensors that are skipped.
    `layer_types` (the config's) is needed by families whose module names do not say the layer
    kind (nemotron_h)."""
    if name == "lm_head.weight":
        return name
    if name.endswith(_IGNORED_SUFFIXES):
        return None
    m = _NAME_MAPS[model_type]
    rest = name
    for prefix in (m.prefix, *m.aliases):
        if name.startswith(prefix):
            rest = name.removeprefix(prefix)
            break
    for hf, ours in m.top:
        if rest == hf:
            return ours
    match = _LAYER.match(rest)
    if match:
        sub = match.group(2)
        for hf, ours in m.layer:
            if sub.startswith(hf):
                if ours == _BY_KIND:
                    ours = _kind_module(match.group(1), layer_types, name)
                sub = ours + sub[len(hf) :]
                for old, new in _MIXER_RENAMES:
                    sub = sub.replace(old, new)
                return f"layers.{match.group(1)}.{sub}"
    raise ValueError(f"tensor {name!r}: not a known {model_type} weight")


def ours_to_hf(name: str, model_type: str) -> str:
    """HF tensor name of our parameter `name` (the first HF spelling where there are several)."""
    if name == "lm_head.weight":
        return name
    m = _NAME_MAPS[model_type]
    for hf, ours in m.top:
        if name == ours:
            return m.prefix + hf
    match = _LAYER.match(name)
    if match is None:
        raise ValueError(f"parameter {name!r}: no HF name")
    sub = match.group(2)
    for old, new in _MIXER_RENAMES:
        sub = sub.replace(new, old)
    for hf, ours in m.layer:
        for candidate in _KIND_MODULE.values() if ours == _BY_KIND else (ours,):
            if sub.startswith(candidate):
                return f"{m.prefix}layers.{match.group(1)}.{hf}{sub[len(candidate):]}"
    raise ValueError(f"parameter {name!r}: no HF name")


def _expert_slice(name: str, params: dict[str, torch.nn.Parameter]):
    """For a per-expert tensor name (ours), (stacked parameter name, the view of it that the
    tensor fills, piece id); None for any other name."""
    match = _EXPERT.match(name)
    if match is None:
        return None
    prefix, e, part = match.group(1), int(match.group(2)), match.group(3)
    stacked = f"{prefix}.{'down_proj' if part == 'down' else 'gate_up_proj'}"
    if stacked not in params or e >= params[stacked].shape[0]:
        return None
    p = params[stacked]
    inter = p.shape[1] // 2
    view = {"gate": p[e, :inter], "up": p[e, inter:], "down": p[e]}[part]
    return stacked, view, (e, part)


def _expert_pieces(stacked: str, params: dict[str, torch.nn.Parameter]) -> set[tuple[int, str]]:
    parts = ("down",) if stacked.endswith("down_proj") else ("gate", "up")
    return {(e, part) for e in range(params[stacked].shape[0]) for part in parts}


def read_config(path: str | Path) -> ModelConfig:
    """Parse `path/config.json` (raises UnsupportedConfigError naming an unsupported field)."""
    return config_from_hf(json.loads((Path(path) / "config.json").read_text()))


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    return files


def load_model(
    path: str | Path, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> CausalLM:
    """Build a CausalLM from an HF-format directory. Every parameter must be present in the
    files (except `lm_head` with tied embeddings); extra unknown tensors are an error too, since
    they usually mean a variant this code does not implement."""
    path = Path(path)
    cfg = read_config(path)
    model = CausalLM.empty(cfg, dtype, device)
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    pieces: dict[str, set[tuple[int, str]]] = {}  # stacked expert tensor -> pieces read
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                name = hf_to_ours(hf_name, cfg.model_type, cfg.layer_types)
                if name is None or (name == "lm_head.weight" and cfg.tie_word_embeddings):
                    continue
                expert = _expert_slice(name, params)
                if name not in params and expert is None:
                    raise ValueError(
                        f"tensor {hf_name!r} in {file.name}: no such parameter in this config"
                    )
                tensor = f.get_tensor(hf_name)
                target = params[name] if expert is None else expert[1]
                if name.endswith("conv_weight"):
                    tensor = tensor.reshape(tensor.shape[0], -1)
                if tensor.shape != target.shape:
                    raise ValueError(
                        f"tensor {hf_name!r}: shape {tuple(tensor.shape)}, "
                        f"want {tuple(target.shape)}"
                    )
                with torch.no_grad():
                    target.copy_(tensor)
                if expert is None:
                    loaded.add(name)
                else:
                    pieces.setdefault(expert[0], set()).add(expert[2])
    loaded |= {n for n, got in pieces.items() if got == _expert_pieces(n, params)}
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(
            f"{path}: missing tensors for {missing[:8]}{' ...' if len(missing) > 8 else ''}"
        )
    return model.eval()


def _split_experts(hf_name: str, stacked: torch.Tensor) -> dict[str, torch.Tensor]:
    """A stacked expert tensor as the hub's one tensor per expert and projection."""
    prefix, _, kind = hf_name.rpartition(".")
    out = {}
    for e, w in enumerate(stacked):
        if kind == "down_proj":
            out[f"{prefix}.{e}.down_proj.weight"] = w.contiguous().cpu()
        else:
            gate, up = w.chunk(2)
            out[f"{prefix}.{e}.gate_proj.weight"] = gate.contiguous().cpu()
            out[f"{prefix}.{e}.up_proj.weight"] = up.contiguous().cpu()
    return out


def save_model(model: CausalLM, path: str | Path) -> None:
    """Write `model` as an HF checkpoint of its `config.model_type` (config.json +
    model.safetensors) that both `load_model` and transformers can load. Raises
    UnsupportedConfigError when the config uses a feature the family cannot express."""
    cfg = model.config
    hf_config = config_to_hf(cfg)
    hf_config["torch_dtype"] = str(model.dtype).removeprefix("torch.")
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if name.endswith("conv_weight"):
            t = t[:, None, :]
        hf_name = ours_to_hf(name, cfg.model_type)
        if hf_name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            # No stacked name on the hub (Qwen3-MoE): one tensor per expert. Granite's hub
            # names (block_sparse_moe.input_linear, ...) are stacked and saved as they are.
            tensors |= _split_experts(hf_name, t)
            continue
        tensors[hf_name] = t.contiguous().cpu()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
