"""cpu_kernels (opt-in: `--parts cpu_kernels`): what the C kernels of `compute_service/kernels/
csrc` are worth to a decode. The same decode as the `decode` part (engine only) in child
processes with PREFIXCACHE_CPU_NATIVE=on and =off, alternating, so that load drift on a shared
machine hits both sides alike; `off` is what a machine without a C compiler runs (oneDNN
projections, PyTorch decode attention, the reference LoRA update)."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from prefixcache_bench.compute.params import Params
from compute_service.model import CausalLM
from prefixcache_bench.harness import log

MODES = ("on", "off")


def child_decode(name: str, p: Params, mode: str, out: Path) -> dict:
    """One `--parts decode --no-hf` run of preset `name` with PREFIXCACHE_CPU_NATIVE=`mode`:
    (its preset's results, the machine's cpu_kernels)."""
    cmd = [sys.executable, "-m", "prefixcache_bench.compute", "--parts", "decode", "--no-hf",
           "--presets", name, "--threads", str(torch.get_num_threads()), "--seed", str(p.seed),
           "--decode-reps", "1", "--decode-requests", str(p.decode_requests),
           "--decode-prompt-tokens", str(p.decode_prompt_tokens),
           "--decode-new-tokens", str(p.decode_new_tokens), "--json", str(out)]
    env = dict(os.environ, PREFIXCACHE_CPU_NATIVE=mode)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(f"PREFIXCACHE_CPU_NATIVE={mode} run failed: {done.stderr[-1000:]}")
    data = json.loads(out.read_text())
    return data["presets"][name] | {"cpu_kernels": data["machine"]["cpu_kernels"]}


def bench_cpu_kernels(model: CausalLM, name: str, p: Params) -> dict:
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    backends: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="cbench-native-") as tmp:
        for rnd in range(1, p.cpu_kernels_rounds + 1):
            for mode in MODES:
                r = child_decode(name, p, mode, Path(tmp) / f"{mode}-{rnd}.json")
                rates[mode].append(r["decode_steady_tok_s"])
                backends[mode] = {k: v for k, v in r["cpu_kernels"].items() if k != "library"}
                log(f"  cpu_kernels round {rnd}/{p.cpu_kernels_rounds} {mode}: "
                    f"{r['decode_steady_tok_s']} tok/s steady")
    on, off = (statistics.median(rates[m]) for m in MODES)
    return {"cpu_kernels_on_tok_s": round(on, 2), "cpu_kernels_off_tok_s": round(off, 2),
            "cpu_kernels_speedup": round(on / off, 4),
            "cpu_kernels_samples_tok_s": rates, "cpu_kernels_backends": backends}
