"""Stage `kernels`: the Triton kernels timed against the machine's limits, each output checked
against its PyTorch reference (attention_ref, mamba_ref, lora_ref) on the same inputs.

- decode: paged decode attention, Llama-3-8B's layer (32 q heads, 8 kv heads, dim 128), several
  batch sizes x context lengths; bytes = K and V read once + q + out; GB/s over HBM peak.
  PyTorch's scaled_dot_product_attention beside it on the same K/V laid out densely
  [B, Hkv, L, D] (it cannot read pages: a lower bound on what the gather costs).
- extend: prefill (prefix 0, causal) of B x L new tokens; FLOPs = 2 matmuls x 2 x L^2 x D x Hq
  / 2 (causal); TFLOP/s over bf16 dense peak; SDPA (is_causal) beside it.
- extend_sweep: a few (BLOCK_M, BLOCK_N, num_warps, num_stages) launch configs of the extend
  kernel on the 4k shape (the table's default first), each checked against attention_ref and
  timed; `best` names the fastest correct one (candidates <= 6: each is a Triton compile).
- mamba_scan: Mamba2 SSD chunk scan (Bamba-9B's mixer: 128 heads x 64, state 128, 1 group,
  chunk 256); bytes of inputs, outputs and chunk states over HBM peak.
- mamba_state_update: one decode step, fp32 states read and written; GB/s.
- lora: multi-adapter shrink+expand on a 4096 x 4096 projection, rank 16, 4 adapters.

Inputs are random (never zeros), K/V pages scattered at random and rotated among several sets
when one set would fit in L2. Each config is skipped with its reason when the stage's time is
short or its memory too large.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from prefixcache_bench.gpu_check.device import (fractions, free_memory, measured_ceilings, rel_err,
                                                sync, time_ms)
from prefixcache_bench.gpu_check.kernel_parts_ssm import (bench_lora, bench_mamba_scan,
                                                          bench_state_update)
from prefixcache_bench.gpu_check.kernel_shapes import L2_ROTATE_BYTES, MAX_KV_BYTES, PAGE, Shapes, _tol
from prefixcache_bench.gpu_check.runner import Context, check, skipped

def _paged_sets(batch: int, seq_len: int, hkv: int, d: int, dtype, device, gen, sets: int):
    """One K/V pool and `sets` block tables over disjoint random pages of it."""
    pages_per_seq = math.ceil(seq_len / PAGE)
    total = pages_per_seq * batch * sets
    k_cache = torch.randn(total, PAGE, hkv, d, dtype=dtype, device=device, generator=gen)
    v_cache = torch.randn(total, PAGE, hkv, d, dtype=dtype, device=device, generator=gen)
    perm = torch.randperm(total, device="cpu").to(torch.int32)
    tables = [perm[s * batch * pages_per_seq:(s + 1) * batch * pages_per_seq]
              .view(batch, pages_per_seq).to(device) for s in range(sets)]
    return k_cache, v_cache, tables


def _dense(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[B, Hkv, L, D] from a paged cache (for SDPA)."""
    b = table.shape[0]
    rows = cache[table.long()]  # [B, pages, PAGE, Hkv, D]
    return rows.reshape(b, -1, cache.shape[2], cache.shape[3])[:, :seq_len].transpose(1, 2) \
        .contiguous()


def _sdpa(q, k, v, causal: bool):
    """SDPA with GQA (enable_gqa needs torch >= 2.5; else the kv heads are repeated)."""
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), is_causal=causal)


