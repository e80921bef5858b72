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
import random

import torch
import torch.nn.functional as F

from prefixcache_bench.gpu_check.device import (fractions, free_memory, measured_ceilings, rel_err,
                                                sync, time_ms)
from prefixcache_bench.gpu_check.runner import Context, check, skipped

HQ, HKV, HEAD_DIM = 32, 8, 128  # Llama-3-8B
PAGE = 16
L2_ROTATE_BYTES = 256 << 20  # rotate input sets until this much is touched (L2 is 50-60 MB)
MAX_KV_BYTES = 6 << 30
TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-4}


def _tol(dtype: torch.dtype, dry_run: bool) -> float:
    return TOL[dtype] if not dry_run else max(TOL[dtype], 1e-4)


class Shapes:
    def __init__(self, dry_run: bool):
        if dry_run:
            self.dtype = torch.float32  # the interpreter's bf16 dot is emulated and slow
            self.heads = (4, 2, 32)
            self.decode = [(1, 64), (4, 96)]
            self.extend = [(1, 64)]
            self.sweep = (1, 64)
            self.sweep_configs = [(32, 32, 4, 1)]  # + the default: two interpreted runs
            self.mamba = dict(H=4, P=16, N=16, G=1, chunk=16, seqs=[(1, 40)], ref_tokens=40)
            self.state_batches = [2]
            self.lora = dict(d_in=64, d_out=64, rank=16, slots=2, tokens=[8])
            self.warmup, self.reps = 1, 2
        else:
            self.dtype = torch.bfloat16
            self.heads = (HQ, HKV, HEAD_DIM)
            self.decode = [(b, n) for n in (1024, 4096, 16384) for b in (1, 16, 64, 128)]
            self.extend = [(1, 2048), (4, 4096), (1, 16384)]
            self.sweep = (4, 4096)
            self.sweep_configs = [(128, 64, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3),
                                  (128, 64, 8, 2), (64, 64, 4, 3), (32, 32, 4, 3)]
            self.mamba = dict(H=128, P=64, N=128, G=1, chunk=256,
                              seqs=[(4, 2048), (1, 16384)], ref_tokens=512)
            self.state_batches = [1, 32, 128]
            self.lora = dict(d_in=4096, d_out=4096, rank=16, slots=4, tokens=[16, 256, 4096])
            self.warmup, self.reps = 3, 20


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
