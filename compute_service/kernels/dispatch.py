"""The kernels' one dispatch table (operation -> the modules implementing it) and `choose`, the
one function that picks which of them serves a call.

Backends, one column each (a module of this package, or "" where there is none):

    ref     the minimal PyTorch reference: it defines the operation's signature and semantics and
            is the oracle every other backend is tested against (`reference=True` forces it)
    torch   the vectorised PyTorch path; where there is none the reference serves instead
    triton  the Triton kernel: CUDA tensors by default, any tensors with `use_triton=True`
            (tests run it on CPU under TRITON_INTERPRET=1); imported on first use, so a CPU-only
            process never imports triton
    cpu     the CPU path in front of `torch` for fp32 CPU tensors: the C kernels built on first use
            (`cpu_native`) or oneDNN for `linear_group`. Each such module still checks, per call,
            that the C kernel takes the tensors (shapes, layout, the library built here) and
            otherwise hands the call to the torch path (or the reference) itself.

Every backend takes the reference's parameters under the same names (keywords pass through), so
a public function is the reference's signature plus `use_triton` / `reference` (and, for
`lora_apply`, the keyword `B_t` that only the cpu backend reads).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

import torch

__all__ = ["BACKENDS", "TABLE", "Backends", "choose", "cpu_status", "public"]

PACKAGE = "compute_service.kernels"
BACKENDS = ("ref", "torch", "triton", "cpu")


class Backends(NamedTuple):
    ref: str
    torch: str
    triton: str
    cpu: str
    probe: str  # the argument whose device and dtype decide
    cpu_only: tuple[str, ...] = ()  # keywords only the cpu backend takes


# operation                       ref              torch              triton              cpu              probe
TABLE: dict[str, Backends] = {
    "write_kv":               Backends("attention_ref", "attention_torch", "",                 "",              "k"),
    "paged_decode_attention": Backends("attention_ref", "attention_torch", "attention_triton", "attention_cpu", "q"),
    "extend_attention":       Backends("attention_ref", "attention_torch", "attention_triton", "",              "q"),
    "mamba_chunk_scan":       Backends("mamba_ref",     "",                "mamba_triton",     "",              "x"),
    "selective_state_update": Backends("mamba_ref",     "mamba_torch",     "mamba_triton",     "",              "x"),
    "causal_conv1d":          Backends("conv_ref",      "",                "conv_triton",      "",              "x"),
    "causal_conv1d_update":   Backends("conv_ref",      "",                "conv_triton",      "",              "x"),
    "lora_apply":             Backends("lora_ref",      "",                "lora_triton",      "lora_cpu",      "x", ("B_t",)),
    "linear_group":           Backends("linear_ref",    "linear_torch",    "",                 "linear_cpu",    "x"),
    "fused_moe":              Backends("moe_ref",       "",                "moe_triton",       "",              "x"),
    "rms_norm":               Backends("norm_rope_ref", "",                "norm_rope_triton", "",              "x"),
    "rope":                   Backends("norm_rope_ref", "",                "norm_rope_triton", "",              "x"),
}  # fmt: skip


def choose(
    op: str, probe: torch.Tensor, *, use_triton: bool | None = None, reference: bool = False
) -> str:
    """The backend ("ref", "torch", "triton" or "cpu") that serves `op` for tensors like `probe`:

        reference=True            the reference (not with use_triton=True)
        use_triton=True           Triton, whatever the device
        use_triton=None (default) Triton for CUDA tensors where `op` has a Triton kernel, else
                                  as use_triton=False
        use_triton=False          the cpu path for fp32 tensors off CUDA where `op` has one,
                                  else the torch path, else the reference
    """
    row = TABLE[op]
    if reference:
        if use_triton:
            raise ValueError("reference=True and use_triton=True are exclusive")
        return "ref"
    if use_triton is None:
        use_triton = bool(row.triton) and probe.is_cuda
    if use_triton:
        if not row.triton:
            raise ValueError(f"{op} has no Triton kernel")
        return "triton"
    if row.cpu and not probe.is_cuda and probe.dtype == torch.float32:
        return "cpu"
    return "torch" if row.torch else "ref"


def module(name: str) -> ModuleType:
    """The kernel module `name` of this package, imported now if it is not yet."""
    return sys.modules.get(f"{PACKAGE}.{name}") or importlib.import_module(f"{PACKAGE}.{name}")


def public(op: str) -> Callable[..., Any]:
    """The public function of `op`: the reference's signature (and docstring) plus `use_triton`
    and `reference`, calling the backend `choose` picks."""
    row = TABLE[op]
    ref_fn = getattr(module(row.ref), op)
    params = list(inspect.signature(ref_fn).parameters.values())
    probe_at = [p.name for p in params].index(row.probe)
    dropped = dict.fromkeys(row.cpu_only)
    modules: dict[str, ModuleType] = {}  # backend -> its module, once imported

    @functools.wraps(ref_fn)
    def call(*args: Any, use_triton: bool | None = None, reference: bool = False, **kwargs: Any):
        probe = args[probe_at] if len(args) > probe_at else kwargs[row.probe]
        backend = choose(op, probe, use_triton=use_triton, reference=reference)
        if backend != "cpu" and dropped:
            kwargs = {k: v for k, v in kwargs.items() if k not in dropped}
        impl = modules.get(backend) or modules.setdefault(backend, module(getattr(row, backend)))
        return getattr(impl, op)(*args, **kwargs)  # looked up per call: tests patch it

    keyword = inspect.Parameter.KEYWORD_ONLY
    extra = [inspect.Parameter(name, keyword, default=None) for name in row.cpu_only]
    extra += [inspect.Parameter("use_triton", keyword, default=None),
              inspect.Parameter("reference", keyword, default=False)]
    call.__signature__ = inspect.signature(ref_fn).replace(parameters=params + extra)
    call.__module__ = PACKAGE
    return call


def cpu_status() -> dict[str, str | None]:
    """What serves fp32 CPU kernels in this process, for logs and benchmark records (builds the
    C kernels now if they are not yet)."""
    cpu_native, linear_cpu = module("cpu_native"), module("linear_cpu")
    lib = cpu_native.library()
    return {
        "gemm": linear_cpu.backend(),
        "decode_attention": "native" if lib is not None else "torch",
        "library": lib._name if lib is not None else None,
    }
