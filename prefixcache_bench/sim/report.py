"""Turning simulation results into the JSON a machine compares, a table a person reads, a plot."""
from __future__ import annotations

import statistics
from collections.abc import Sequence

from prefixcache_bench.sim.engine import PolicyResult
from prefixcache_bench.harness import Goal, columns_table, percentile

BASELINES = ("round_robin", "least_loaded", "sglang")
# The affinity policy's targets: hit ratio within 3% of the pooled bound, prefill balanced.
HIT_VS_BOUND_GOAL = Goal(">=", 0.97)
IMBALANCE_GOAL = Goal("<=", 1.1)


def _percentile_or_zero(values: Sequence[float], q: float) -> float:
    """A run with no sample of a kind (no request finished) reports 0 rather than failing."""
    return percentile(values, q) if values else 0.0


def summarize(result: PolicyResult, bound_hit_ratio: float, l3_bound_hit_ratio: float | None = None) -> dict:
    """Per-policy numbers. With a shared L3, `l3_bound_hit_ratio` is the pooled bound over every
    tier (device + host + L3) and `hit_vs_l3_bound` the ratio the L3 goal is judged on."""
    computed = result.computed_per_worker
    mean = statistics.fmean(computed) if computed else 0.0
    prompt = result.prompt_tokens
    hit = result.cached_tokens / prompt if prompt else 0.0
    device = result.cached_tokens - result.host_hit_tokens - result.l3_hit_tokens
    out = {
        "hit_ratio": hit,
        "device_hit_ratio": device / prompt if prompt else 0.0,
        "host_hit_ratio": result.host_hit_tokens / prompt if prompt else 0.0,
        "l3_hit_ratio": result.l3_hit_tokens / prompt if prompt else 0.0,
        "bound_hit_ratio": bound_hit_ratio,
        "hit_vs_bound": hit / bound_hit_ratio if bound_hit_ratio else 0.0,
        "imbalance": max(computed) / mean if mean else 1.0,
        "mean_ttft_s": statistics.fmean(result.ttft_s) if result.ttft_s else 0.0,
        "p99_ttft_s": _percentile_or_zero(result.ttft_s, 0.99),
        "decision_p50_us": _percentile_or_zero(result.decision_ns, 0.5) / 1e3,
        "decision_p99_us": _percentile_or_zero(result.decision_ns, 0.99) / 1e3,
        "requests": result.requests,
        "prompt_tokens": result.prompt_tokens,
        "cached_tokens": result.cached_tokens,
        "device_hit_tokens": device,
        "host_hit_tokens": result.host_hit_tokens,
        "l3_hit_tokens": result.l3_hit_tokens,
        "computed_prefill_tokens_per_worker": computed,
        "index_page_events": result.page_events,
        "index_resyncs": result.index_resyncs,
        "index_keys": result.index_keys,
        "index_bytes": result.index_bytes,
        "index_evictions": result.index_evictions,
        "index_bytes_per_key": result.index_bytes / result.index_keys if result.index_keys else 0.0,
        "wall_s": result.wall_s,
        # The replay's wall time spent in the gateway's own code: Router.route, KvIndex.apply.
        "route_total_s": sum(result.decision_ns) / 1e9,
        "index_apply_s": result.index_apply_ns / 1e9,
    }
    if l3_bound_hit_ratio is not None:
        out["l3_bound_hit_ratio"] = l3_bound_hit_ratio
        out["hit_vs_l3_bound"] = hit / l3_bound_hit_ratio if l3_bound_hit_ratio else 0.0
        out["l3_page_writes"] = result.l3_page_writes
        out["l3_new_pages"] = result.l3_new_pages
        out["l3_evictions"] = result.l3_evictions
    return out


def goals(policies: dict[str, dict]) -> dict:
    """The affinity policy's targets, checked on this run."""
    aff = policies.get("affinity")
    if aff is None:
        return {}
    others = {name: policies[name] for name in BASELINES if name in policies}
    l3 = {}
    if "hit_vs_l3_bound" in aff:  # with a shared L3: judged on the bound pooling every tier
        l3 = {"hit_vs_l3_bound": aff["hit_vs_l3_bound"],
              "hit_vs_l3_bound_ok": HIT_VS_BOUND_GOAL.met(aff["hit_vs_l3_bound"])}
    return {
        "hit_vs_bound": aff["hit_vs_bound"],
        "hit_vs_bound_ok": HIT_VS_BOUND_GOAL.met(aff["hit_vs_bound"]),
        **l3,
        "imbalance_ok": IMBALANCE_GOAL.met(aff["imbalance"]),
        # None when no baseline ran (not a vacuous True).
        "beats_baselines_hit": all(aff["hit_ratio"] > o["hit_ratio"] for o in others.values()) if others else None,
        "beats_baselines_ttft": (all(aff["mean_ttft_s"] < o["mean_ttft_s"] for o in others.values())
                                 if others else None),
        "baselines_compared": sorted(others),
    }