def bench_decode(ctx: Context, sh: Shapes, peaks: dict, gen) -> list[dict]:
    from compute_service.kernels import attention_ref, attention_triton

    hq, hkv, d = sh.heads
    isz = torch.empty((), dtype=sh.dtype).element_size()
    out: list[dict] = []
    for batch, seq_len in sh.decode:
        row: dict = {"batch": batch, "seq_len": seq_len}
        try:
            kv_bytes = 2 * batch * seq_len * hkv * d * isz
            if ctx.left() < 8:
                out.append(row | skipped(f"stage budget: {ctx.left():.0f} s left"))
                continue
            if kv_bytes > MAX_KV_BYTES:
                out.append(row | skipped(f"K/V of {kv_bytes / 2**30:.1f} GiB > the "
                                         f"{MAX_KV_BYTES / 2**30:.0f} GiB cap"))
                continue
            sets = max(1, min(64, math.ceil(L2_ROTATE_BYTES / kv_bytes))) if not ctx.dry_run else 1
            k_cache, v_cache, tables = _paged_sets(batch, seq_len, hkv, d, sh.dtype, ctx.device,
                                                   gen, sets)
            q = torch.randn(batch, hq, d, dtype=sh.dtype, device=ctx.device, generator=gen)
            seq_lens = torch.full((batch,), seq_len, dtype=torch.int32, device=ctx.device)
            scale = d ** -0.5
            got = attention_triton.paged_decode_attention(q, k_cache, v_cache, tables[0], seq_lens,
                                                          scale)
            n_ref = min(batch, 4)
            ref = attention_ref.paged_decode_attention(q[:n_ref], k_cache, v_cache,
                                                       tables[0][:n_ref], seq_lens[:n_ref], scale)
            err = rel_err(got[:n_ref], ref)
            row["check"] = check(f"decode b{batch} L{seq_len} vs attention_ref", err <=
                                 _tol(sh.dtype, ctx.dry_run), rel_err=err)
            t = time_ms(lambda i: attention_triton.paged_decode_attention(
                q, k_cache, v_cache, tables[i % sets], seq_lens, scale), ctx.device, sh.warmup,
                sh.reps)
            moved = kv_bytes + 2 * q.numel() * isz
            gb_s = moved / (t["median_ms"] * 1e-3) / 1e9
            row |= {"kv_bytes": kv_bytes, "input_sets": sets, "triton": t, "gb_s": round(gb_s, 1),
                    "hbm": fractions(gb_s, peaks.get("hbm_gb_s"), peaks.get("measured_copy_gb_s"))}
            try:
                kd, vd = _dense(k_cache, tables[0], seq_len), _dense(v_cache, tables[0], seq_len)
                qd = q[:, :, None, :]  # [B, Hq, 1, D]
                s_out = _sdpa(qd, kd, vd, False)[:, :, 0]
                row["sdpa_rel_err_vs_triton"] = rel_err(got, s_out)
                ts = time_ms(lambda i: _sdpa(qd, kd, vd, False), ctx.device, sh.warmup, sh.reps)
                row["sdpa_dense"] = ts | {"gb_s": round(moved / (ts["median_ms"] * 1e-3) / 1e9, 1),
                                          "note": "dense K/V, one set (may sit in L2 when small)"}
                del kd, vd
            except Exception as e:  # noqa: BLE001 - the side-by-side is optional
                row["sdpa_dense"] = {"error": f"{type(e).__name__}: {e}"[:300]}
            out.append(row)
            del k_cache, v_cache, tables
        except Exception as e:  # noqa: BLE001 - this row's error, the next row runs
            out.append(row | {"error": f"{type(e).__name__}: {e}"[:400]})
            free_memory(ctx.device)
    return out


