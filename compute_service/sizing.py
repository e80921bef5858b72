"""How many KV pages and Mamba slots a worker allocates: from explicit counts (--device-pages,
--host-pages, --checkpoint-slots), or from a memory budget (design.md §5, "Sizing the pools").

Budgets:
- `--kv-memory-fraction F` (CUDA only): the device budget is F x the device memory that is
  *free once the model's weights are loaded* (torch.cuda.mem_get_info after the load). Not a
  fraction of the total, as vLLM's --gpu-memory-utilization is: what the weights take is already
  gone, so F says directly how much of what is left becomes KV, and 1 - F of it stays free for
  the forward's activations, the LoRA slots, the CUDA context's growth and the allocator's
  fragmentation. 0.85 leaves ~10 GiB on an 80 GB GPU holding an 8B model.
- `--kv-memory-bytes N`: the device budget in bytes, on any device (the CPU path, and tests).
- `--host-memory-bytes N`: the L2 host pool in bytes (pinned memory on CUDA hosts).

What one unit costs (from the model config and the KV dtype, the model's dtype):
- a KV page: attention layers x 2 (K, V) x page_size x kv heads x head dim x dtype bytes
  (compute_service.model.allocate_kv_caches); the host tier stores the same page;
- a Mamba slot: Mamba layers x (SSM state heads x head dim x state in fp32 + conv state
  conv_dim x (kernel - 1) in the dtype) (allocate_mamba_states).

The device budget is spent in this order:
1. the running Mamba slots (`max_running` of them; Mamba and hybrid models only): fixed;
2. the Mamba checkpoint slots (hybrid and Mamba models with prefix caching): `--checkpoint-slots`
   when given explicitly; else a share `--mamba-memory-share` (default 0.5) of what is left for
   a hybrid model, and all of it for a pure Mamba model (its pages hold no KV);
3. KV pages: the rest, in whole pages. A pure Mamba model's pages cost no memory; it keeps
   `--device-pages` (the page count is then only the cache service's bookkeeping).

Refused with a message naming the flag: a budget next to an explicit count of the same pool
(--device-pages with --kv-memory-*, --host-pages with --host-memory-bytes), both budgets, a
fraction outside (0, 1], a fraction on CPU, and a budget that fits fewer pages than one request
of `max_context` tokens needs (a request that long could never run), or no checkpoint slot.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compute_service.model.config import ModelConfig
from service_shell import kv

log = logging.getLogger("compute_service.sizing")

DEFAULT_MAMBA_SHARE = 0.5


class SizingError(ValueError):
    """A budget or a combination of flags that cannot size the pools; the message names the
    flag."""


_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
          "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_bytes(text: str) -> int:
    """A byte count as flags take it: `1073741824`, `512Mi`, `16Gi`, `2G` (Kubernetes quantity
    suffixes, optionally followed by B). ValueError on anything else (argparse names the flag)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]i?)?b?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise ValueError(f"{text!r} is not a byte count (e.g. 1073741824, 512Mi, 16Gi)")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


