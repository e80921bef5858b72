"""The run and its command line: every preset's parts, then the kernels; one table per preset,
one JSON (prefixcache_bench.harness)."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import shlex
import sys
import time
import warnings

import torch

from prefixcache_bench.compute.engine_runs import warm_up
from prefixcache_bench.compute.params import DEFAULT_PRESETS, GOALS, PARTS, PRESET_PARTS, Params
from prefixcache_bench.compute.parts_burst import bench_burst
from prefixcache_bench.compute.parts_cpu_kernels import bench_cpu_kernels
from prefixcache_bench.compute.parts_decode import bench_decode
from prefixcache_bench.compute.parts_kernels import bench_kernels
from prefixcache_bench.compute.parts_lora import bench_lora
from prefixcache_bench.compute.parts_prefix_cache import bench_prefix_cache_overhead
from prefixcache_bench.compute.parts_ttft import bench_ttft
from compute_service.kernels import cpu_native, cpu_status
from service_shell.config import ConfigError, native_settings_from_env
from compute_service.model import CausalLM, build_preset
from prefixcache_bench.harness import (Goal, check_goals, choose_threads, load_average, log,
                                       machine_info, maybe_profile, metric_table, write_json)

PROG = "python -m prefixcache_bench.compute"
# Uncommitted changes here change the numbers too (recorded as machine.git_modified).
WATCHED = ("compute_service", "cache_service", "prefixcache_bench")
# Settings read from the environment that change what is measured: part of the command.
ENV_SETTINGS = ("PREFIXCACHE_CPU_NATIVE",)
SIZE_FLAGS = ("ttft_prompt_tokens", "ttft_token_budget", "ttft_reps", "burst_requests",
              "burst_prefix_tokens", "burst_suffix_tokens", "burst_new_tokens",
              "burst_token_budget", "decode_requests", "decode_prompt_tokens",
              "decode_new_tokens", "decode_reps", "lora_requests", "lora_prompt_tokens",
              "lora_new_tokens", "lora_token_budget", "lora_reps", "cpu_kernels_rounds",
              "overhead_requests", "overhead_prompt_tokens", "overhead_new_tokens",
              "overhead_rounds")


def command_line(argv: list[str]) -> str:
    """The command that reproduces this run, environment settings included."""
    env = [f"{k}={os.environ[k]}" for k in ENV_SETTINGS if k in os.environ]
    return shlex.join([*env, *PROG.split(), *argv])


def torch_facts() -> dict:
    """What `machine_info` cannot know without torch."""
    facts = {
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu_kernels": cpu_status(),
    }
    with contextlib.suppress(Exception):
        import transformers
        facts["transformers"] = transformers.__version__
    return facts


def goals_for(model: CausalLM) -> dict[str, Goal]:
    if model.config.mamba_layer_ids:
        return {k: g for k, g in GOALS.items() if k != "greedy_match_frac"}
    return GOALS


def bench_preset(name: str, p: Params) -> dict:
    torch.manual_seed(p.seed)
    model = build_preset(name, seed=p.seed)
    results: dict = {"params_m": round(sum(t.numel() for t in model.parameters()) / 1e6, 2),
                     "model_type": model.config.model_type}
    warm_up(model, name, p)
    parts = {"ttft": bench_ttft, "burst": bench_burst, "decode": bench_decode,
             "lora": bench_lora, "cpu_kernels": bench_cpu_kernels,
             "prefix_cache_overhead": bench_prefix_cache_overhead}
    for part, fn in parts.items():
        if part not in p.parts:
            continue
        log(f"[{name}] {part}")
        with maybe_profile(p.profile, f"{name} {part}"):
            t = time.perf_counter()
            results |= fn(model, name, p)
            results[f"{part}_s"] = round(time.perf_counter() - t, 2)
    # A metric not measured (None: e.g. --no-hf) has no goal verdict.
    measured = {k: v for k, v in results.items() if v is not None}
    results["goals"] = check_goals(measured, goals_for(model))
    return results


def run(p: Params) -> dict:
    """Every preset, then the kernels; per-preset metrics, a summary, `params` and `machine`."""
    default_threads = torch.get_num_threads()
    threads, why = choose_threads(p.threads, default_threads)
    torch.set_num_threads(threads)
    log(f"torch threads: {threads} ({why})")
    machine = machine_info(extra=torch_facts(), watched=WATCHED)
    machine["torch_threads_default"], machine["torch_threads_reason"] = default_threads, why
    started = time.perf_counter()
    try:
        presets = ({name: bench_preset(name, p) for name in p.presets}
                   if set(p.parts) & set(PRESET_PARTS) else {})
        if "kernels" in p.parts:
            log("[kernels]")
            kernels = bench_kernels(p)
        else:
            kernels = {"kernels_skipped_reason": "not in --parts"}
    finally:  # a caller in the same process (tests) keeps its own setting
        torch.set_num_threads(default_threads)
    machine["load_avg_end"] = load_average()
    goals = {f"{name}.{key}": g["pass"]
             for name, r in presets.items() for key, g in r["goals"].items()}
    summary = {"all_pass": all(goals.values()), "goals": goals,
               "failed": [k for k, ok in goals.items() if not ok],
               "decode_attn_hbm_frac": kernels.get("decode_attn_hbm_frac"),
               "extend_attn_bf16_frac": kernels.get("extend_attn_bf16_frac")}
    return {"presets": presets, "kernels": kernels, "summary": summary,
            "total_s": round(time.perf_counter() - started, 2),
            "params": dataclasses.asdict(p), "machine": machine}


def render(results: dict) -> str:
    parts = [metric_table(r, r["goals"], title=name) for name, r in results["presets"].items()]
    parts.append(metric_table(results["kernels"], title="kernels"))
    s = results["summary"]
    parts.append(f"goals: {sum(s['goals'].values())}/{len(s['goals'])} pass"
                 + (f"; failed: {', '.join(s['failed'])}" if s["failed"] else "")
                 + f"; torch threads {results['machine']['torch_threads']}"
                 + f"; total {results['total_s']} s")
    return "\n\n".join(parts)


def parse_args(argv: list[str] | None = None) -> tuple[Params, argparse.Namespace]:
    from prefixcache_bench import compute as bench

    ap = argparse.ArgumentParser(prog=PROG, description=bench.__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="short TTFT prompts, a small burst, few new tokens, one repetition")
    ap.add_argument("--json", required=True, metavar="PATH", help="where to write the results")
    ap.add_argument("--presets", metavar="NAME[,NAME]", help=f"default {','.join(DEFAULT_PRESETS)}")
    ap.add_argument("--threads", type=int,
                    help="torch.set_num_threads (default: torch's own, or 1 when the load average "
                         "already fills every CPU)")
    ap.add_argument("--no-hf", dest="hf", action="store_false", default=None,
                    help="skip the Hugging Face comparison")
    ap.add_argument("--profile", action="store_true", help="cProfile each part to stderr")
    ap.add_argument("--check", action="store_true", help="exit 1 when a goal is missed")
    ap.add_argument("--parts", metavar="PART[,PART]",
                    help=f"what to run: {','.join(PARTS)} (default all but cpu_kernels and "
                         "prefix_cache_overhead; e.g. --parts lora)")
    ap.add_argument("--seed", type=int)
    ap.add_argument("--hbm-peak-gb-s", type=float, dest="hbm_peak_gb_s")
    ap.add_argument("--bf16-peak-tflop-s", type=float, dest="bf16_peak_tflop_s")
    # Sizes, mainly so that tests can run everything in seconds.
    for name in SIZE_FLAGS:
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, dest=name)
    args = ap.parse_args(argv)
    p = Params.quick() if args.quick else Params()
    overrides = {k: getattr(args, k) for k in ("seed", "threads", "hf", "hbm_peak_gb_s",
                                               "bf16_peak_tflop_s", *SIZE_FLAGS)
                 if getattr(args, k) is not None}
    if args.presets:
        overrides["presets"] = tuple(s.strip() for s in args.presets.split(",") if s.strip())
    if args.parts:
        overrides["parts"] = tuple(s.strip() for s in args.parts.split(",") if s.strip())
        unknown = [part for part in overrides["parts"] if part not in PARTS]
        if unknown or not overrides["parts"]:
            ap.error(f"--parts: unknown {', '.join(unknown) or '(none given)'} "
                     f"(available: {', '.join(PARTS)})")
    overrides["profile"] = args.profile
    p = dataclasses.replace(p, **overrides)
    from compute_service.model import PRESETS
    unknown = [n for n in p.presets if n not in PRESETS]
    if unknown:
        ap.error(f"--presets: unknown {', '.join(unknown)} (available: {', '.join(PRESETS)})")
    return p, args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p, args = parse_args(argv)
    # The benchmark is a tool, not a service: the kernels' settings come from the environment
    # (parts_cpu_kernels runs it with PREFIXCACHE_CPU_NATIVE=on and =off), through the one reader.
    try:
        native = native_settings_from_env()
    except ConfigError as exc:
        p.error(str(exc))
    cpu_native.configure(native["cpu_native"], native["kernel_cache"])
    # The engine logs per-request warnings that would drown the progress lines.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    warnings.filterwarnings("ignore", category=UserWarning, module="transformers")
    results = {"command": command_line(argv)} | run(p)
    write_json(args.json, results)
    print(render(results))
    print(f"\nwritten to {args.json}")
    # A missed goal is a result, not a failure of the tool; --check turns it into exit status 1.
    return 1 if args.check and not results["summary"]["all_pass"] else 0
