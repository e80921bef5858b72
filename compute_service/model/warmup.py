"""A CPU worker's warm-up, run before it reports ready: every projection packed for the C GEMM
(compute_service/kernels/linear_cpu.py) now rather than on the first request, which made that
request ~10x slower than the next, and each packed copy replacing its weight rather than doubling
the model in memory.

The projections are called exactly as the forward calls them (the same groups, in the same order:
q/k/v and gate/up stacked, the others alone, the logits on the output weight), because the
packed stack is cached per group. A tied embedding is packed for the logits; with the native
GEMM its lookup then reads rows of the packed copy (`linear_cpu.packed_rows`) and its storage is
released too; with oneDNN (an opaque layout) it keeps its storage.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from compute_service.kernels.linear_cpu import backend, release_after_packing
from compute_service.model.lora_batch import project, project_group
from compute_service.model.model import CausalLM

__all__ = ["warm_up"]

_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",),
           ("in_proj",), ("out_proj",))


def _groups(model: CausalLM):
    for module in model.modules():
        for names in _GROUPS:
            linears = [getattr(module, n, None) for n in names]
            if all(isinstance(lin, nn.Linear) for lin in linears):
                yield linears, names


def warm_up(model: CausalLM, release: bool = True) -> int:
    """Packs every projection of a CPU model (no-op elsewhere); with `release`, the packed copies
    replace the weights (the model then serves but cannot be saved or cast). Returns the number
    of projection groups packed."""
    if model.device.type != "cpu":
        return 0
    groups = list(_groups(model))
    embed = model.embed.weight
    if release:
        for linears, _ in groups:
            for lin in linears:
                if lin.weight is not embed:
                    release_after_packing(lin.weight)
        if model.lm_head is not None and model.lm_head.weight is not embed:
            release_after_packing(model.lm_head.weight)
        elif model.lm_head is None and backend() == "native":
            # Tied: the lookup reads rows of the native packed copy (packed_rows) instead.
            release_after_packing(embed)
    with torch.no_grad():
        for linears, names in groups:
            x = torch.zeros(1, linears[0].in_features, dtype=model.dtype)
            if len(linears) == 1:
                project(linears[0], x, None, names[0])
            else:
                project_group(linears, x, None, names)
        model.logits(torch.zeros(1, model.config.hidden_size, dtype=model.dtype))
    _return_freed_memory()
    return len(groups) + 1


def _return_freed_memory() -> None:
    """glibc keeps the heap the loading and packing temporaries freed (the dequantized tensors,
    the stacked weights) and counts it in RSS; malloc_trim hands it back to the OS."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to do