parse_bytes.__name__ = "byte count"  # what argparse's "invalid ... value" message calls it


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def kv_bytes_per_page(mc: ModelConfig, page_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV page over all attention layers, K and V (0 for a pure Mamba model)."""
    return len(mc.attention_layer_ids) * 2 * page_size * mc.num_kv_heads * mc.head_dim \
        * _itemsize(dtype)


def mamba_bytes_per_slot(mc: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of one Mamba state slot over all Mamba layers (0 without Mamba layers); the SSM
    state is fp32 whatever the dtype (allocate_mamba_states)."""
    if not mc.mamba_layer_ids:
        return 0
    ssm = mc.mamba_num_heads * mc.mamba_head_dim * mc.mamba_state_size * 4
    conv = mc.mamba_conv_dim * (mc.mamba_conv_kernel - 1) * _itemsize(dtype)
    return len(mc.mamba_layer_ids) * (ssm + conv)


@dataclass(frozen=True, slots=True)
class SizingRequest:
    """What the flags asked for. None = not given (explicit counts) or no budget."""
    page_size: int
    max_context: int
    max_running: int
    prefix_cache: bool = True
    device_pages: int | None = None
    host_pages: int | None = None
    checkpoint_slots: int | None = None
    kv_memory_fraction: float | None = None
    kv_memory_bytes: int | None = None
    host_memory_bytes: int | None = None
    mamba_memory_share: float = DEFAULT_MAMBA_SHARE
    # Defaults of the explicit counts when neither they nor a budget are given.
    default_device_pages: int = 1024
    default_host_pages: int = 0
    default_checkpoint_slots: int = 64
    # Without --device-pages or a budget, the device pool is at most this many bytes (set from
    # the memory available: `default_kv_bytes`), and at most `default_device_pages`, but always
    # holds one --max-context request. None: `default_device_pages` as it is.
    default_kv_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class KvSizing:
    device_pages: int
    host_pages: int
    checkpoint_slots: int  # Mamba checkpoint slots (0 for attention-only models)
    running_slots: int  # Mamba running slots (max_running for Mamba models, else 0)
    kv_bytes_per_page: int
    mamba_bytes_per_slot: int
    device_budget_bytes: int  # the budget it was sized from; 0 when sized from counts
    host_budget_bytes: int
    source: str  # "pages", "bytes" or "fraction" (how the device side was sized)

    @property
    def device_bytes(self) -> int:
        """What the device pools take: KV pages and every Mamba slot."""
        return (self.device_pages * self.kv_bytes_per_page
                + (self.running_slots + self.checkpoint_slots) * self.mamba_bytes_per_slot)

    @property
    def host_bytes(self) -> int:
        return self.host_pages * self.kv_bytes_per_page

    def log_fields(self) -> dict[str, object]:
        return dict(source=self.source, device_pages=self.device_pages,
                    host_pages=self.host_pages, checkpoint_slots=self.checkpoint_slots,
                    running_slots=self.running_slots, kv_bytes_per_page=self.kv_bytes_per_page,
                    mamba_bytes_per_slot=self.mamba_bytes_per_slot,
                    device_budget_bytes=self.device_budget_bytes, device_bytes=self.device_bytes,
                    host_budget_bytes=self.host_budget_bytes, host_bytes=self.host_bytes)


def check_flags(req: SizingRequest, device: str) -> None:
    """The checks that need no model: conflicting flags and out-of-range values."""
    if req.kv_memory_fraction is not None and req.kv_memory_bytes is not None:
        raise SizingError("--kv-memory-fraction and --kv-memory-bytes: give one device budget")
    budget = req.kv_memory_fraction is not None or req.kv_memory_bytes is not None
    if budget and req.device_pages is not None:
        flag = "--kv-memory-fraction" if req.kv_memory_fraction is not None else \
            "--kv-memory-bytes"
        raise SizingError(f"--device-pages and {flag}: give the device pages or a budget, "
                          "not both (check PREFIXCACHE_DEVICE_PAGES)")
    if req.host_memory_bytes is not None and req.host_pages is not None:
        raise SizingError("--host-pages and --host-memory-bytes: give the host pages or a budget, "
                          "not both (check PREFIXCACHE_HOST_PAGES)")
    if req.kv_memory_fraction is not None:
        if not 0.0 < req.kv_memory_fraction <= 1.0:
            raise SizingError(f"--kv-memory-fraction: {req.kv_memory_fraction} is not in (0, 1]")
        if device != "cuda":
            raise SizingError("--kv-memory-fraction: a fraction of free device memory needs "
                              "--device cuda; on CPU give --kv-memory-bytes")
    if req.kv_memory_bytes is not None and req.kv_memory_bytes <= 0:
        raise SizingError(f"--kv-memory-bytes: {req.kv_memory_bytes} must be > 0")
    if req.host_memory_bytes is not None and req.host_memory_bytes < 0:
        raise SizingError(f"--host-memory-bytes: {req.host_memory_bytes} must be >= 0")
    if not 0.0 < req.mamba_memory_share < 1.0:
        raise SizingError(f"--mamba-memory-share: {req.mamba_memory_share} is not in (0, 1)")
    for name in ("device_pages", "host_pages", "checkpoint_slots"):
        value = getattr(req, name)
        if value is not None and value < 0:
            raise SizingError(f"--{name.replace('_', '-')}: {value} must be >= 0")


# The default device pool of a CPU worker given neither --device-pages nor a budget: at most this
# many bytes, or a quarter of the memory available at start if less (a 1,024-page pool of a
# 135M-parameter model is 720 MiB, more than its weights).
DEFAULT_CPU_KV_BYTES = 256 << 20


def default_kv_bytes(device: torch.device) -> int | None:
    """The default pool budget (see DEFAULT_CPU_KV_BYTES) on a CPU; None on other devices."""
    if device.type != "cpu":
        return None
    return min(DEFAULT_CPU_KV_BYTES, available_host_bytes() // 4)


def available_host_bytes() -> int:
    """MemAvailable (Linux), else the free pages the OS reports."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def free_device_bytes(device: torch.device) -> int:
    """Free memory of a CUDA device now (after the weights were loaded), as the driver sees it:
    memory torch's allocator caches but does not use counts as used, so empty the cache first."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, _total = torch.cuda.mem_get_info(device)
    return int(free)


def size_pools(req: SizingRequest, mc: ModelConfig, dtype: torch.dtype,
               free_bytes: int | None = None) -> KvSizing:
    """The pool sizes for a model; `free_bytes`: free device memory after the load (needed with
    a fraction). SizingError naming the flag when the budget does not fit."""
    page_bytes = kv_bytes_per_page(mc, req.page_size, dtype)
    slot_bytes = mamba_bytes_per_slot(mc, dtype)
    mamba, attention = bool(mc.mamba_layer_ids), bool(mc.attention_layer_ids)
    running_slots = req.max_running if mamba else 0
    ckpt_used = mamba and req.prefix_cache  # the engine keeps checkpoint slots only then
    needed_pages = math.ceil(req.max_context / req.page_size)
    host_pages, host_budget = _host(req, page_bytes, attention)
    if req.kv_memory_fraction is None and req.kv_memory_bytes is None:
        pages = req.device_pages if req.device_pages is not None else req.default_device_pages
        if req.device_pages is None and req.default_kv_bytes is not None and attention:
            pages = min(pages, max(needed_pages, req.default_kv_bytes // page_bytes))
        slots = req.checkpoint_slots if req.checkpoint_slots is not None else \
            req.default_checkpoint_slots
        return KvSizing(pages, host_pages, slots if ckpt_used else 0, running_slots, page_bytes,
                        slot_bytes, 0, host_budget, "pages")
    if req.kv_memory_fraction is not None:
        if free_bytes is None:
            raise SizingError("--kv-memory-fraction: free device memory is unknown")
        budget, flag, source = int(free_bytes * req.kv_memory_fraction), "--kv-memory-fraction", \
            "fraction"
    else:
        budget, flag, source = int(req.kv_memory_bytes), "--kv-memory-bytes", "bytes"
    what = (f"{flag} gives {budget} bytes" if source == "bytes" else
            f"{flag} {req.kv_memory_fraction} of {free_bytes} free bytes gives {budget} bytes")
    left = budget - running_slots * slot_bytes
    if left < 0:
        raise SizingError(f"{what}: not even the {running_slots} running Mamba slots "
                          f"(--max-running, {slot_bytes} bytes each) fit")
    slots = 0
    if ckpt_used:
        if req.checkpoint_slots is not None:
            slots = req.checkpoint_slots
        elif attention:
            slots = int(left * req.mamba_memory_share) // slot_bytes
        else:
            slots = left // slot_bytes
        left -= slots * slot_bytes
        if slots < 1 or left < 0:
            raise SizingError(f"{what}: after {running_slots} running Mamba slots it holds "
                              f"{slots} checkpoint slots of {slot_bytes} bytes; raise the budget "
                              "(or --checkpoint-slots / --mamba-memory-share)")
    if attention:
        pages = left // page_bytes
    else:  # a pure Mamba model's pages hold no KV: only the cache service counts them
        pages = req.device_pages if req.device_pages is not None else req.default_device_pages
    if pages < needed_pages:
        raise SizingError(f"{what}: {pages} KV pages of {page_bytes} bytes, fewer than the "
                          f"{needed_pages} pages one request of --max-context {req.max_context} "
                          f"tokens needs; raise the budget or lower --max-context")
    return KvSizing(pages, host_pages, slots, running_slots, page_bytes, slot_bytes, budget,
                    host_budget, source)


def _host(req: SizingRequest, page_bytes: int, attention: bool) -> tuple[int, int]:
    """(host pages, host budget bytes)."""
    if req.host_memory_bytes is None:
        return (req.host_pages if req.host_pages is not None else req.default_host_pages), 0
    if req.host_memory_bytes and not attention:
        raise SizingError("--host-memory-bytes: this model has no attention layers, its pages "
                          "hold no KV for a host tier; drop it")
    return req.host_memory_bytes // page_bytes if page_bytes else 0, req.host_memory_bytes


# ---- the command line (python -m compute_service) ------------------------------------------------

def add_sizing_flags(flag: Callable[..., None], engine: object) -> None:
    """The pool flags; `flag` is service_shell.add_flag bound to the parser, `engine` an
    EngineConfig with the default counts. The counts default to None ("not given") so that a
    budget next to one is a conflict, not silently ignored."""
    flag("--device-pages", "DEVICE_PAGES", None, f"KV pages on the device; default "
         f"{engine.device_pages} unless --kv-memory-fraction/--kv-memory-bytes (on a CPU at "
         f"most {DEFAULT_CPU_KV_BYTES >> 20} MiB of them, or a quarter of the memory available, "
         "but at least one --max-context request)", type=int)
    flag("--host-pages", "HOST_PAGES", None, f"KV pages in host memory (L2); default "
         f"{engine.host_pages} unless --host-memory-bytes", type=int)
    flag("--checkpoint-slots", "CHECKPOINT_SLOTS", None, "Mamba checkpoint slots (hybrid and "
         f"Mamba models); default {engine.checkpoint_slots}, or sized from the device budget",
         type=int)
    flag("--kv-memory-fraction", "KV_MEMORY_FRACTION", None, "CUDA: size the device pages (and "
         "Mamba slots) from this fraction of the device memory free after the model loaded, "
         "in (0, 1]", type=float)
    flag("--kv-memory-bytes", "KV_MEMORY_BYTES", None, "size the device pages (and Mamba "
         "slots) from this many bytes (e.g. 2Gi); the CPU path", type=parse_bytes)
    flag("--host-memory-bytes", "HOST_MEMORY_BYTES", None,
         "size the host (L2) pages from this many bytes (e.g. 32Gi)", type=parse_bytes)
    flag("--mamba-memory-share", "MAMBA_MEMORY_SHARE", DEFAULT_MAMBA_SHARE, "hybrid models "
         "sized from a budget: the share of it (after the running slots) for Mamba checkpoint "
         "slots, the rest for KV pages", type=float)


def sizing_request(args: argparse.Namespace, max_context: int) -> SizingRequest:
    return SizingRequest(
        page_size=args.page_size, max_context=max_context, max_running=args.max_running,
        prefix_cache=args.prefix_cache is not False, device_pages=args.device_pages,
        host_pages=args.host_pages, checkpoint_slots=args.checkpoint_slots,
        kv_memory_fraction=args.kv_memory_fraction, kv_memory_bytes=args.kv_memory_bytes,
        host_memory_bytes=args.host_memory_bytes, mamba_memory_share=args.mamba_memory_share)


def size_from_args(args: argparse.Namespace, model: torch.nn.Module) -> KvSizing:
    """The pool sizes from the flags, once the weights are loaded (a fraction is of the memory
    free then); logged as `kv_sizing`. SizingError names the flag."""
    max_context = args.max_context or model.config.max_position_embeddings
    free = free_device_bytes(model.device) if args.kv_memory_fraction is not None else None
    req = dataclasses.replace(sizing_request(args, max_context),
                              default_kv_bytes=default_kv_bytes(model.device))
    sizing = size_pools(req, model.config, model.dtype, free)
    log.info(kv("kv_sizing", device=model.device, dtype=str(model.dtype).removeprefix("torch."),
                free_device_bytes=free, max_context=max_context, **sizing.log_fields()))
    return sizing
