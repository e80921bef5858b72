"""The run and its command line: Redis throughput, then TTFT per model, then the simulation;
tables on stdout, one JSON (prefixcache_bench.harness)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import sys
import time
from collections.abc import Iterator

import torch

from pagestore.client import L3Client, L3Config
from prefixcache_bench.tiers.params import GOAL_PROMPT_TOKENS, GOALS, Params, goal_key
from prefixcache_bench.tiers.parts_redis import bench_redis, redis_at
from prefixcache_bench.tiers.parts_sim import bench_shared_l3_sim
from prefixcache_bench.tiers.parts_ttft import bench_model
from prefixcache_bench.harness import (choose_threads, columns_table, fmt, load_average,
                                       machine_info, write_json)
from pagestore.settings import redact

PROG = "python -m prefixcache_bench.tiers"
WATCHED = ("compute_service", "cache_service", "prefixcache_bench")


def run(p: Params, redis_url: str | None, threads: int | None, simulate: bool, quick: bool,
        cluster: bool = False) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    n_threads, why = choose_threads(threads, torch.get_num_threads(), busy_applies=device == "cpu")
    torch.set_num_threads(n_threads)
    prefix = f"pcbench{os.getpid()}"
    machine = machine_info(extra={
        "torch": torch.__version__, "device": device, "dtype": str(dtype), "threads": n_threads,
        "threads_reason": why, "cuda": torch.cuda.get_device_name() if device == "cuda" else None},
        watched=WATCHED)
    results: dict = {"params": dataclasses.asdict(p), "machine": machine}
    with redis_at(redis_url, cluster) as url:
        results["redis_url"] = redact(url) if redis_url else (
            "own 3-master Redis Cluster" if cluster else "own redis-server")
        client = L3Client(L3Config(url, prefix=prefix, timeout_s=10.0, connect_timeout_s=1.0))
        results["l3_store"] = "redis-cluster" if client.settings.cluster else "redis"
        try:
            results["redis"] = bench_redis(p, client)
            results["ttft"], results["break_even"] = {}, {}
            for name in p.models:
                results["ttft"][name], results["break_even"][name] = bench_model(
                    name, p, url, prefix, device, dtype)
        finally:
            admin = client.redis
            keys = list(admin.scan_iter(f"{prefix}:*", count=1000))
            # One key per DEL on a cluster: a multi-key DEL across slots is CROSSSLOT.
            for chunk in _chunks(keys, 1 if client.settings.cluster else 1000):
                admin.delete(*chunk)
    results["shared_l3_sim"] = (bench_shared_l3_sim(quick) if simulate else
                                {"measured": False, "reason": "--no-simulate"})
    sim = results["shared_l3_sim"]
    results["goals"] = {
        **{f"{goal_key('ttft_l3_over_cold')}[{m}]": goal_l3(r) for m, r in results["ttft"].items()},
        goal_key("shared_l3_hit_over_bound"): (
            GOALS["shared_l3_hit_over_bound"].met(sim["hit_over_bound"]) if sim["measured"]
            else None)}
    machine["load_avg_end"] = load_average()
    return results


def goal_l3(t: dict) -> bool | None:
    """The L3 TTFT goal, or None for a prompt shorter than the goal's."""
    if t["prompt_tokens"] < GOAL_PROMPT_TOKENS:
        return None
    return GOALS["ttft_l3_over_cold"].met(t["ttft_l3_over_cold"])


def _chunks(items: list, n: int) -> Iterator[list]:
    for i in range(0, len(items), n):
        yield items[i:i + n]


