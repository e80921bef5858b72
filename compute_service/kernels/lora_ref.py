"""Plain PyTorch reference for the batched multi-adapter LoRA update (SGMV / punica style).

One projection `y = x @ W.T` of a batch whose tokens use different adapters gets, per token t
with slot s = token_slot[t] >= 0,

    y[t] += scaling[s] * (x[t] @ A_stack[s].T) @ B_stack[s].T

A_stack [S, r_max, in] and B_stack [S, out, r_max] hold one adapter per slot; an adapter of rank
r < r_max has rows r.. of A and columns r.. of B zero. Tokens with slot -1 (the base model) are
untouched, and so is every slot no token names: its weights are never read (they may be stale
or garbage). Arithmetic is fp32; y is rounded once, after the add.

Tokens are grouped by slot through `LoraSegments` (a stable sort of the token indices by slot),
which both implementations use; compute it once per forward and pass it to every projection.

Backends (`dispatch.TABLE`), each tested against this reference at the dtype's tolerance
(tests/compute_service/kernels/helpers.py: relative 1e-4 for fp32 interpreted on CPU, 5e-3
compiled on a GPU (TF32 dots), 4e-3 for fp16, 2e-2 for bf16, scaled by the output's magnitude):
- `lora_triton` (CUDA by default): fp32 and fp16 interpreted on CPU, bf16 compiled on a GPU.
- `lora_cpu`: the C kernel for fp32 CPU tensors given B transposed: fp32.
There is no vectorised torch path: this reference serves the other CPU tensors. It is itself
checked against the per-token definition in float64 at rtol = atol = 1e-5.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoraSegments:
    """The tokens of each slot, as runs of one slot-sorted token order.

    order [T] int64: token indices stably sorted by slot (the -1 tokens first);
    starts [S] int32: where slot s's run begins in `order`; counts [S] int32: its length.
    Slot s's tokens are order[starts[s] : starts[s] + counts[s]], in increasing token order.
    """

    order: torch.Tensor
    starts: torch.Tensor
    counts: torch.Tensor


def lora_segments(token_slot: torch.Tensor, num_slots: int) -> LoraSegments:
    """Group the tokens of `token_slot` [T] int32 (values in -1 .. num_slots-1) by slot.

    Device-side only (no host synchronisation), so it can be built once per forward on a GPU.
    A token with a slot >= num_slots belongs to no run, i.e. is treated like -1.
    """
    shifted = token_slot.long() + 1  # -1 -> 0, slot s -> s + 1
    order = torch.argsort(shifted, stable=True)
    per_bucket = torch.bincount(shifted, minlength=num_slots + 1)[: num_slots + 1]
    ends = torch.cumsum(per_bucket, 0)
    return LoraSegments(
        order=order,
        starts=ends[:-1].to(torch.int32),  # tokens with a smaller slot (or -1) come first
        counts=per_bucket[1:].to(torch.int32),
    )


def check_lora_args(
    y: torch.Tensor,
    x: torch.Tensor,
    A_stack: torch.Tensor,
    B_stack: torch.Tensor,
    scaling: torch.Tensor,
    token_slot: torch.Tensor,
) -> None:
    """Shape/dtype checks shared by both implementations (no host synchronisation)."""
    T, d_in = x.shape
    S, r_max, a_in = A_stack.shape
    if a_in != d_in:
        raise ValueError(f"A_stack: in dim {a_in} != x's {d_in}")
    if B_stack.shape != (S, y.shape[1], r_max):
        raise ValueError(f"B_stack: shape {tuple(B_stack.shape)}, want {(S, y.shape[1], r_max)}")
    if y.shape[0] != T or token_slot.shape != (T,):
        raise ValueError(f"y/token_slot: want {T} rows like x")
    if scaling.shape != (S,):
        raise ValueError(f"scaling: shape {tuple(scaling.shape)}, want ({S},)")
    if not (x.dtype == y.dtype == A_stack.dtype == B_stack.dtype):
        raise ValueError("y, x, A_stack and B_stack must share one dtype")


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    A_stack: torch.Tensor,
    B_stack: torch.Tensor,
    scaling: torch.Tensor,
    token_slot: torch.Tensor,
    segments: LoraSegments | None = None,
) -> None:
    """y [T, out] += scaling[s] * (x [T, in] @ A_stack[s].T) @ B_stack[s].T for each token's slot.

    A_stack [S, r_max, in], B_stack [S, out, r_max], scaling [S] (fp32), token_slot [T] int32
    with -1 = no adapter. `segments` is `lora_segments(token_slot, S)`, computed here if None.
    Updates y in place; x, A_stack, B_stack and y share one dtype.
    """
    check_lora_args(y, x, A_stack, B_stack, scaling, token_slot)
    if segments is None:
        segments = lora_segments(token_slot, A_stack.shape[0])
    starts, counts = segments.starts.tolist(), segments.counts.tolist()
    for s, (start, n) in enumerate(zip(starts, counts, strict=True)):
        if n == 0:
            continue
        rows = segments.order[start : start + n]
        shrunk = (x[rows].float() @ A_stack[s].float().T) * scaling[s].float()
        delta = shrunk @ B_stack[s].float().T
        y[rows] = (y[rows].float() + delta).to(y.dtype)
