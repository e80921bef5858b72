"""What shapes a compute benchmark run (`Params`, written to the JSON as `params`), its parts and
the goals its metrics are held to."""
from __future__ import annotations

from dataclasses import dataclass

from prefixcache_bench.harness import Goal

DEFAULT_PRESETS = ("small-hybrid", "small-transformer")
# per preset, in this order
PRESET_PARTS = ("ttft", "burst", "decode", "lora", "cpu_kernels", "prefix_cache_overhead")
PARTS = (*PRESET_PARTS, "kernels")  # kernels: once per run
# What a run without --parts does: cpu_kernels and prefix_cache_overhead are asked for by name
# (they run child processes).
DEFAULT_PARTS = tuple(p for p in PARTS if p not in ("cpu_kernels", "prefix_cache_overhead"))

# Goals per preset metric. `greedy_match_frac` is a goal only for pure transformers (see
# `cli.goals_for`): HF's Mamba2 path is a different fp32 computation.
GOALS: dict[str, Goal] = {
    "ttft_ratio_90": Goal("<=", 0.2),  # 90% cached: the cached part is skipped, not recomputed
    "burst_prefill_ratio": Goal("<=", 1.3),  # a burst's shared prefix is computed once
    "throughput_vs_hf": Goal(">=", 1.5),  # continuous batching on paged KV vs HF `generate`
    "greedy_match_frac": Goal("==", 1.0),  # the same greedy tokens as HF
    # 0% hits: prefix caching through the gRPC sidecar costs at most 2% of decode throughput
    "decode_prefix_cache_ratio": Goal(">=", 0.98),
}

# Dense peaks by device name (substring, most specific first): HBM GB/s and bf16 TFLOP/s
# without sparsity, from the vendors' data sheets. Unknown devices get no fraction.
DEVICE_PEAKS: tuple[tuple[str, float, float], ...] = (
    ("H200", 4800.0, 989.0),
    ("H100 NVL", 3900.0, 835.0),
    ("H100 PCIe", 2000.0, 756.0),
    ("H100", 3350.0, 989.0),  # SXM ("NVIDIA H100 80GB HBM3")
    ("A100-SXM4-80GB", 2039.0, 312.0),
    ("A100 80GB PCIe", 1935.0, 312.0),
    ("A100", 1555.0, 312.0),  # 40 GB
)


@dataclass(slots=True)
class Params:
    """Everything that shapes a run; written to the JSON as `params`."""
    seed: int = 20240611
    presets: tuple[str, ...] = DEFAULT_PRESETS
    # torch.set_num_threads; None = "auto" (prefixcache_bench.harness.choose_threads): torch's
    # default, except 1 on an oversubscribed machine. The choice and its reason are recorded.
    threads: int | None = None
    page_size: int = 16
    # A step of a cold CPU prefill can outlast the cache service's default lease on a loaded
    # machine, and the engine does not survive an expired lease; a benchmark measures speed,
    # so its leases live long.
    lease_ttl_s: float = 600.0
    checkpoint_slots: int = 256  # enough Mamba checkpoints for every page of the longest prompt
    # ttft: one chunk holds the whole cold prompt, so cold TTFT is one forward.
    ttft_prompt_tokens: int = 2048
    ttft_token_budget: int = 4096
    ttft_fracs: tuple[float, ...] = (0.5, 0.9)
    ttft_tail_tokens: int = 16  # the warming request's own tokens after the shared part
    ttft_reps: int = 3
    # burst: the engine's default budget, so the leader's prefix spans several chunks and the
    # followers depend on per-chunk publishes.
    burst_requests: int = 16
    burst_prefix_tokens: int = 1024
    burst_suffix_tokens: int = 16
    burst_new_tokens: int = 4
    burst_token_budget: int = 512
    # decode
    decode_requests: int = 8
    decode_prompt_tokens: int = 64
    decode_new_tokens: int = 128
    decode_token_budget: int = 4096
    decode_reps: int = 3
    hf: bool = True
    # lora: base-only vs 1/4/8 adapters mixed, each run in a fresh engine with every adapter
    # loaded; rank i-th adapter = lora_ranks[i % len]; max_loras = the largest count.
    lora_requests: int = 16
    lora_adapter_counts: tuple[int, ...] = (1, 4, 8)
    lora_ranks: tuple[int, ...] = (8, 16)
    lora_prompt_tokens: int = 64
    lora_new_tokens: int = 64
    lora_token_budget: int = 4096
    lora_reps: int = 2
    # cpu_kernels: alternating child runs with the C kernels on and off, this many each
    cpu_kernels_rounds: int = 3
    # prefix_cache_overhead: this many rounds of (prefix caching through a gRPC cache service,
    # prefix caching off), each a batch of distinct random prompts of one length decoded at once
    overhead_requests: int = 32
    overhead_prompt_tokens: int = 64
    overhead_new_tokens: int = 96
    overhead_rounds: int = 5
    parts: tuple[str, ...] = DEFAULT_PARTS
    # kernels (CUDA only): decode = batch x seq_len keys, extend = batch x new tokens (causal)
    kernel_dtype: str = "bfloat16"
    kernel_heads: tuple[int, int, int] = (32, 8, 128)  # query heads, kv heads, head dim
    decode_kernel_batch: int = 64
    decode_kernel_seq_len: int = 4096
    extend_kernel_batch: int = 4
    extend_kernel_tokens: int = 4096
    kernel_iters: int = 20
    hbm_peak_gb_s: float | None = None  # override the DEVICE_PEAKS lookup
    bf16_peak_tflop_s: float | None = None
    profile: bool = False

    @classmethod
    def quick(cls) -> Params:
        return cls(ttft_prompt_tokens=512, ttft_token_budget=1024, ttft_reps=1,
                   burst_requests=8, burst_prefix_tokens=256, burst_suffix_tokens=8,
                   decode_new_tokens=16, decode_reps=1, lora_new_tokens=16, lora_reps=1,
                   decode_kernel_seq_len=1024, extend_kernel_tokens=1024, kernel_iters=5)
