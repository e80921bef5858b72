"""The kernels stage's Mamba2 (chunk scan, state update) and LoRA parts; see stage_kernels."""
from __future__ import annotations

import math
import random

import torch

from prefixcache_bench.gpu_check.device import fractions, free_memory, rel_err, time_ms
from prefixcache_bench.gpu_check.runner import Context, check, skipped
from prefixcache_bench.gpu_check.kernel_shapes import Shapes, _tol


def _ssm_inputs(T: int, H: int, P: int, N: int, G: int, dtype, device, gen) -> dict:
    def rand(*shape, dt=dtype):
        return torch.randn(*shape, dtype=torch.float32, device=device, generator=gen).to(dt)

    return dict(x=rand(T, H, P), dt=rand(T, H), dt_bias=rand(H, dt=torch.float32),
                A=-torch.exp(torch.rand(H, device=device, generator=gen)),
                B=rand(T, G, N), C=rand(T, G, N), D=rand(H, dt=torch.float32))


def bench_mamba_scan(ctx: Context, sh: Shapes, peaks: dict, gen) -> list[dict]:
    from compute_service.kernels import mamba_ref, mamba_triton

    m = sh.mamba
    H, P, N, G, chunk = m["H"], m["P"], m["N"], m["G"], m["chunk"]
    isz = torch.empty((), dtype=sh.dtype).element_size()
    out: list[dict] = []
    # Correctness on a short sequence first (the reference is a per-token loop).
    n = m["ref_tokens"]
    inp = _ssm_inputs(n, H, P, N, G, sh.dtype, ctx.device, gen)
    args = (inp["x"], inp["dt"], inp["dt_bias"], inp["A"], inp["B"], inp["C"], inp["D"])
    cu = torch.tensor([0, n], dtype=torch.int32, device=ctx.device)
    start = torch.zeros(1, dtype=torch.int32, device=ctx.device)
    y, final = mamba_triton.mamba_chunk_scan(*args, cu, None, start, chunk)[:2]
    y_ref, final_ref = mamba_ref.mamba_chunk_scan(*args, cu, None, start, chunk)[:2]
    e_y, e_s = rel_err(y, y_ref), rel_err(final, final_ref)
    out.append({"tokens": n, "check": check(f"mamba scan {n} tokens vs mamba_ref",
                                            max(e_y, e_s) <= _tol(sh.dtype, ctx.dry_run),
                                            rel_err_y=e_y, rel_err_state=e_s)})
    for seqs, length in m["seqs"]:
        row: dict = {"seqs": seqs, "tokens_per_seq": length, "heads": H, "head_dim": P,
                     "state": N, "chunk": chunk}
        try:
            if ctx.left() < 8:
                out.append(row | skipped(f"stage budget: {ctx.left():.0f} s left"))
                continue
            T = seqs * length
            inp = _ssm_inputs(T, H, P, N, G, sh.dtype, ctx.device, gen)
            args = (inp["x"], inp["dt"], inp["dt_bias"], inp["A"], inp["B"], inp["C"], inp["D"])
            cu = torch.arange(seqs + 1, dtype=torch.int32, device=ctx.device) * length
            start = torch.zeros(seqs, dtype=torch.int32, device=ctx.device)
            t = time_ms(lambda i: mamba_triton.mamba_chunk_scan(*args, cu, None, start, chunk),
                        ctx.device, sh.warmup, max(3, sh.reps // 2))
            chunks = seqs * math.ceil(length / chunk)
            moved = (2 * T * H * P * isz + 2 * T * G * N * isz + T * H * isz
                     + (chunks + seqs) * H * P * N * 4)
            gb_s = moved / (t["median_ms"] * 1e-3) / 1e9
            row |= {"triton": t, "tokens_per_s": round(T / (t["median_ms"] * 1e-3)),
                    "min_bytes": moved, "gb_s": round(gb_s, 1),
                    "hbm": fractions(gb_s, peaks.get("hbm_gb_s"), peaks.get("measured_copy_gb_s")),
                    "note": "bytes: x, y, B, C, dt once and every chunk-end state (fp32) written"}
            out.append(row)
        except Exception as e:  # noqa: BLE001 - this row's error, the next row runs
            out.append(row | {"error": f"{type(e).__name__}: {e}"[:400]})
            free_memory(ctx.device)
    return out


def bench_state_update(ctx: Context, sh: Shapes, peaks: dict, gen) -> list[dict]:
    from compute_service.kernels import mamba_ref, mamba_triton

    m = sh.mamba
    H, P, N, G = m["H"], m["P"], m["N"], m["G"]
    out: list[dict] = []
    for batch in sh.state_batches:
        row: dict = {"batch": batch}
        if ctx.left() < 5:
            out.append(row | skipped(f"stage budget: {ctx.left():.0f} s left"))
            continue
        slots = 2 * batch
        state = torch.randn(slots, H, P, N, device=ctx.device, generator=gen)
        inp = _ssm_inputs(batch, H, P, N, G, sh.dtype, ctx.device, gen)
        idx = torch.tensor(random.Random(batch).sample(range(slots), batch), dtype=torch.int32,
                           device=ctx.device)
        args = (inp["x"], inp["dt"], inp["dt_bias"], inp["A"], inp["B"], inp["C"], inp["D"], idx)
        s_tri, s_ref = state.clone(), state.clone()
        y = mamba_triton.selective_state_update(s_tri, *args)
        y_ref = mamba_ref.selective_state_update(s_ref, *args)
        e_y, e_s = rel_err(y, y_ref), rel_err(s_tri, s_ref)
        row["check"] = check(f"state update b{batch} vs mamba_ref",
                             max(e_y, e_s) <= _tol(sh.dtype, ctx.dry_run),
                             rel_err_y=e_y, rel_err_state=e_s)
        t = time_ms(lambda i: mamba_triton.selective_state_update(s_tri, *args), ctx.device,
                    sh.warmup, sh.reps)
        moved = 2 * batch * H * P * N * 4
        gb_s = moved / (t["median_ms"] * 1e-3) / 1e9
        row |= {"triton": t, "state_bytes_read_written": moved, "gb_s": round(gb_s, 1),
                "hbm": fractions(gb_s, peaks.get("hbm_gb_s"), peaks.get("measured_copy_gb_s"))}
        out.append(row)
    return out


def bench_lora(ctx: Context, sh: Shapes, peaks: dict, gen) -> list[dict]:
    from compute_service.kernels import lora_ref, lora_triton

    c = sh.lora
    d_in, d_out, r, S = c["d_in"], c["d_out"], c["rank"], c["slots"]
    isz = torch.empty((), dtype=sh.dtype).element_size()
    A = (torch.randn(S, r, d_in, device=ctx.device, generator=gen) / math.sqrt(d_in)).to(sh.dtype)
    B = (torch.randn(S, d_out, r, device=ctx.device, generator=gen) / math.sqrt(r)).to(sh.dtype)
    scaling = torch.full((S,), 2.0, device=ctx.device)
    out: list[dict] = []
    for T in c["tokens"]:
        row: dict = {"tokens": T, "d_in": d_in, "d_out": d_out, "rank": r, "adapters": S}
        if ctx.left() < 5:
            out.append(row | skipped(f"stage budget: {ctx.left():.0f} s left"))
            continue
        x = torch.randn(T, d_in, device=ctx.device, generator=gen).to(sh.dtype)
        y0 = torch.randn(T, d_out, device=ctx.device, generator=gen).to(sh.dtype)
        slot = torch.randint(-1, S, (T,), device=ctx.device, generator=gen).to(torch.int32)
        seg = lora_ref.lora_segments(slot, S)
        y_tri, y_ref = y0.clone(), y0.clone()
        lora_triton.lora_apply(y_tri, x, A, B, scaling, slot, seg)
        lora_ref.lora_apply(y_ref, x, A, B, scaling, slot, seg)
        err = rel_err(y_tri - y0, y_ref - y0)  # the update itself, not y's bulk
        row["check"] = check(f"lora T{T} vs lora_ref", err <= 2 * _tol(sh.dtype, ctx.dry_run),
                             rel_err_delta=err)
        y = y0.clone()
        t = time_ms(lambda i: lora_triton.lora_apply(y, x, A, B, scaling, slot, seg),
                    ctx.device, sh.warmup, sh.reps)
        tr = time_ms(lambda i: lora_ref.lora_apply(y, x, A, B, scaling, slot, seg), ctx.device,
                     1, max(2, sh.reps // 4))
        moved = (T * d_in + S * r * (d_in + d_out) + 2 * T * d_out) * isz
        flops = 2 * T * r * (d_in + d_out)
        gb_s = moved / (t["median_ms"] * 1e-3) / 1e9
        row |= {"triton": t, "torch_ref": tr, "gb_s": round(gb_s, 1),
                "tflop_s": round(flops / (t["median_ms"] * 1e-3) / 1e12, 3),
                "hbm": fractions(gb_s, peaks.get("hbm_gb_s"), peaks.get("measured_copy_gb_s")),
                "speedup_vs_torch_ref": round(tr["median_ms"] / t["median_ms"], 2)}
        out.append(row)
    return out
