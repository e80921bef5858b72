"""The device under test: its name, its datasheet peaks, measured ceilings, and a timer."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

# Datasheet peaks by device-name substring, most specific first: HBM GB/s and dense (no
# sparsity) bf16 TFLOP/s. torch.cuda.get_device_name gives e.g. "NVIDIA H100 80GB HBM3" (SXM),
# "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200".
PEAKS: tuple[tuple[str, str, float, float], ...] = (
    ("H200", "H200 SXM 141GB", 4800.0, 989.0),
    ("H100 NVL", "H100 NVL 94GB", 3900.0, 835.0),
    ("H100 PCIe", "H100 PCIe 80GB", 2000.0, 756.0),
    ("H100", "H100 SXM 80GB", 3350.0, 989.0),
    ("A100", "A100", 2039.0, 312.0),
)


def peaks_for(name: str) -> dict:
    for key, part, hbm, bf16 in PEAKS:
        if key in name:
            return {"matched": key, "part": part, "hbm_gb_s": hbm, "bf16_dense_tflop_s": bf16,
                    "source": "vendor datasheet (dense, no sparsity)"}
    return {"matched": None, "part": None, "hbm_gb_s": None, "bf16_dense_tflop_s": None,
            "source": f"no entry for {name!r}: fractions of peak are left out"}


def device_info(device: torch.device) -> dict:
    info: dict = {"torch": torch.__version__, "device": str(device)}
    try:
        import triton
        info["triton"] = triton.__version__
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        info["triton"] = f"unavailable: {e}"
    try:
        import transformers
        info["transformers"] = transformers.__version__
    except Exception as e:  # noqa: BLE001
        info["transformers"] = f"unavailable: {e}"
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        free, total = torch.cuda.mem_get_info(device)
        info |= {"name": torch.cuda.get_device_name(device), "capability": list(
            torch.cuda.get_device_capability(device)), "sms": props.multi_processor_count,
            "total_memory_bytes": int(total), "free_memory_bytes": int(free),
            "cuda": torch.version.cuda, "bf16_supported": torch.cuda.is_bf16_supported()}
        info["peaks"] = peaks_for(info["name"])
    else:
        info |= {"name": "cpu (dry run)", "peaks": peaks_for("cpu")}
    return info


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_ms(fn: Callable[[int], object], device: torch.device, warmup: int, reps: int
            ) -> dict:
    """Median (and min/max) milliseconds of `fn(rep)` over `reps` calls after `warmup` calls;
    `fn` gets the call's index so that it can rotate among input sets (cold caches). On CUDA each
    call sits between its own pair of events; elsewhere, a synchronised host clock."""
    for i in range(warmup):
        fn(i)
    sync(device)
    samples: list[float] = []
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(reps)]
        for i, (start, end) in enumerate(events):
            start.record()
            fn(warmup + i)
            end.record()
        torch.cuda.synchronize(device)
        samples = [s.elapsed_time(e) for s, e in events]
    else:
        for i in range(reps):
            t0 = time.perf_counter()
            fn(warmup + i)
            samples.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": round(statistics.median(samples), 5), "min_ms": round(min(samples), 5),
            "max_ms": round(max(samples), 5), "reps": reps, "warmup": warmup}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64; inf when out has a non-finite value."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return float("inf")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def measured_ceilings(device: torch.device, dry_run: bool) -> dict:
    """A large device-to-device copy (bytes read + written) and a large bf16 matmul on random
    data: the ceilings this card reaches as found (METHOD.md), beside the datasheet."""
    n_bytes = (1 << 20) if dry_run else (2 << 30)
    n = 64 if dry_run else 8192
    reps = 2 if dry_run else 10
    src = torch.empty(n_bytes // 2, dtype=torch.float16, device=device).uniform_(-1, 1)
    dst = torch.empty_like(src)
    copy = time_ms(lambda i: dst.copy_(src), device, 1 if dry_run else 3, reps)
    del src, dst
    dtype = torch.bfloat16
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm = time_ms(lambda i: a @ b, device, 1 if dry_run else 3, reps)
    del a, b
    return {
        "copy_bytes": 2 * n_bytes, "copy": copy,
        "copy_gb_s": round(2 * n_bytes / (copy["median_ms"] * 1e-3) / 1e9, 1),
        "matmul_shape": [n, n, n], "matmul": mm,
        "matmul_bf16_tflop_s": round(2 * n**3 / (mm["median_ms"] * 1e-3) / 1e12, 1),
    }


def fractions(achieved: float, peak: float | None, measured: float | None) -> dict:
    return {"of_peak": round(achieved / peak, 4) if peak else None,
            "of_measured": round(achieved / measured, 4) if measured else None}


def free_memory(device: torch.device) -> None:
    import gc
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_report(device: torch.device) -> dict:
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    return {"allocated_gib": round(torch.cuda.memory_allocated(device) / 2**30, 2),
            "max_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2),
            "free_gib": round(free / 2**30, 2), "total_gib": round(total / 2**30, 2)}


def median(values: Sequence[float]) -> float:
    return statistics.median(values)
