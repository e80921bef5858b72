"""The batched multi-adapter LoRA update on CPU: the C kernel of `csrc/lora.c` (built by
`cpu_native`) for fp32 where the adapter registry keeps B transposed, the reference otherwise.

Why (see the C file): the reference loops over a batch's adapters in Python, several torch ops
per adapter and projection; the kernel is one call per projection. What mixed adapters cost a
decode: the `lora` part of `python -m prefixcache_bench.compute` (docs/results/README.md).

Backend `cpu` of `dispatch.TABLE` for `lora_apply`. Tested against `lora_ref` in fp32 at
relative 1e-4 (tests/compute_service/kernels/helpers.py).
"""
from __future__ import annotations

import torch

from compute_service.kernels import cpu_native, lora_ref

__all__ = ["MAX_RANK", "lora_apply", "native_takes"]

MAX_RANK = 256  # the C kernel's buffer


def native_takes(y: torch.Tensor, x: torch.Tensor, A_stack: torch.Tensor,
                 B_t: torch.Tensor | None) -> bool:
    """Whether the C kernel serves these tensors (fp32 on CPU, unit column stride, B_t given)."""
    return (
        B_t is not None
        and y.dtype == x.dtype == A_stack.dtype == B_t.dtype == torch.float32
        and not (y.is_cuda or x.is_cuda)
        and y.dim() == 2 and y.stride(1) == 1
        and A_stack.is_contiguous() and B_t.is_contiguous() and A_stack.shape[1] <= MAX_RANK
        and cpu_native.enabled()
    )


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    A_stack: torch.Tensor,
    B_stack: torch.Tensor,
    scaling: torch.Tensor,
    token_slot: torch.Tensor,
    segments: lora_ref.LoraSegments | None = None,
    B_t: torch.Tensor | None = None,
) -> None:
    """See `lora_ref.lora_apply`; `B_t` is B_stack transposed to [S, r_max, out] (the registry
    keeps it on CPU), without which the reference serves."""
    if not native_takes(y, x, A_stack, B_t):
        lora_ref.lora_apply(y, x, A_stack, B_stack, scaling, token_slot, segments)
        return
    lora_ref.check_lora_args(y, x, A_stack, B_stack, scaling, token_slot)
    if B_t.shape != (A_stack.shape[0], A_stack.shape[1], y.shape[1]):
        raise ValueError(f"B_t: shape {tuple(B_t.shape)}, want B_stack transposed")
    x = x.contiguous()
    slots = token_slot.to(torch.int32).contiguous()
    scale = scaling.to(torch.float32).contiguous()
    tokens, in_dim = x.shape
    status = cpu_native.library().lora_apply(
        y.data_ptr(), y.stride(0), x.data_ptr(), in_dim, tokens, in_dim, y.shape[1],
        A_stack.data_ptr(), B_t.data_ptr(), scale.data_ptr(), slots.data_ptr(),
        A_stack.shape[0], A_stack.shape[1], torch.get_num_threads(),
    )
    if status != 0:
        raise RuntimeError(f"lora_apply: shapes outside the C kernel ({status})")
