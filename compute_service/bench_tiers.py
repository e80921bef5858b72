"""Benchmarks of the KV tiers (L1 device, L2 host, L3 Redis) against the goals they are held to.

    python -m compute_service.bench_tiers [--quick] [--json PATH] [--redis-url URL]
        [--models small-hybrid,small-transformer] [--prompt-tokens 4096] [--threads N]

Starts its own redis-server on a free port (no persistence, allkeys-lru) unless --redis-url is
given; keys are written under a private prefix and deleted at the end.

- redis:  page payloads of `--payload-preset` (small-hybrid, page 16) with and without a Mamba
          checkpoint: Redis write and read throughput in pages/s and MB/s, pipelined (one
          round trip per `batch_pages`) vs one page per round trip; payload encode and
          decode+validate throughput.
- ttft:   per model, time to first token of a `--prompt-tokens` prompt: cold (mean of two
          prompts), L1 hit (same worker again), L2 hit (its pages demoted to the host pool by
          another prompt, then loaded back), L3 hit (worker A computed it with write-through;
          worker B, another cache service, loads it from Redis), and A's cold TTFT with
          write-through on. Ratios to cold; goal ttft_l3_over_cold <= 0.3, judged on prompts
          of at least GOAL_PROMPT_TOKENS (--quick's shorter prompt reports the ratio only).
- break_even: cold and L3 TTFT over a few prompt lengths; fits recompute time per token and L3
          load time (get + validate + copy) per page, and reports the prompt length from which
          loading from L3 is cheaper than recomputing.
- shared_l3_sim: the gateway simulator (affinity policy) on the conversation trace with 8
          workers x 1M device tokens and a shared write-back L3 of 32M tokens: hit ratio (split
          device / host / L3) vs the pooled bound (goal >= 0.97). The bound is one pooled LRU of
          all the fleet's capacity (8 x 1M + 32M tokens): the pooled bound of the device tiers
          alone (8M, also reported) is beaten by the L3's capacity whatever the routing does.
          --quick replays the first 2,000 requests. "not measured" with the reason when the
          simulator or the trace is missing.

Prints tables, writes every number, the parameters and the machine to --json. Progress goes to
stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import random
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import redis
import torch

from cache_service.core import CacheCore
from cache_service.l3 import L3Client, L3Config
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.model import ByteTokenizer, CausalLM, build_preset, preset_config
from compute_service.tiers import PageLayout, decode, encode

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
SHARED_L3_TOKENS = 32_000_000
GOAL_PROMPT_TOKENS = 4096
LEASE_TTL_S = 600.0  # a cold 4k prefill step on a busy CPU can outlast the 30 s default


@dataclass(slots=True)
class Params:
    models: tuple[str, ...] = ("small-hybrid", "small-transformer")
    prompt_tokens: int = 4096
    lengths: tuple[int, ...] = (256, 1024, 2048)  # break-even points besides prompt_tokens
    page_size: int = 16
    payload_preset: str = "small-hybrid"
    throughput_pages: int = 512  # pages without checkpoint; with checkpoint: a sixteenth
    batch_pages: int = 32
    token_budget: int = 1024
    checkpoint_every_pages: int = 8
    seed: int = 0

    @classmethod
    def quick(cls) -> Params:
        return cls(prompt_tokens=512, lengths=(128, 256), throughput_pages=128)


def log(message: str) -> None:
    print(f"[bench_tiers] {message}", file=sys.stderr, flush=True)


# ---- Redis --------------------------------------------------------------------------------


@contextlib.contextmanager
def redis_at(url: str | None) -> Iterator[str]:
    """`url`, or a throwaway redis-server's."""
    if url:
        yield url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp, "--maxmemory", "2gb",
             "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(redis.ConnectionError):
                    if redis.Redis.from_url(url).ping():
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
            yield url
        finally:
            proc.kill()
            proc.wait()


def rate(pages: int, nbytes: int, seconds: float) -> dict:
    return {"pages_s": round(pages / seconds, 1), "mb_s": round(nbytes / seconds / 1e6, 1),
            "seconds": round(seconds, 4)}


