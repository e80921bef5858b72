"""The version counter of a tensor, for caches that must notice in-place changes."""
from __future__ import annotations

import torch


def tensor_version(t: torch.Tensor) -> int:
    """`t._version`, which every in-place change bumps; -1 for an inference tensor, which has no
    version counter, so an in-place change of one goes unseen (model weights and the engine's
    batch tensors are not changed in place under inference_mode)."""
    try:
        return t._version
    except RuntimeError:
        return -1
