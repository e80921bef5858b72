"""The compute-service benchmark runs end to end on tiny presets and sizes and reports sane numbers.

Speed goals are not asserted (they depend on the machine); only that every metric exists with a
plausible value, and the things that are exact: cached and computed token counts, the burst's
dedup, and the engine's greedy tokens against Hugging Face's for a transformer.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from prefixcache_bench import compute as bench

PRESETS = ["tiny-transformer", "tiny-hybrid"]
PAGE = 16
TTFT_TOKENS = 96
BURST = dict(requests=4, prefix=32, suffix=4)
TINY = ["--presets", ",".join(PRESETS), "--threads", "1",
        "--ttft-prompt-tokens", str(TTFT_TOKENS), "--ttft-token-budget", "128", "--ttft-reps", "1",
        "--burst-requests", str(BURST["requests"]), "--burst-prefix-tokens", str(BURST["prefix"]),
        "--burst-suffix-tokens", str(BURST["suffix"]), "--burst-new-tokens", "2",
        "--burst-token-budget", "16",
        "--decode-requests", "3", "--decode-prompt-tokens", "8", "--decode-new-tokens", "6",
        "--decode-reps", "1",
        "--lora-requests", "8", "--lora-prompt-tokens", "8", "--lora-new-tokens", "6",
        "--lora-reps", "1"]
LORA_COUNTS = (1, 4, 8)

PRESET_KEYS = [
    "ttft_cold_s", "ttft_50_s", "ttft_90_s", "ttft_ratio_50", "ttft_ratio_90",
    "ttft_50_cached_tokens", "ttft_90_cached_tokens", "ttft_cold_computed_tokens",
    "burst_prefill_ratio", "burst_ideal_ratio", "burst_wall_s", "burst_shared_in_flight_tokens",
    "burst_computed_prompt_tokens", "burst_preemptions",
    "decode_tok_s", "decode_steady_tok_s", "hf_decode_tok_s", "throughput_vs_hf",
    "throughput_vs_hf_end_to_end",
    "greedy_match_frac", "greedy_exact_requests", "goals",
    "lora_tok_s_base", "lora_tok_s_1", "lora_tok_s_4", "lora_tok_s_8",
    "lora_ratio_1", "lora_ratio_4", "lora_ratio_8",
]
KERNEL_KEYS = ["decode_attn_hbm_frac", "extend_attn_bf16_frac", "decode_attn_gb_s",
               "sdpa_decode_gb_s", "extend_attn_tflop_s", "sdpa_extend_tflop_s"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> tuple[dict, str]:
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("bench") / "out.json"
    # Output is captured by hand: the printed table is part of what is checked.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert bench.main([*TINY, "--json", str(path)]) == 0
    return json.loads(path.read_text()), out.getvalue()


def test_every_key_exists(results):
    data, _ = results
    assert set(data) >= {"presets", "kernels", "summary", "params", "machine", "total_s"}
    assert list(data["presets"]) == PRESETS
    for name in PRESETS:
        missing = [k for k in PRESET_KEYS if k not in data["presets"][name]]
        assert not missing, f"{name}: missing {missing}"
    assert all(k in data["kernels"] for k in KERNEL_KEYS)
    assert data["machine"]["torch_threads"] == 1
    assert data["params"]["ttft_prompt_tokens"] == TTFT_TOKENS


def test_ttft_values(results):
    data, _ = results
    for name in PRESETS:
        r = data["presets"][name]
        assert 0 < r["ttft_cold_s"] < 60 and 0 < r["ttft_50_s"] < 60 and 0 < r["ttft_90_s"] < 60
        assert r["ttft_ratio_90"] == pytest.approx(r["ttft_90_s"] / r["ttft_cold_s"], rel=1e-2)
        assert r["ttft_cold_computed_tokens"] == TTFT_TOKENS
        # Exactly the shared whole pages are hit (hybrids too: a checkpoint at every page).
        assert r["ttft_50_cached_tokens"] == TTFT_TOKENS // 2 // PAGE * PAGE
        assert r["ttft_90_cached_tokens"] == int(TTFT_TOKENS * 0.9) // PAGE * PAGE
        assert r["ttft_90_computed_tokens"] == TTFT_TOKENS - r["ttft_90_cached_tokens"]


def test_burst_values(results):
    data, _ = results
    prompt = BURST["prefix"] + BURST["suffix"]
    for name in PRESETS:
        r = data["presets"][name]
        # The prefix is computed once; every follower computes only its suffix.
        assert r["burst_prefill_ratio"] == pytest.approx(r["burst_ideal_ratio"], abs=1e-3)
        computed = BURST["prefix"] + BURST["requests"] * BURST["suffix"]
        assert r["burst_computed_prompt_tokens"] == computed
        assert 1 <= r["burst_prefill_ratio"] <= BURST["requests"]
        assert r["burst_shared_in_flight_tokens"] == (BURST["requests"] - 1) * BURST["prefix"]
        assert r["burst_wall_s"] > 0 and r["burst_preemptions"] == 0
        assert r["burst_computed_prompt_tokens"] <= BURST["requests"] * prompt


def test_decode_values(results):
    data, _ = results
    for name in PRESETS:
        r = data["presets"][name]
        assert r["decode_generated_tokens"] == 3 * 6
        assert r["decode_tok_s"] > 0 and r["hf_decode_tok_s"] > 0 and r["throughput_vs_hf"] > 0
        assert r["throughput_vs_hf"] == pytest.approx(
            r["decode_steady_tok_s"] / r["hf_decode_steady_tok_s"], rel=1e-3)
        assert r["throughput_vs_hf_end_to_end"] > 0
        assert 0 <= r["greedy_match_frac"] <= 1
    transformer = data["presets"]["tiny-transformer"]
    assert transformer["greedy_match_frac"] == 1.0 and transformer["greedy_exact_requests"] == 3
    assert transformer["goals"]["greedy_match_frac"]["pass"]
    assert "greedy_match_frac" not in data["presets"]["tiny-hybrid"]["goals"]


def test_lora_values(results):
    data, table = results
    for name in PRESETS:
        r = data["presets"][name]
        base = r["lora_tok_s_base"]
        assert base > 0
        for k in LORA_COUNTS:
            assert r[f"lora_tok_s_{k}"] > 0 and r[f"lora_wall_tok_s_{k}"] > 0
            assert r[f"lora_ratio_{k}"] == pytest.approx(r[f"lora_tok_s_{k}"] / base, rel=1e-2)
            # The batches really mixed k adapters (8 requests, max_loras 8).
            assert r[f"lora_max_adapters_per_step_{k}"] == k
        assert r["lora_ranks"] == [8, 16] * 4
        assert len(r["lora_samples_tok_s"]["8"]) == 1
    assert "lora_ratio_8" in table


def test_parts_runs_only_what_is_asked(tmp_path):
    path = tmp_path / "lora.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.main(["--presets", "tiny-transformer", "--threads", "1", "--parts", "lora",
                           "--lora-requests", "4", "--lora-prompt-tokens", "4",
                           "--lora-new-tokens", "3", "--lora-reps", "1",
                           "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    r = data["presets"]["tiny-transformer"]
    assert "lora_tok_s_base" in r and "ttft_cold_s" not in r and "decode_tok_s" not in r
    assert r["lora_max_adapters_per_step_8"] == 4  # 4 requests: at most 4 distinct adapters
    assert data["kernels"] == {"kernels_skipped_reason": "not in --parts"}
    assert data["params"]["parts"] == ["lora"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--parts", "lora,nope", "--json", str(path)])


def test_cpu_kernels_part_compares_the_switch_on_and_off(tmp_path):
    from compute_service.kernels import cpu_native

    if not cpu_native.enabled():
        pytest.skip("the CPU C kernels do not build here")
    path = tmp_path / "native.json"
    with contextlib.redirect_stdout(io.StringIO()):
        assert bench.main(["--presets", "tiny-transformer", "--threads", "1",
                           "--parts", "cpu_kernels", "--cpu-kernels-rounds", "1",
                           "--decode-requests", "2", "--decode-prompt-tokens", "8",
                           "--decode-new-tokens", "6", "--json", str(path)]) == 0
    r = json.loads(path.read_text())["presets"]["tiny-transformer"]
    assert r["cpu_kernels_on_tok_s"] > 0 and r["cpu_kernels_off_tok_s"] > 0
    assert r["cpu_kernels_speedup"] == pytest.approx(
        r["cpu_kernels_on_tok_s"] / r["cpu_kernels_off_tok_s"], rel=1e-3)
    assert r["cpu_kernels_backends"]["on"]["gemm"] == "native"
    assert r["cpu_kernels_backends"]["off"] == {"gemm": "onednn", "decode_attention": "torch"}
    assert "decode_tok_s" not in r  # only the part asked for ran in this process


def test_goals_summary_and_table(results):
    data, table = results
    for name in PRESETS:
        goals = data["presets"][name]["goals"]
        assert {"ttft_ratio_90", "burst_prefill_ratio", "throughput_vs_hf"} <= set(goals)
        assert all(isinstance(g["pass"], bool) for g in goals.values())
    summary = data["summary"]
    assert summary["all_pass"] == all(summary["goals"].values())
    assert set(summary["failed"]) == {k for k, ok in summary["goals"].items() if not ok}
    for name in PRESETS:
        assert f"== {name}" in table
    assert "ttft_ratio_90" in table and "goals:" in table


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_kernels_null_without_cuda(results):
    data, _ = results
    kernels = data["kernels"]
    assert all(kernels[k] is None for k in KERNEL_KEYS)
    assert "CUDA" in kernels["kernels_skipped_reason"]


def test_kernel_measurements_under_triton_interpreter():
    """The CUDA part's code path on CPU (Triton interpreter, fp32, tiny shapes): both kernels
    agree with SDPA on the paged layout the bench builds, and rates come out positive."""
    pytest.importorskip("triton")
    script = textwrap.dedent("""
        import json, torch
        from prefixcache_bench import compute as bench
        s = bench.KernelShapes(q_heads=4, kv_heads=2, head_dim=16, page_size=4, decode_batch=2,
                               decode_seq_len=37, extend_batch=2, extend_tokens=21, iters=1)
        gen = torch.Generator().manual_seed(0)
        cpu = torch.device("cpu")
        out = bench.measure_decode_attention(s, torch.float32, cpu, gen)
        out |= bench.measure_extend_attention(s, torch.float32, cpu, gen)
        print(json.dumps(out))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["decode_attn_max_abs_err"] < 1e-4 and out["extend_attn_max_abs_err"] < 1e-4
    rates = ("decode_attn_gb_s", "sdpa_decode_gb_s", "extend_attn_tflop_s", "sdpa_extend_tflop_s")
    assert all(out[key] > 0 for key in rates)