def bench_extend(ctx: Context, sh: Shapes, peaks: dict, gen) -> list[dict]:
    from compute_service.kernels import attention_ref, attention_triton

    hq, hkv, d = sh.heads
    out: list[dict] = []
    for batch, length in sh.extend:
        row: dict = {"batch": batch, "new_tokens": length, "prefix": 0}
        try:
            if ctx.left() < 10:
                out.append(row | skipped(f"stage budget: {ctx.left():.0f} s left"))
                continue
            k_cache, v_cache, (table,) = _paged_sets(batch, length, hkv, d, sh.dtype, ctx.device,
                                                     gen, 1)
            q = torch.randn(batch * length, hq, d, dtype=sh.dtype, device=ctx.device, generator=gen)
            cu = torch.arange(0, batch + 1, dtype=torch.int32, device=ctx.device) * length
            prefix = torch.zeros(batch, dtype=torch.int32, device=ctx.device)
            scale = d ** -0.5
            got = attention_triton.extend_attention(q, k_cache, v_cache, table, cu, prefix, scale)
            kd, vd = _dense(k_cache, table, length), _dense(v_cache, table, length)
            qd = q.view(batch, length, hq, d).transpose(1, 2)
            s_out = _sdpa(qd, kd, vd, True).transpose(1, 2).reshape(batch * length, hq, d)
            err_sdpa = rel_err(got, s_out)
            row["check_sdpa"] = check(f"extend b{batch} L{length} vs SDPA", err_sdpa <=
                                      _tol(sh.dtype, ctx.dry_run), rel_err=err_sdpa)
            if length <= 4096:  # the reference's fp32 [Hq, L, L] scores: 2 GiB at 4096
                ref = attention_ref.extend_attention(q[:length], k_cache, v_cache, table[:1],
                                                     cu[:2], prefix[:1], scale)
                err = rel_err(got[:length], ref)
                row["check"] = check(f"extend b{batch} L{length} vs attention_ref",
                                     err <= _tol(sh.dtype, ctx.dry_run), rel_err=err)
                del ref
            flops = 4 * batch * hq * d * length * length / 2  # QK^T and PV, causal half
            t = time_ms(lambda i: attention_triton.extend_attention(
                q, k_cache, v_cache, table, cu, prefix, scale), ctx.device, sh.warmup, sh.reps)
            tf = flops / (t["median_ms"] * 1e-3) / 1e12
            ts = time_ms(lambda i: _sdpa(qd, kd, vd, True), ctx.device, sh.warmup, sh.reps)
            tfs = flops / (ts["median_ms"] * 1e-3) / 1e12
            row |= {"flops": flops, "triton": t, "tflop_s": round(tf, 2),
                    "bf16": fractions(tf, peaks.get("bf16_dense_tflop_s"),
                                      peaks.get("measured_matmul_tflop_s")),
                    "sdpa_dense_causal": ts | {"tflop_s": round(tfs, 2)},
                    "triton_over_sdpa_time": round(t["median_ms"] / ts["median_ms"], 3)}
            out.append(row)
            del k_cache, v_cache, kd, vd
        except Exception as e:  # noqa: BLE001 - this row's error, the next row runs
            out.append(row | {"error": f"{type(e).__name__}: {e}"[:400]})
            free_memory(ctx.device)
    return out


def bench_extend_sweep(ctx: Context, sh: Shapes, peaks: dict, gen) -> list[dict]:
    """Launch configs of the extend kernel on one shape: the default (the table's choice for
    this device) first, then the candidates; each checked against attention_ref (first
    sequence) and timed. The last row is the summary: `best` and its speed-up over the
    default."""
    from compute_service.kernels import attention_ref, attention_triton

    hq, hkv, d = sh.heads
    batch, length = sh.sweep
    k_cache, v_cache, (table,) = _paged_sets(batch, length, hkv, d, sh.dtype, ctx.device, gen, 1)
    q = torch.randn(batch * length, hq, d, dtype=sh.dtype, device=ctx.device, generator=gen)
    cu = torch.arange(0, batch + 1, dtype=torch.int32, device=ctx.device) * length
    prefix = torch.zeros(batch, dtype=torch.int32, device=ctx.device)
    scale = d ** -0.5
    ref = attention_ref.extend_attention(q[:length], k_cache, v_cache, table[:1], cu[:2],
                                         prefix[:1], scale)
    default = tuple(attention_triton.extend_config(q, d, length))
    configs = [default] + [c for c in sh.sweep_configs if tuple(c) != default]
    flops = 4 * batch * hq * d * length * length / 2
    out: list[dict] = []
    for cfg in configs[:6]:
        row: dict = {"batch": batch, "new_tokens": length, "config": list(cfg),
                     "config_keys": "BLOCK_M, BLOCK_N, num_warps, num_stages",
                     "default": cfg == default}
        if ctx.left() < 6:
            out.append(row | skipped(f"stage budget: {ctx.left():.0f} s left"))
            continue
        try:
            got = attention_triton.extend_attention(q, k_cache, v_cache, table, cu, prefix, scale,
                                                    config=cfg)
            err = rel_err(got[:length], ref)
            row["check"] = check(f"extend sweep {cfg} vs attention_ref",
                                 err <= _tol(sh.dtype, ctx.dry_run), rel_err=err)
            t = time_ms(lambda i, cfg=cfg: attention_triton.extend_attention(
                q, k_cache, v_cache, table, cu, prefix, scale, config=cfg),
                ctx.device, sh.warmup, sh.reps)
            tf = flops / (t["median_ms"] * 1e-3) / 1e12
            row |= {"triton": t, "tflop_s": round(tf, 2),
                    "bf16": fractions(tf, peaks.get("bf16_dense_tflop_s"),
                                      peaks.get("measured_matmul_tflop_s"))}
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: the next config runs
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        out.append(row)
    del k_cache, v_cache, ref
    good = [r for r in out if "tflop_s" in r and r["check"]["ok"]]
    summary: dict = {"summary": True, "default": list(default)}
    if good:
        best = min(good, key=lambda r: r["triton"]["median_ms"])
        base = next((r for r in good if r["default"]), None)
        summary |= {"best": best["config"], "best_tflop_s": best["tflop_s"],
                    "best_is_default": best["default"]}
        if base:
            summary["best_speedup_over_default"] = round(
                base["triton"]["median_ms"] / best["triton"]["median_ms"], 3)
    out.append(summary)
    return out