def render(r: dict) -> str:
    red, m = r["redis"], r["machine"]
    mb = ("write_one_by_one", "write_pipelined", "read_one_by_one", "read_pipelined", "encode",
          "decode", "decode_checksum")
    redis_rows = [[kind, k["payload_bytes"] / 1e3, *(k[label]["mb_s"] for label in mb)]
                  for kind, k in red["kinds"].items()]
    goal = GOALS["ttft_l3_over_cold"]
    verdict = {True: "PASS", False: "FAIL", None: "n/a"}
    ttft_rows = [[name, t["prompt_tokens"], t["ttft_cold_s"], t["ttft_l1_s"], t["ttft_l2_s"],
                  t["ttft_l3_s"], t["ttft_l1_over_cold"], t["ttft_l2_over_cold"],
                  t["ttft_l3_over_cold"], verdict[goal_l3(t)], t["ttft_cold_write_through_s"]]
                 for name, t in r["ttft"].items()]
    be_rows = [[name, e["compute_s_per_token"] * 1e3, e["load_s_per_page"] * 1e3,
                e["load_fixed_s"] * 1e3, e["break_even_tokens"],
                ", ".join(f"{q['prompt_tokens']}: {q['ttft_cold_s']:.3f}/{q['ttft_l3_s']:.3f}"
                          for q in e["points"])]
               for name, e in r["break_even"].items()]
    lines = [f"L3 store: {r.get('l3_store', 'redis')} ({r.get('redis_url')})",
             f"L3 Redis throughput in MB/s ({red['payload_preset']} payloads, page "
             f"{red['page_size']}, {red['dtype']}, pipelined = {red['batch_pages']} pages per "
             "round trip)",
             columns_table(["payload", "KB/page", "write 1x1", "write pipe", "read 1x1",
                            "read pipe", "encode", "decode (MAC)", "decode (checksum)"],
                           redis_rows),
             "", f"TTFT ({m['device']}, {m['dtype']}, {m['threads']} threads; goal L3/cold "
             f"{goal} on prompts of {GOAL_PROMPT_TOKENS}+ tokens)",
             columns_table(["model", "prompt", "cold s", "L1 s", "L2 s", "L3 s", "L1/cold",
                            "L2/cold", "L3/cold", "goal", "cold+WT s"], ttft_rows),
             "", "L3 load vs recompute (points: tokens: cold s / L3 s)",
             columns_table(["model", "compute ms/token", "load ms/page", "load fixed ms",
                            "break-even tokens", "points"], be_rows)]
    sim = r["shared_l3_sim"]
    if sim["measured"]:
        lines += ["", f"shared L3 simulation ({fmt(sim['requests'])} requests, {sim['workers']} "
                  f"workers x {fmt(sim['capacity_tokens'])} tokens + "
                  f"{fmt(sim['l3_capacity_tokens'])}-token {sim['l3_write_policy']} L3, affinity "
                  "policy)",
                  f"hit ratio {fmt(sim['hit_ratio'])} (device {fmt(sim['device_hit_ratio'])}, "
                  f"host {fmt(sim['host_hit_ratio'])}, L3 {fmt(sim['l3_hit_ratio'])}); pooled "
                  f"bound over all tiers {fmt(sim['l3_bound_hit_ratio'])}: ratio "
                  f"{fmt(sim['hit_over_bound'])} (goal {GOALS['shared_l3_hit_over_bound']}); "
                  f"device-only pooled bound {fmt(sim['bound_hit_ratio'])} "
                  f"(ratio {fmt(sim['hit_over_pooled_device_bound'])})"]
    else:
        lines += ["", f"shared L3 hit ratio: not measured ({sim['reason']})"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from prefixcache_bench import tiers as bench_tiers

    ap = argparse.ArgumentParser(prog=PROG, description=bench_tiers.__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small sizes, a short run")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--redis-url", help="use this Redis instead of starting one "
                    "(redis+cluster://host:port for a Redis Cluster)")
    ap.add_argument("--cluster", action="store_true",
                    help="start a 3-master Redis Cluster instead of one redis-server")
    ap.add_argument("--models",
                    help="comma-separated presets (default small-hybrid,small-transformer)")
    ap.add_argument("--prompt-tokens", type=int)
    ap.add_argument("--lengths", help="comma-separated extra prompt lengths for the break-even")
    ap.add_argument("--page-size", type=int)
    ap.add_argument("--payload-preset", help="preset whose pages the Redis throughput uses")
    ap.add_argument("--throughput-pages", type=int)
    ap.add_argument("--checkpoint-every-pages", type=int,
                    help="Mamba checkpoint interval in pages (hybrids resume only at one)")
    ap.add_argument("--threads", type=int, help="torch intra-op threads (default: auto)")
    ap.add_argument("--no-simulate", action="store_true", help="skip the gateway simulation")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
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
    results = {"command": shlex.join([*PROG.split(), *argv])}
    results |= run(p, args.redis_url, args.threads, not args.no_simulate, args.quick, args.cluster)
    results["wall_s"] = round(time.perf_counter() - started, 1)
    print(render(results))
    print(f"wall time {results['wall_s']} s")
    if args.json:
        write_json(args.json, results)
    return 0
