"""Compute kernels of the model layers: paged attention, Mamba2 SSM scan/update, causal conv1d,
batched multi-adapter LoRA, and the projections' `linear`.

Each public function has the signature of its PyTorch reference (`*_ref` modules) plus two
keywords that pick the implementation serving the call:

    use_triton=None (default)  Triton when the tensors are on CUDA, else the PyTorch path
    use_triton=True            Triton (tests run it on CPU under TRITON_INTERPRET=1)
    use_triton=False           the PyTorch path, whatever the device
    reference=True             the reference itself (not with use_triton=True)

The PyTorch path, which serves CPU tensors, is the vectorised `*_torch` module where there is
one (`attention_torch`: paged decode and extend attention; `mamba_torch`: the single-step SSM
update) and the reference otherwise; fp32 paged decode attention takes a C kernel built for the
machine on first use (`attention_cpu`, `cpu_native`) in front of `attention_torch`. The
references stay minimal and obviously correct: they are the oracle every other implementation
is tested against. The Triton modules are imported
on first use, so a CPU-only process never needs triton.

`linear` has no Triton version: cuBLAS serves it on a GPU; on CPU, fp32 projections run on
pre-packed weights through our own GEMM (`cpu_gemm`, C built for the machine on first use) or
oneDNN where no compiler is present (`linear_cpu` says why).
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from compute_service.kernels import (
    attention_cpu,
    attention_ref,
    attention_torch,
    conv_ref,
    linear_cpu,
    lora_cpu,
    lora_ref,
    mamba_ref,
    mamba_torch,
)
from compute_service.kernels.lora_ref import LoraSegments, lora_segments
from compute_service.kernels.mamba_ref import ChunkLayout, mamba_chunk_layout

__all__ = [
    "ChunkLayout",
    "LoraSegments",
    "causal_conv1d",
    "causal_conv1d_update",
    "extend_attention",
    "lora_apply",
    "linear",
    "linear_group",
    "lora_segments",
    "mamba_chunk_layout",
    "mamba_chunk_scan",
    "paged_decode_attention",
    "selective_state_update",
    "write_kv",
]


def _impl(
    reference: ModuleType,
    torch_path: ModuleType,
    triton_module: str,
    probe: torch.Tensor,
    use_triton: bool | None,
    use_reference: bool,
) -> ModuleType:
    """The module whose function serves this call (see the module docstring): `reference`,
    `torch_path` (the reference itself for kernels without a vectorised version) or the named
    Triton module."""
    if use_reference:
        if use_triton:
            raise ValueError("reference=True and use_triton=True are exclusive")
        return reference
    if use_triton is None:
        use_triton = probe.is_cuda
    if not use_triton:
        return torch_path
    return importlib.import_module(f"compute_service.kernels.{triton_module}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ weight.T + bias, as `torch.nn.functional.linear` (see `linear_group`)."""
    return linear_group(x, [weight], [bias])[0]


def linear_group(
    x: torch.Tensor, weights: list[torch.Tensor], biases: list[torch.Tensor | None]
) -> list[torch.Tensor]:
    """[linear(x, w, b) for each pair]: on CPU one GEMM over the stacked weights (outputs are
    column views of one tensor, see `linear_cpu.linear_group`), elsewhere one call each."""
    if x.is_cuda:
        return [torch.nn.functional.linear(x, w, b) for w, b in zip(weights, biases, strict=True)]
    return linear_cpu.linear_group(x, weights, biases)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """See `attention_ref.write_kv`: `attention_torch.write_kv` on every device (an indexed copy;
    there is no Triton version)."""
    attention_torch.write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int = 0,
    *,
    use_triton: bool | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """See `attention_ref.paged_decode_attention`."""
    impl = _impl(attention_ref, attention_cpu, "attention_triton", q, use_triton, reference)
    return impl.paged_decode_attention(
        q, k_cache, v_cache, block_tables, seq_lens, sm_scale, window
    )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    sm_scale: float,
    window: int = 0,
    *,
    use_triton: bool | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """See `attention_ref.extend_attention`."""
    impl = _impl(attention_ref, attention_torch, "attention_triton", q, use_triton, reference)
    return impl.extend_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, sm_scale, window
    )


def mamba_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    cu_seqlens: torch.Tensor,
    initial_states: torch.Tensor | None,
    seq_start_pos: torch.Tensor,
    chunk_size: int,
    *,
    use_triton: bool | None = None,
    reference: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `mamba_ref.mamba_chunk_scan`."""
    impl = _impl(mamba_ref, mamba_ref, "mamba_triton", x, use_triton, reference)
    return impl.mamba_chunk_scan(
        x, dt, dt_bias, A, B, C, D, cu_seqlens, initial_states, seq_start_pos, chunk_size
    )


def selective_state_update(
    ssm_state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    dt_bias: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    state_indices: torch.Tensor,
    *,
    use_triton: bool | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """See `mamba_ref.selective_state_update`."""
    impl = _impl(mamba_ref, mamba_torch, "mamba_triton", x, use_triton, reference)
    return impl.selective_state_update(ssm_state, x, dt, dt_bias, A, B, C, D, state_indices)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_states: torch.Tensor,
    state_indices: torch.Tensor,
    has_initial_state: torch.Tensor,
    activation: str | None = "silu",
    *,
    use_triton: bool | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """See `conv_ref.causal_conv1d`."""
    impl = _impl(conv_ref, conv_ref, "conv_triton", x, use_triton, reference)
    return impl.causal_conv1d(
        x, weight, bias, cu_seqlens, conv_states, state_indices, has_initial_state, activation
    )


def causal_conv1d_update(
    x: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    activation: str | None = "silu",
    *,
    use_triton: bool | None = None,
    reference: bool = False,
) -> torch.Tensor:
    """See `conv_ref.causal_conv1d_update`."""
    impl = _impl(conv_ref, conv_ref, "conv_triton", x, use_triton, reference)
    return impl.causal_conv1d_update(x, conv_states, weight, bias, state_indices, activation)


def lora_apply(
    y: torch.Tensor,
    x: torch.Tensor,
    A_stack: torch.Tensor,
    B_stack: torch.Tensor,
    scaling: torch.Tensor,
    token_slot: torch.Tensor,
    segments: LoraSegments | None = None,
    *,
    B_t: torch.Tensor | None = None,
    use_triton: bool | None = None,
    reference: bool = False,
) -> None:
    """See `lora_ref.lora_apply`. `B_t`, B_stack transposed to [S, r_max, out], lets fp32 CPU
    tensors take the C kernel (`lora_cpu`); the other paths ignore it."""
    impl = _impl(lora_ref, lora_cpu, "lora_triton", x, use_triton, reference)
    if impl is lora_cpu:
        lora_cpu.lora_apply(y, x, A_stack, B_stack, scaling, token_slot, segments, B_t)
    else:
        impl.lora_apply(y, x, A_stack, B_stack, scaling, token_slot, segments)
