"""Benchmarks of the compute service (engine + model + kernels), against the goals it is held to.

    python -m prefixcache_bench.compute [--quick] --json PATH [--presets small-hybrid,small-transformer]
                                    [--parts ttft,burst,decode,lora,kernels,prefix_cache_overhead]

Per preset (random weights from a fixed seed, fp32 on CPU, the embedded CacheCore):

- ttft:   time to first token (RequestStats.ttft_s) of one prompt cold, and with its first half /
          90% cached by an earlier request sharing exactly those tokens; a fresh engine per
          measurement, and a token budget that holds a cold prompt in one chunk (parts_ttft).
- burst:  requests sharing a long prefix submitted at once; prefill tokens computed over all of
          them / one prompt's tokens: the shared prefix is computed once (same-step dedup +
          per-chunk publish, design.md lesson 1) (parts_burst).
- decode: concurrent greedy requests through the engine vs Hugging Face transformers' `generate`
          on the same weights, same prompts, in the same run: steady decode throughput, whole
          runs, and the agreement of the greedy tokens (parts_decode).
- lora:   steady decode throughput on the base model only and with several distinct LoRA
          adapters mixed in one batch: what serving mixed adapters costs (parts_lora).
- cpu_kernels (only when named in --parts): the decode with PREFIXCACHE_CPU_NATIVE=on vs =off,
          in alternating child processes: what the C kernels are worth (parts_cpu_kernels).
- prefix_cache_overhead (only when named in --parts): steady decode of a batch of distinct
          prompts (0% hits) with prefix caching through a gRPC cache service child vs prefix
          caching off, the two engines stepped in turn, several rounds; the ratio and the
          engine's cache-wait fraction (parts_prefix_cache).

Once per run, when CUDA is available: the Triton paged decode and extend attention against
torch SDPA, as fractions of the device's HBM and bf16 peaks (parts_kernels). Without CUDA those
are null with a reason.

Sizes are `Params` and the goals `GOALS` (params.py). `--parts` runs a subset (default: all but
cpu_kernels and prefix_cache_overhead).
It prints a table (metric, value, goal, pass/fail) per preset and writes every metric, the goals,
the command, the parameters and the machine to --json (prefixcache_bench.harness). Progress goes
to stderr. The committed results and the pages made from them: docs/results/README.md
(`python -m prefixcache_bench.pages`).
"""
from prefixcache_bench.compute.cli import (SIZE_FLAGS, bench_preset, command_line, goals_for, main,
                                       parse_args, render, run)
from prefixcache_bench.compute.engine_runs import (DecodeRun, Finished, make_engine, pages_for,
                                               random_tokens, run_requests, timed_run, warm_up)
from prefixcache_bench.compute.params import (DEFAULT_PARTS, DEFAULT_PRESETS, DEVICE_PEAKS, GOALS,
                                          PARTS, PRESET_PARTS, Params)
from prefixcache_bench.compute.parts_burst import bench_burst
from prefixcache_bench.compute.parts_cpu_kernels import bench_cpu_kernels
from prefixcache_bench.compute.parts_decode import (HFRun, agreement, bench_decode, hf_generate,
                                                load_hf)
from prefixcache_bench.compute.parts_kernels import (KernelShapes, bench_kernels, device_peaks,
                                                 measure_decode_attention,
                                                 measure_extend_attention, paged_cache, time_fn)
from prefixcache_bench.compute.parts_lora import bench_lora, lora_run, write_bench_adapters
from prefixcache_bench.compute.parts_prefix_cache import (OverheadRun, bench_prefix_cache_overhead,
                                                      cache_service_process, overhead_engine,
                                                      overhead_round)
from prefixcache_bench.compute.parts_ttft import bench_ttft, shared_tokens, ttft_once

__all__ = ["DEFAULT_PARTS", "DEFAULT_PRESETS", "DEVICE_PEAKS", "GOALS", "PARTS", "PRESET_PARTS",
           "SIZE_FLAGS", "DecodeRun", "Finished", "HFRun", "KernelShapes", "OverheadRun", "Params",
           "agreement", "bench_burst", "bench_cpu_kernels", "bench_decode", "bench_kernels",
           "bench_lora", "bench_prefix_cache_overhead", "bench_preset", "bench_ttft", "command_line", "device_peaks", "goals_for",
           "hf_generate", "load_hf", "lora_run", "main", "make_engine", "measure_decode_attention",
           "measure_extend_attention", "paged_cache", "pages_for", "parse_args", "random_tokens",
           "render", "run", "run_requests", "shared_tokens", "time_fn", "timed_run", "ttft_once",
           "warm_up", "write_bench_adapters", "cache_service_process", "overhead_engine",
           "overhead_round"]