def table(policies: dict[str, dict], bound_hit_ratio: float, l3_bound_hit_ratio: float | None = None) -> str:
    tiers = l3_bound_hit_ratio is not None or any(p["host_hit_tokens"] for p in policies.values())
    with_l3 = l3_bound_hit_ratio is not None
    header = ["policy", "hit", *(("device", "host", "L3") if tiers else ()), "/bound",
              *(("/L3bnd",) if with_l3 else ()), "imbal", "TTFT mean", "TTFT p99", "route p50",
              "route p99", "wall"]
    rows = []
    for name, p in policies.items():
        split = ((f"{p['device_hit_ratio']:.4f}", f"{p['host_hit_ratio']:.4f}", f"{p['l3_hit_ratio']:.4f}")
                 if tiers else ())
        vs_l3 = (f"{p['hit_vs_l3_bound']:.3f}",) if with_l3 else ()
        rows.append([name, f"{p['hit_ratio']:.4f}", *split, f"{p['hit_vs_bound']:.3f}", *vs_l3,
                     f"{p['imbalance']:.3f}", f"{p['mean_ttft_s']:.3f}s", f"{p['p99_ttft_s']:.2f}s",
                     f"{p['decision_p50_us']:.0f}us", f"{p['decision_p99_us']:.0f}us", f"{p['wall_s']:.0f}s"])
    lines = [f"bound hit ratio (one pooled LRU of workers x device capacity): {bound_hit_ratio:.4f}"]
    if with_l3:
        lines.append(f"L3 bound (one pooled LRU of workers x (device + host) + L3 capacity): "
                     f"{l3_bound_hit_ratio:.4f}")
    lines.append(columns_table(header, rows))
    return "\n".join(lines)


def plot(policies: dict[str, dict], bound_hit_ratio: float, path: str, title: str,
         l3_bound_hit_ratio: float | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(policies)
    panels = (("hit_ratio", "hit ratio (prompt tokens from cache)", "{:.4f}"),
              ("mean_ttft_s", "mean time to first token (s)", "{:.3f}"),
              ("p99_ttft_s", "p99 time to first token (s)", "{:.2f}"))
    tiers = l3_bound_hit_ratio is not None or any(policies[n]["host_hit_tokens"] for n in names)
    fig, axes = plt.subplots(1, len(panels), figsize=(14, 4.2))
    for ax, (key, label, fmt) in zip(axes, panels):
        values = [policies[n][key] for n in names]
        if key == "hit_ratio" and tiers:  # stacked by the tier the hits came from
            bottom = [0.0] * len(names)
            for tier, color, tier_label in (("device", "tab:blue", "device"), ("host", "tab:orange", "host"),
                                            ("l3", "tab:green", "L3")):
                part = [policies[n][f"{tier}_hit_ratio"] for n in names]
                if tier != "device" and not any(part):
                    continue
                bars = ax.bar(names, part, bottom=bottom, color=color, label=f"{tier_label} hits")
                bottom = [b + v for b, v in zip(bottom, part)]
        else:
            bars = ax.bar(names, values, color=["tab:blue" if n in ("affinity", "approx") else "tab:gray"
                                                for n in names])
        ax.bar_label(bars, [fmt.format(v) for v in values], fontsize=8)
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=25)
        ax.margins(y=0.12)
    axes[0].axhline(bound_hit_ratio, color="black", linestyle="--", label=f"pooled LRU bound {bound_hit_ratio:.3f}")
    if l3_bound_hit_ratio is not None:
        axes[0].axhline(l3_bound_hit_ratio, color="tab:red", linestyle=":",
                        label=f"pooled bound, all tiers {l3_bound_hit_ratio:.3f}")
    if tiers:  # room above the bars for a legend that names the tiers too
        top = max([bound_hit_ratio, l3_bound_hit_ratio or 0.0] + [policies[n]["hit_ratio"] for n in names])
        axes[0].set_ylim(0, top * 1.45)
        axes[0].legend(loc="upper center", ncol=2, fontsize=7)
    else:
        axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