def test_agreement_counts_the_prefix_before_the_first_difference():
    frac, exact = bench.agreement([[1, 2, 3, 4], [1, 2, 3, 4]], [[1, 2, 3, 4], [1, 9, 3, 4]], 4)
    assert exact == 1 and frac == pytest.approx((4 / 4 + 1 / 4) / 2)


def test_the_command_and_thread_choice_are_recorded(results):
    data, _ = results
    assert data["command"].startswith("python -m prefixcache_bench.compute --presets ")
    assert "--threads 1" in data["command"]
    assert data["machine"]["torch_threads_reason"] == "--threads"


def test_device_peaks_lookup():
    p = bench.Params()
    assert bench.device_peaks("NVIDIA H100 80GB HBM3", p) == (3350.0, 989.0)
    assert bench.device_peaks("NVIDIA H100 PCIe", p) == (2000.0, 756.0)
    assert bench.device_peaks("NVIDIA H200", p) == (4800.0, 989.0)
    assert bench.device_peaks("Some GPU", p) == (None, None)
    assert bench.device_peaks("Some GPU", bench.Params(hbm_peak_gb_s=1.0)) == (1.0, None)


def test_unknown_preset_is_rejected(tmp_path):
    with pytest.raises(SystemExit):
        bench.parse_args(["--presets", "no-such-model", "--json", str(tmp_path / "x.json")])
