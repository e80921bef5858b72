"""Stage `sizing`: `--kv-memory-fraction` on the real device (compute_service/sizing.py).

The flags go through the worker's own parser (`python -m compute_service`'s parse_args) and
`size_from_args`, with the Llama-3-8B-shaped model of the engine stage loaded (16 GB of bf16
weights), exactly as a worker starting with `--kv-memory-fraction 0.85` sizes its pools. The
engine is then built with those pools and serves a request, and the JSON records the memory
free before, the pages, the bytes they take, and what stays free: the fraction is of the memory
free after the load, so about 15% of it must stay free with the pools allocated and a request
served. The refusals are checked too: a fraction outside (0, 1].

Dry run (CPU): the fraction is refused on CPU (its message names the flag), and the same path is
exercised with `--kv-memory-bytes`.
"""
from __future__ import annotations

import random

import torch

from prefixcache_bench.gpu_check.device import free_memory, memory_report, sync
from prefixcache_bench.gpu_check.models import build
from prefixcache_bench.gpu_check.runner import Context, check
from prefixcache_bench.gpu_check.stage_engine import PAGE, make_engine, run_batch

FRACTION = 0.85
MAX_RUNNING = 64
MAX_CONTEXT = 8192


def _args(extra: list[str], device: str):
    from compute_service.__main__ import parse_args

    return parse_args(["--model", "tiny-transformer", "--device", device, "--page-size",
                       str(PAGE), "--max-running", str(MAX_RUNNING), "--max-context",
                       str(MAX_CONTEXT), *extra])


def run(ctx: Context) -> dict:
    from compute_service.sizing import SizingError, SizingRequest, check_flags, size_from_args

    dev = ctx.device.type
    model = ctx.shared.pop("model", None)
    result: dict = {}
    if model is None:
        dtype = torch.float32 if ctx.dry_run else torch.bfloat16
        model = build("dry-llama" if ctx.dry_run else "llama3-8b", dtype, ctx.device, seed=1)
        result["model_source"] = "built here (the engine stage left none)"
    else:
        result["model_source"] = "the engine stage's"
    sync(ctx.device)
    cfg = model.config
    result["model"] = {"parameters": cfg.num_parameters(),
                       "dtype": str(model.dtype).removeprefix("torch.")}
    # Refusals the flags must give on this device.
    refusals = []
    for value, device, want in (("1.5", "cuda", "(0, 1]"), ("0.5", "cpu", "--kv-memory-bytes")):
        req = SizingRequest(page_size=PAGE, max_context=MAX_CONTEXT, max_running=MAX_RUNNING,
                            kv_memory_fraction=float(value))
        try:
            check_flags(req, device)
            refusals.append(check(f"fraction {value} on {device} refused", False,
                                  got="accepted"))
        except SizingError as e:
            refusals.append(check(f"fraction {value} on {device} refused", want in str(e),
                                  message=str(e)))
    result["refusals"] = refusals
    flags = (["--kv-memory-fraction", str(FRACTION)] if dev == "cuda"
             else ["--kv-memory-bytes", str(64 << 20)])
    result["flags"] = flags
    free_memory(ctx.device)
    result["memory_before"] = memory_report(ctx.device)
    args = _args(flags, dev)
    sizing = size_from_args(args, model)
    result["sizing"] = sizing.log_fields()
    free_before = (torch.cuda.mem_get_info(ctx.device)[0] if dev == "cuda" else None)
    engine = make_engine(model, sizing.device_pages, 2048, MAX_RUNNING)
    try:
        sync(ctx.device)
        result["memory_with_pools"] = memory_report(ctx.device)
        rng = random.Random(5)
        done, wall = run_batch(engine, [[rng.randrange(256) for _ in range(1024)]
                                        for _ in range(4)], 8)
        result["served"] = {"requests": 4, "prompt_tokens": 1024, "new_tokens": 8,
                            "wall_s": round(wall, 3)}
        result["memory_after_request"] = memory_report(ctx.device)
    finally:
        engine.close()
    checks = [check("a request of --max-context fits",
                    sizing.device_pages * PAGE >= MAX_CONTEXT, pages=sizing.device_pages),
              check("pools within the budget",
                    sizing.device_bytes <= max(sizing.device_budget_bytes, 1),
                    device_bytes=sizing.device_bytes, budget=sizing.device_budget_bytes)]
    if dev == "cuda":
        free_after = torch.cuda.mem_get_info(ctx.device)[0]
        kept = free_after / free_before if free_before else None
        result["free_kept_fraction"] = round(kept, 4) if kept is not None else None
        # 1 - F of the free memory stays free; the request's activations take a little of it.
        checks.append(check("memory left free after the pools and a request",
                            kept is not None and kept > (1 - FRACTION) * 0.5, kept=kept))
        result["headline"] = {"kv_pages": sizing.device_pages,
                              "kv_gib": round(sizing.device_bytes / 2**30, 1),
                              "free_kept": result["free_kept_fraction"]}
    else:
        result["headline"] = {"kv_pages": sizing.device_pages, "source": sizing.source}
    result["checks"] = checks
    del model, engine
    free_memory(ctx.device)
    return result