PARTS = (("decode", bench_decode), ("extend", bench_extend),
         ("extend_sweep", bench_extend_sweep), ("mamba_scan", bench_mamba_scan),
         ("mamba_state_update", bench_state_update), ("lora", bench_lora))


def run(ctx: Context) -> dict:
    sh = Shapes(ctx.dry_run)
    if ctx.device.type == "cuda" and sh.dtype == torch.bfloat16 \
            and not torch.cuda.is_bf16_supported():
        sh.dtype = torch.float16
    peaks = dict(ctx.device_info.get("peaks", {}))
    result: dict = {"dtype": str(sh.dtype).removeprefix("torch."), "heads": list(sh.heads),
                    "page_size": PAGE, "peaks": peaks}
    try:
        ceil = measured_ceilings(ctx.device, ctx.dry_run)
        result["measured_ceilings"] = ceil
        peaks["measured_copy_gb_s"] = ceil["copy_gb_s"]
        peaks["measured_matmul_tflop_s"] = ceil["matmul_bf16_tflop_s"]
    except Exception as e:  # noqa: BLE001
        result["measured_ceilings"] = {"error": f"{type(e).__name__}: {e}"}
    gen = torch.Generator(device=ctx.device).manual_seed(20261126)
    for name, fn in PARTS:
        if ctx.left() < 5:
            result[name] = skipped(f"stage budget: {ctx.left():.0f} s left")
            continue
        try:
            result[name] = fn(ctx, sh, peaks, gen)
            if any("error" in row for row in result[name]):
                result.setdefault("part_errors", []).append(name)
        except Exception as e:  # noqa: BLE001 - one part's failure is recorded, the next runs
            import traceback
            result[name] = {"error": f"{type(e).__name__}: {e}"[:500],
                            "traceback": traceback.format_exc(limit=8)[-2500:]}
            result.setdefault("part_errors", []).append(name)
        sync(ctx.device)
    head: dict = {}
    for name, key in (("decode", "gb_s"), ("extend", "tflop_s")):
        rows = [r for r in result.get(name, []) if isinstance(r, dict) and key in r] \
            if isinstance(result.get(name), list) else []
        if rows:
            best = max(rows, key=lambda r: r[key])
            frac = (best.get("hbm") or best.get("bf16") or {}).get("of_peak")
            head[f"{name}_best_{key}"] = f"{best[key]}" + (f" ({frac:.0%} of peak)" if frac
                                                           else "")
    sweep = result.get("extend_sweep")
    if isinstance(sweep, list) and sweep and sweep[-1].get("best"):
        head["extend_sweep_best"] = (f"{sweep[-1]['best']} {sweep[-1]['best_tflop_s']} TFLOP/s, "
                                     f"{sweep[-1]['best_speedup_over_default']}x the default"
                                     if "best_speedup_over_default" in sweep[-1]
                                     else f"{sweep[-1]['best']}")
    result["headline"] = head
    return result