def bench_redis(p: Params, client: L3Client) -> dict:
    lay = PageLayout.of_model(preset_config(p.payload_preset), p.page_size, torch.float32)
    out = {"payload_preset": p.payload_preset, "page_size": p.page_size, "dtype": "float32",
           "batch_pages": p.batch_pages, "kinds": {}}
    gen = torch.Generator().manual_seed(p.seed)
    for kind, n, ckpt in (("kv", p.throughput_pages, False),
                          ("kv+checkpoint", max(4, p.throughput_pages // 16), True)):
        kv = torch.randn(lay.kv_shape, generator=gen)
        mamba = ([(torch.randn(lay.ssm_shape, generator=gen),
                   torch.randn(lay.conv_shape, generator=gen))
                  for _ in range(lay.mamba_layers)] if ckpt and lay.mamba_layers else None)
        hashes = [os.urandom(16) for _ in range(n)]
        start = time.perf_counter()
        payloads = [encode(h, lay, kv, mamba) for h in hashes]
        encode_s = time.perf_counter() - start
        size = len(payloads[0])
        items = list(zip(hashes, payloads, strict=True))
        batches = [items[i:i + p.batch_pages] for i in range(0, n, p.batch_pages)]
        res = {"payload_bytes": size, "pages": n, "encode": rate(n, n * size, encode_s)}
        for label, groups in (("write_one_by_one", [[it] for it in items]),
                              ("write_pipelined", batches)):
            start = time.perf_counter()
            ok = all([client.set_many("bench", group) for group in groups])
            res[label] = rate(n, n * size, time.perf_counter() - start) | {"ok": ok}
        for label, groups in (("read_one_by_one", [[h] for h in hashes]),
                              ("read_pipelined", [[h for h, _ in b] for b in batches])):
            start = time.perf_counter()
            got = [v for group in groups for v in client.get_many("bench", group)]
            res[label] = rate(n, n * size, time.perf_counter() - start) | {
                "found": sum(v is not None for v in got)}
        start = time.perf_counter()
        for h, payload in zip(hashes, got, strict=True):
            decode(payload, h, lay)
        res["decode"] = rate(n, n * size, time.perf_counter() - start)
        out["kinds"][kind] = res
        log(f"redis {kind}: {size / 1e3:.0f} KB/page, write pipelined "
            f"{res['write_pipelined']['mb_s']} MB/s, read pipelined "
            f"{res['read_pipelined']['mb_s']} MB/s")
    return out


# ---- TTFT ---------------------------------------------------------------------------------


class Bench:
    """Workers of one model sharing one Redis; each worker has its own cache service."""

    def __init__(self, name: str, p: Params, model: CausalLM, url: str, prefix: str):
        self.name, self.p, self.model, self.url, self.prefix = name, p, model, url, prefix
        self.engines: list[Engine] = []

    def client(self) -> L3Client:
        # The production defaults (0.1 s per socket operation) with the bench's key prefix.
        return L3Client(L3Config(self.url, prefix=self.prefix))

    def worker(self, tokens: int, host_pages: int = 0, **l3) -> Engine:
        pages = -(-(tokens + 1) // self.p.page_size) + 2
        lookup = l3.get("l3_lookup", False)
        cfg = EngineConfig(pool_id=f"{self.name}-{len(self.engines)}", model_id=self.name,
                           page_size=self.p.page_size, device_pages=pages, host_pages=host_pages,
                           max_running=2, token_budget=self.p.token_budget,
                           max_context=pages * self.p.page_size, lease_ttl_s=LEASE_TTL_S,
                           checkpoint_every_pages=self.p.checkpoint_every_pages, **l3)
        core = CacheCore(remote=cfg.l3 if lookup else None)
        self.engines.append(Engine(self.model, ByteTokenizer(), core, cfg))
        return self.engines[-1]

    def ttft(self, eng: Engine, prompt: list[int]):
        """(TTFT in s, final RequestStats) of a one-token request."""
        outs: list = []
        eng.submit(prompt, SamplingParams(max_tokens=1, ignore_eos=True), outs.append)
        eng.run_until_idle()
        return outs[-1].stats.ttft_s, outs[-1].stats

    def l3_ttft(self, prompt: list[int]) -> tuple[float, object, float]:
        """(TTFT, stats, seconds spent loading L3 pages) on a fresh reader worker."""
        eng = self.worker(len(prompt), l3=self.client(), l3_lookup=True)
        spent = [0.0]
        load = eng.tiers.load_extensions

        def timed_load(matches):
            start = time.perf_counter()
            try:
                return load(matches)
            finally:
                spent[0] += time.perf_counter() - start
        eng.tiers.load_extensions = timed_load
        ttft, stats = self.ttft(eng, prompt)
        return ttft, stats, spent[0]

    def close(self) -> None:
        for eng in self.engines:
            eng.close()


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, 255) for _ in range(n)]


def bench_model(name: str, p: Params, url: str, prefix: str, device: str,
                dtype: torch.dtype) -> tuple[dict, dict]:
    rng = random.Random(p.seed)
    model = build_preset(name, seed=p.seed, dtype=dtype, device=device)
    b = Bench(name, p, model, url, prefix)
    try:
        b.ttft(b.worker(64), tokens(rng, 64))  # warm-up: lazy initialisation is not TTFT
        n = p.prompt_tokens
        x, y = tokens(rng, n), tokens(rng, n)
        c = b.worker(n, host_pages=-(-n // p.page_size) + 16)
        log(f"{name}: cold {n} tokens ...")
        cold_x, _ = b.ttft(c, x)
        l1, s1 = b.ttft(c, x)
        cold_y, _ = b.ttft(c, y)  # needs the whole device pool: x's pages go to the host
        l2, s2 = b.ttft(c, x)
        log(f"{name}: cold with write-through ...")
        writer = b.worker(n, l3=b.client(), l3_write_policy="write-through")
        cold_wt, _ = b.ttft(writer, x)
        if not writer.flush_l3(120):
            log(f"{name}: L3 writes did not finish in 120 s")
        l3, s3, load_s = b.l3_ttft(x)
        cold = (cold_x + cold_y) / 2
        ttft = {
            "prompt_tokens": n, "ttft_cold_s": cold, "ttft_cold_samples_s": [cold_x, cold_y],
            "ttft_l1_s": l1, "ttft_l2_s": l2, "ttft_l3_s": l3,
            "ttft_cold_write_through_s": cold_wt,
            "ttft_l1_over_cold": l1 / cold, "ttft_l2_over_cold": l2 / cold,
            "ttft_l3_over_cold": l3 / cold, "write_through_over_cold": cold_wt / cold,
            "l1_hit_tokens": s1.cached_tokens_device, "l2_hit_tokens": s2.cached_tokens_host,
            "l3_hit_tokens": s3.cached_tokens_remote,
            "l3_computed_tokens": s3.computed_prompt_tokens,
            "l3_load_s": load_s, "l3_written_pages": writer.tier_metrics()["l3_write_pages_ok"],
        }
        log(f"{name}: cold {cold:.3f}s L1 {l1:.3f}s L2 {l2:.3f}s L3 {l3:.3f}s")
        points = [{"prompt_tokens": n, "ttft_cold_s": cold_x, "ttft_l3_s": l3, "l3_load_s": load_s,
                   "l3_pages": s3.cached_tokens_remote // p.page_size}]
        for length in sorted(set(p.lengths) - {n}):
            cold_n, _ = b.ttft(b.worker(length), x[:length])
            l3_n, s, load_n = b.l3_ttft(x[:length])
            points.append({"prompt_tokens": length, "ttft_cold_s": cold_n, "ttft_l3_s": l3_n,
                           "l3_load_s": load_n, "l3_pages": s.cached_tokens_remote // p.page_size})
        be = break_even(sorted(points, key=lambda q: q["prompt_tokens"]), p.page_size)
        if model.config.mamba_layer_ids:  # a hybrid prefix resumes only at a checkpoint
            be["resume_granularity_tokens"] = p.checkpoint_every_pages * p.page_size
        return ttft, be
    finally:
        b.close()


def fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    return my - slope * mx, slope


def break_even(points: list[dict], page_size: int) -> dict:
    """Recompute cost per token vs L3 load cost per page. The recompute rate is the lowest
    cold TTFT per token over the points (attention makes short prompts cheapest per token, so
    this favours recomputing); the load cost is fitted as fixed + per_page x pages over the
    measured loads (get + validate + copy). A prefix of n pages is cheaper to load once
    fixed + per_page x n < rate x page_size x n: the break-even is the smallest such n."""
    per_token = min(q["ttft_cold_s"] / q["prompt_tokens"] for q in points)
    fixed, per_page = fit([q["l3_pages"] for q in points], [q["l3_load_s"] for q in points])
    fixed = max(fixed, 0.0)  # a negative intercept is fit noise: a load has no negative cost
    saving = per_token * page_size - per_page
    pages = max(1, math.floor(fixed / saving) + 1) if saving > 0 else None
    faster = [q["prompt_tokens"] for q in points if q["ttft_l3_s"] < q["ttft_cold_s"]]
    return {"points": points, "compute_s_per_token": per_token, "load_s_per_page": per_page,
            "load_fixed_s": fixed, "break_even_tokens": pages * page_size if pages else None,
            "shortest_measured_l3_faster_tokens": min(faster) if faster else None}


# ---- the simulator ---------------------------------------------------------------------------


def bench_shared_l3_sim(quick: bool) -> dict:
    """The gateway simulator with a shared L3, if it has one (see the module docstring)."""
    try:
        usage = subprocess.run([sys.executable, "-m", "gateway.simulate", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"measured": False, "reason": f"gateway.simulate did not run: {err}"}
    if "--l3-capacity-tokens" not in usage:
        return {"measured": False, "reason": "gateway/simulate.py has no shared L3 tier option "
                "(--l3-capacity-tokens); hit ratio with a shared L3 not measured"}
    if not TRACE.exists():
        return {"measured": False, "reason": f"{TRACE} not found"}
    workers, capacity = 8, 1_000_000
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        cmd = [sys.executable, "-m", "gateway.simulate", "--trace", str(TRACE), "--policy",
               "affinity", "--workers", str(workers), "--capacity-tokens", str(capacity),
               "--l3-capacity-tokens", str(SHARED_L3_TOKENS), "--json", str(out),
               "--quiet"] + (["--max-requests", "2000"] if quick else [])
        log(f"gateway simulator with a shared L3: {' '.join(cmd[2:])} ...")
        started = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if run.returncode or not out.exists():
            return {"measured": False, "reason": f"simulator failed: {run.stderr[-500:]}"}
        result = json.loads(out.read_text())
    aff, l3 = result["policies"]["affinity"], result.get("l3") or {}
    hit, bound, l3_bound = aff["hit_ratio"], result["bound_hit_ratio"], l3.get("bound_hit_ratio")
    return {"measured": True, "trace": str(TRACE), "requests": aff["requests"], "workers": workers,
            "capacity_tokens": capacity, "l3_capacity_tokens": SHARED_L3_TOKENS,
            "l3_write_policy": l3.get("write_policy"), "l3_events": l3.get("events"),
            "l3_load_s_per_token": l3.get("load_s_per_token"),
            "hit_ratio": hit, "device_hit_ratio": aff.get("device_hit_ratio"),
            "host_hit_ratio": aff.get("host_hit_ratio"), "l3_hit_ratio": aff.get("l3_hit_ratio"),
            "mean_ttft_s": aff["mean_ttft_s"], "p99_ttft_s": aff["p99_ttft_s"],
            # The goal's bound: one pooled LRU of 8 x 1M + 32M tokens (see the module docstring).
            "l3_bound_hit_ratio": l3_bound,
            "hit_over_bound": hit / l3_bound if l3_bound else None,
            # The pooled bound of the device tiers alone (8 x 1M tokens), for reference.
            "bound_hit_ratio": bound, "hit_over_pooled_device_bound": hit / bound if bound else None,
            "unbounded_hit_ratio": result.get("unbounded_hit_ratio"),
            "sim_wall_s": round(time.perf_counter() - started, 1)}


# ---- the run ----------------------------------------------------------------------------------


def choose_threads(requested: int | None, device: str) -> tuple[int, str]:
    """On a CPU whose cores are all busy already, torch's intra-op threads wait on each other at
    every op (measured here: 2 threads made the 4k cold prefill 1.5x slower than 1)."""
    if requested:
        return requested, "--threads"
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if device == "cpu" and os.getloadavg()[0] >= cpus:
        return 1, f"auto: load average >= {cpus} usable CPUs"
    return torch.get_num_threads(), "auto: torch's default"


def run(p: Params, redis_url: str | None, threads: int | None, simulate: bool, quick: bool) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n_threads, why = choose_threads(threads, device)
    torch.set_num_threads(n_threads)
    prefix = f"pcbench{os.getpid()}"
    results: dict = {"params": dataclasses.asdict(p), "machine": {
        "platform": platform.platform(), "torch": torch.__version__, "device": device,
        "dtype": str(dtype), "threads": n_threads, "threads_reason": why,
        "cuda": torch.cuda.get_device_name() if device == "cuda" else None,
        "load_avg_start": [round(v, 2) for v in os.getloadavg()]}}
    with redis_at(redis_url) as url:
        results["redis_url"] = url if redis_url else "own redis-server"
        try:
            client = L3Client(L3Config(url, prefix=prefix, timeout_s=10.0, connect_timeout_s=1.0))
            results["redis"] = bench_redis(p, client)
            results["ttft"], results["break_even"] = {}, {}
            for name in p.models:
                results["ttft"][name], results["break_even"][name] = bench_model(
                    name, p, url, prefix, device, dtype)
        finally:
            admin = redis.Redis.from_url(url)
            for keys in _chunks(list(admin.scan_iter(f"{prefix}:*", count=1000)), 1000):
                admin.delete(*keys)
    results["shared_l3_sim"] = (bench_shared_l3_sim(quick) if simulate else
                                {"measured": False, "reason": "--no-simulate"})
    results["goals"] = {
        **{f"ttft_l3_over_cold<=0.3[{m}]": goal_l3(r) for m, r in results["ttft"].items()},
        "shared_l3_hit_over_bound>=0.97": (results["shared_l3_sim"]["hit_over_bound"] >= 0.97
                                           if results["shared_l3_sim"]["measured"] else None)}
    return results


def goal_l3(t: dict) -> bool | None:
    """The L3 TTFT goal, or None for a prompt shorter than the goal's."""
    return t["ttft_l3_over_cold"] <= 0.3 if t["prompt_tokens"] >= GOAL_PROMPT_TOKENS else None


def _chunks(items: list, n: int) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def render(r: dict) -> str:
    red = r["redis"]
    lines = [f"L3 Redis throughput ({red['payload_preset']} payloads, page {red['page_size']}, "
             f"{red['dtype']}, pipelined = {red['batch_pages']} pages per round trip)",
             f"{'payload':<14}{'KB/page':>9}{'write 1x1':>20}{'write pipe':>20}{'read 1x1':>20}"
             f"{'read pipe':>20}{'encode':>11}{'decode':>11}"]
    for kind, k in red["kinds"].items():
        cell = lambda e: f"{e['pages_s']:>8.0f} p/s {e['mb_s']:>5.0f} MB/s"  # noqa: E731
        lines.append(f"{kind:<14}{k['payload_bytes'] / 1e3:>9.1f}{cell(k['write_one_by_one']):>20}"
                     f"{cell(k['write_pipelined']):>20}{cell(k['read_one_by_one']):>20}"
                     f"{cell(k['read_pipelined']):>20}{k['encode']['mb_s']:>6.0f} MB/s"
                     f"{k['decode']['mb_s']:>6.0f} MB/s")
    lines += ["", f"TTFT ({r['machine']['device']}, {r['machine']['dtype']}, "
              f"{r['machine']['threads']} threads)",
              f"{'model':<19}{'prompt':>7}{'cold s':>9}{'L1 s':>8}{'L2 s':>8}{'L3 s':>8}"
              f"{'L1/cold':>9}{'L2/cold':>9}{'L3/cold':>9}{'<=0.3':>7}{'cold+WT s':>11}"]
    for m, t in r["ttft"].items():
        ok = {True: "pass", False: "FAIL", None: "n/a"}[goal_l3(t)]
        lines.append(f"{m:<19}{t['prompt_tokens']:>7}{t['ttft_cold_s']:>9.3f}{t['ttft_l1_s']:>8.3f}"
                     f"{t['ttft_l2_s']:>8.3f}{t['ttft_l3_s']:>8.3f}{t['ttft_l1_over_cold']:>9.3f}"
                     f"{t['ttft_l2_over_cold']:>9.3f}{t['ttft_l3_over_cold']:>9.3f}"
                     f"{ok:>7}{t['ttft_cold_write_through_s']:>11.3f}")
    lines += ["", "L3 load vs recompute",
              f"{'model':<19}{'compute ms/token':>17}{'load ms/page':>14}{'load fixed ms':>15}"
              f"{'break-even tokens':>19}  points (tokens: cold s / L3 s)"]
    for m, e in r["break_even"].items():
        pts = ", ".join(f"{q['prompt_tokens']}: {q['ttft_cold_s']:.3f}/{q['ttft_l3_s']:.3f}"
                        for q in e["points"])
        lines.append(f"{m:<19}{e['compute_s_per_token'] * 1e3:>17.3f}"
                     f"{e['load_s_per_page'] * 1e3:>14.3f}"
                     f"{e['load_fixed_s'] * 1e3:>15.2f}{str(e['break_even_tokens']):>19}  {pts}")
    sim = r["shared_l3_sim"]
    if sim["measured"]:
        lines += ["", f"shared L3 simulation ({sim['requests']} requests, {sim['workers']} workers x "
                  f"{sim['capacity_tokens']:,} tokens + {sim['l3_capacity_tokens']:,}-token "
                  f"{sim['l3_write_policy']} L3, affinity policy)",
                  f"hit ratio {sim['hit_ratio']:.4f} (device {sim['device_hit_ratio']:.4f}, host "
                  f"{sim['host_hit_ratio']:.4f}, L3 {sim['l3_hit_ratio']:.4f}); pooled bound over "
                  f"all tiers {sim['l3_bound_hit_ratio']:.4f}: ratio {sim['hit_over_bound']:.4f} "
                  f"(goal >= 0.97); device-only pooled bound {sim['bound_hit_ratio']:.4f} "
                  f"(ratio {sim['hit_over_pooled_device_bound']:.3f})"]
    else:
        lines += ["", f"shared L3 hit ratio: not measured ({sim['reason']})"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m compute_service.bench_tiers",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, well under a minute")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--redis-url", help="use this Redis instead of starting one")
    ap.add_argument("--models",
                    help="comma-separated presets (default small-hybrid,small-transformer)")
    ap.add_argument("--prompt-tokens", type=int)
    ap.add_argument("--lengths", help="comma-separated extra prompt lengths for the break-even")
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--payload-preset", help="preset whose pages the Redis throughput uses")
    ap.add_argument("--throughput-pages", type=int)
    ap.add_argument("--checkpoint-every-pages", type=int,
                    help="Mamba checkpoint interval in pages (hybrids resume only at one; "
                         "default 8)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: auto)")
    ap.add_argument("--no-simulate", action="store_true", help="skip the gateway simulation")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    p = Params.quick() if args.quick else Params()
    if args.models:
        p.models = tuple(m for m in args.models.split(",") if m)
    if args.lengths:
        p.lengths = tuple(int(v) for v in args.lengths.split(",") if v)
    for field in ("prompt_tokens", "page_size", "payload_preset", "throughput_pages",
                  "checkpoint_every_pages"):
        if getattr(args, field) is not None:
            setattr(p, field, getattr(args, field))
    started = time.perf_counter()
    results = run(p, args.redis_url, args.threads, not args.no_simulate, args.quick)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    print(render(results))
    print(f"wall time {results['wall_s']} s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
