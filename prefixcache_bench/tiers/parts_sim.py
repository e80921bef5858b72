"""shared_l3_sim: the gateway simulator (affinity policy) on the conversation trace with a fleet
of workers and a shared write-back L3: hit ratio (split device / host / L3) against the pooled
bound. The goal's bound is one pooled LRU of all the fleet's capacity (workers' device tiers plus
the L3): the pooled bound of the device tiers alone (also reported) is beaten by the L3's
capacity whatever the routing does. "not measured" with the reason when the simulator or the
trace is missing."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from prefixcache_bench.tiers.params import SHARED_L3_TOKENS, TRACE
from prefixcache_bench.harness import log

WORKERS, CAPACITY_TOKENS = 8, 1_000_000
QUICK_REQUESTS = 2000  # --quick replays the first requests only


def bench_shared_l3_sim(quick: bool) -> dict:
    """The gateway simulator with a shared L3, if it has one (see the module docstring)."""
    try:
        usage = subprocess.run([sys.executable, "-m", "prefixcache_bench.sim.simulate", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as err:
        return {"measured": False, "reason": f"prefixcache_bench.sim.simulate did not run: {err}"}
    if "--l3-capacity-tokens" not in usage:
        return {"measured": False, "reason": "prefixcache_bench/sim/simulate.py has no shared L3 tier option "
                "(--l3-capacity-tokens); hit ratio with a shared L3 not measured"}
    if not TRACE.exists():
        return {"measured": False, "reason": f"{TRACE} not found"}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "sim.json"
        cmd = [sys.executable, "-m", "prefixcache_bench.sim.simulate", "--trace", str(TRACE), "--policy",
               "affinity", "--workers", str(WORKERS), "--capacity-tokens", str(CAPACITY_TOKENS),
               "--l3-capacity-tokens", str(SHARED_L3_TOKENS), "--json", str(out),
               "--quiet"] + (["--max-requests", str(QUICK_REQUESTS)] if quick else [])
        log(f"gateway simulator with a shared L3: {' '.join(cmd[2:])} ...")
        started = time.perf_counter()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if run.returncode or not out.exists():
            return {"measured": False, "reason": f"simulator failed: {run.stderr[-500:]}"}
        result = json.loads(out.read_text())
    aff, l3 = result["policies"]["affinity"], result.get("l3") or {}
    hit, bound, l3_bound = aff["hit_ratio"], result["bound_hit_ratio"], l3.get("bound_hit_ratio")
    return {"measured": True, "trace": str(TRACE), "requests": aff["requests"], "workers": WORKERS,
            "capacity_tokens": CAPACITY_TOKENS, "l3_capacity_tokens": SHARED_L3_TOKENS,
            "l3_write_policy": l3.get("write_policy"), "l3_events": l3.get("events"),
            "l3_load_s_per_token": l3.get("load_s_per_token"),
            "hit_ratio": hit, "device_hit_ratio": aff.get("device_hit_ratio"),
            "host_hit_ratio": aff.get("host_hit_ratio"), "l3_hit_ratio": aff.get("l3_hit_ratio"),
            "mean_ttft_s": aff["mean_ttft_s"], "p99_ttft_s": aff["p99_ttft_s"],
            # The goal's bound: one pooled LRU of all the fleet's capacity (module docstring).
            "l3_bound_hit_ratio": l3_bound,
            "hit_over_bound": hit / l3_bound if l3_bound else None,
            # The pooled bound of the device tiers alone, for reference.
            "bound_hit_ratio": bound,
            "hit_over_pooled_device_bound": hit / bound if bound else None,
            "unbounded_hit_ratio": result.get("unbounded_hit_ratio"),
            "sim_wall_s": round(time.perf_counter() - started, 1)}
