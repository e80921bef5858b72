"""The committed results as the pages show them: each `docs/results/**/*.json`, the command
that produced it, its machine and its headline rows (metric, value, goal, verdict), by kind of
JSON (the compute bench, the tier bench, the gateway simulator, the fault drill, or any harness
JSON).

Where the command comes from: the JSON's `command` (the benchmarks that use the harness record
it), else the `# python ...` header lines of the `.txt` beside the JSON, else a `# ...` line of
another `.txt` in the same folder that names the JSON. Torch-free.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from prefixcache_bench.harness import REPO

RESULTS = Path("docs") / "results"


@dataclass(frozen=True, slots=True)
class Row:
    metric: str
    value: object
    goal: str = ""
    verdict: str = ""  # PASS, FAIL, n/a (a goal not judged on this run), or "" (no goal)


@dataclass(slots=True)
class Source:
    """One committed JSON and what the page shows of it."""
    rel: str  # relative to docs/results, with forward slashes
    data: dict
    commands: list[str]
    txt: str | None = None  # the text output beside the JSON, relative to docs/results
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def verdicts(self) -> list[str]:
        return [r.verdict for r in self.rows if r.verdict in ("PASS", "FAIL")]


def verdict(ok: object) -> str:
    """PASS / FAIL, or n/a for a goal this run did not judge (None)."""
    return "n/a" if ok is None else "PASS" if ok else "FAIL"


def harness_goal_rows(metrics: Mapping, goals: Mapping, prefix: str = "") -> list[Row]:
    """Rows of `prefixcache_bench.harness.check_goals` output: {metric: {goal, pass}}."""
    return [Row(prefix + k, metrics.get(k), g.get("goal", ""), verdict(g.get("pass")))
            for k, g in goals.items()]


def is_harness_goals(goals: object) -> bool:
    return isinstance(goals, Mapping) and bool(goals) and all(
        isinstance(g, Mapping) and "pass" in g for g in goals.values())


# ---- what each kind of JSON shows --------------------------------------------------------------

COMPUTE_HEADLINE = ("ttft_cold_s", "decode_steady_tok_s", "hf_decode_steady_tok_s",
                    "lora_ratio_8", "cpu_kernels_on_tok_s", "cpu_kernels_off_tok_s",
                    "cpu_kernels_speedup", "decode_prefix_cache_tok_s",
                    "decode_no_prefix_cache_tok_s", "prefix_cache_wait_frac")
KERNEL_HEADLINE = ("decode_attn_gb_s", "decode_attn_hbm_frac", "extend_attn_tflop_s",
                   "extend_attn_bf16_frac")


def compute_rows(src: Source) -> None:
    """python -m prefixcache_bench.compute: per preset its goals, then a few figures."""
    d = src.data
    for name, r in d["presets"].items():
        goals = r.get("goals") or {}
        src.rows += harness_goal_rows(r, goals, f"{name} ")
        src.rows += [Row(f"{name} {k}", r[k]) for k in COMPUTE_HEADLINE
                     if r.get(k) is not None and k not in goals]
    kernels = d.get("kernels") or {}
    src.rows += [Row(f"kernels {k}", kernels[k]) for k in KERNEL_HEADLINE
                 if kernels.get(k) is not None]
    if "kernels" in (d.get("params") or {}).get("parts", ()) and kernels.get(
            "kernels_skipped_reason"):
        src.notes.append(f"kernels: {kernels['kernels_skipped_reason']}")


GOAL_KEY = re.compile(r"^(?P<metric>\w+?)(?P<op><=|>=|==|<|>)(?P<bound>[-\d.]+)"
                      r"(\[(?P<scope>[^\]]+)\])?$")


def tiers_rows(src: Source) -> None:
    """python -m prefixcache_bench.tiers: goals are `metric<=bound[model]` -> bool | None."""
    d = src.data
    goals = {}
    for key, ok in (d.get("goals") or {}).items():
        if m := GOAL_KEY.match(key):
            goals[(m["metric"], m["scope"])] = (f"{m['op']} {m['bound']}", ok)
    if d.get("l3_store"):  # "redis" (one node) or "redis-cluster" (bench_tiers --cluster)
        src.rows.append(Row("L3 store", f"{d['l3_store']} ({d.get('redis_url', '')})"))
    for name, t in (d.get("ttft") or {}).items():
        goal, ok = goals.get(("ttft_l3_over_cold", name), ("", ""))
        src.rows.append(Row(f"{name} ttft_l3_over_cold", t.get("ttft_l3_over_cold"), goal,
                            verdict(ok) if goal else ""))
        src.rows += [Row(f"{name} {k}", t[k]) for k in ("ttft_l1_over_cold", "ttft_l2_over_cold",
                                                          "ttft_cold_s") if k in t]
        be = (d.get("break_even") or {}).get(name) or {}
        if "break_even_tokens" in be:
            src.rows.append(Row(f"{name} break_even_tokens", be["break_even_tokens"]))
    for kind, k in ((d.get("redis") or {}).get("kinds") or {}).items():
        src.rows += [Row(f"redis {kind} {op} MB/s", k[op]["mb_s"])
                     for op in ("write_pipelined", "read_pipelined") if op in k]
        if "mac_over_checksum_decode" in k:  # the page MAC's cost on the load path
            src.rows.append(Row(f"redis {kind} decode MAC/checksum time",
                                k["mac_over_checksum_decode"]))
            src.rows += [Row(f"redis {kind} {f}", k[f]) for f in (
                "mac_us_per_page", "decode_us_per_page", "read_pipelined_us_per_page") if f in k]
    sim = d.get("shared_l3_sim") or {}
    if sim.get("measured"):
        goal, ok = goals.get(("shared_l3_hit_over_bound", None), ("", ""))
        src.rows.append(Row("shared_l3_sim hit_over_bound", sim.get("hit_over_bound"), goal,
                            verdict(ok) if goal else ""))
    elif sim:
        src.notes.append(f"shared L3 simulation not measured: {sim.get('reason')}")


# prefixcache_bench.sim.simulate's goals before it recorded them as {goal, pass}: (metric, goal, flag).
LEGACY_SIM_GOALS = (("hit_vs_bound", ">= 0.97", "hit_vs_bound_ok"),
                    ("hit_vs_l3_bound", ">= 0.97", "hit_vs_l3_bound_ok"),
                    ("imbalance", "<= 1.1", "imbalance_ok"),
                    ("hit_ratio", "> every baseline's", "beats_baselines_hit"),
                    ("mean_ttft_s", "< every baseline's", "beats_baselines_ttft"))
SIM_BENCH_HEADLINE = ("decision_p99_us", "hash_p99_us", "lookup_p99_us",
                      "ingest_page_events_per_s")


def simulate_rows(src: Source) -> None:
    """python -m prefixcache_bench.sim.simulate: the affinity policy against the bound and the baselines."""
    d = src.data
    policies = d["policies"]
    name = "affinity" if "affinity" in policies else next(iter(policies))
    aff = policies[name]
    goals = d.get("goals") or {}
    shown: set[str] = set()
    if is_harness_goals(goals):
        src.rows += harness_goal_rows({**d, **aff}, goals, f"{name} ")
        shown |= set(goals)
    else:
        for metric, goal, flag in LEGACY_SIM_GOALS:
            if flag in goals and metric in aff:
                src.rows.append(Row(f"{name} {metric}", aff[metric], goal, verdict(goals[flag])))
                shown.add(metric)
    src.rows += [Row(f"{name} {k}", aff[k]) for k in ("hit_ratio", "bound_hit_ratio",
                                                       "mean_ttft_s", "p99_ttft_s")
                 if k in aff and k not in shown]
    others = {k: p for k, p in policies.items() if k not in ("affinity", "approx")}
    if others:
        best = max(others, key=lambda k: others[k]["hit_ratio"])
        src.rows.append(Row(f"best baseline hit_ratio ({best})", others[best]["hit_ratio"]))
    bench = d.get("bench") or {}
    src.rows += [Row(f"routing bench {k}", bench[k]) for k in SIM_BENCH_HEADLINE if k in bench]


# Faults after which the drill expects L3 reuse back at the baseline's within the phase, its
# pages back in Redis and the L3 hit ratio of the prompts' history (what the conversation's
# previous turn sent too; of its tokens the worker's own tiers lacked, those L3 gave), in each
# conversation's second turn after the fault, at least
# DRILL_L3_TURN_RATIO x the baseline's (issue 25, finding 7: "back at its baseline within two
# turns"; the L3 share of whole prompts also counts their new part, an L3 hit in the baseline
# only because the drill's conversations repeat, held by no tier after the loss:
# stack/drill_reach.py), and faults that must stall no client for a second (finding 8).
DRILL_L3_BACK = ("redis-flushall", "redis-sigkill")
DRILL_L3_TURN_RATIO = 0.8
DRILL_NO_STALL = ("cache-sigkill",)


def drill_rows(src: Source) -> None:
    """python -m prefixcache_bench.stack.fault_drill: per fault, the requests that ran, failed and went wrong,
    its p50, its longest gap without a token and its L3 share of prompt tokens."""
    phases = src.data["phases"]
    base_pages = phases.get("baseline", {}).get("l3_pages_at_end")
    base_l3 = phases.get("baseline", {}).get("share", {}).get("l3")
    for phase, t in phases.items():
        src.rows.append(Row(f"{phase}: requests", t["requests"]))
        src.rows.append(Row(f"{phase}: failed", t["failed"], "== 0", verdict(t["failed"] == 0)))
        src.rows.append(Row(f"{phase}: wrong output", t["wrong"], "== 0",
                            verdict(t["wrong"] == 0)))
        if "max_gap_s" not in t:
            continue
        src.rows.append(Row(f"{phase}: p50 s", t["p50_s"]))
        if phase in DRILL_NO_STALL:
            src.rows.append(Row(f"{phase}: max gap s", t["max_gap_s"], "< 1",
                                verdict(t["max_gap_s"] < 1.0)))
        else:
            src.rows.append(Row(f"{phase}: max gap s", t["max_gap_s"]))
        src.rows.append(Row(f"{phase}: L3 share", t["share"]["l3"]))
        src.rows.append(Row(f"{phase}: L3 share, 2nd half", t["l3_share_second_half"]))
        pages = t.get("l3_pages_at_end")
        if phase in DRILL_L3_BACK and base_pages:
            src.rows.append(Row(f"{phase}: L3 pages at end", pages,
                                f">= 0.8 x baseline ({base_pages})",
                                verdict(pages is not None and pages >= 0.8 * base_pages)))
        by_turn = t.get("l3_share_by_turn_after")
        for turn, share in (by_turn or {}).items():
            src.rows.append(Row(f"{phase}: L3 share, {_turn_name(turn)} after", share))
        _drill_history_rows(src, phase, t, phases.get("baseline", {}), base_l3)
        computed = {k: v["computed"] for k, v in (t.get("share_by_turn_after") or {}).items()}
        if computed:
            src.rows.append(Row(f"{phase}: computed share, turn 1 / 2 / later after",
                                " / ".join(f"{v:.3f}" for v in computed.values())))


def _turn_name(turn: str) -> str:
    return "later turns" if turn == "later" else turn


def _drill_history_rows(src: Source, phase: str, t: dict, base: dict, base_l3) -> None:
    """The L3 share of the prompts' history per turn after the fault (judged in the second
    turn against the baseline's), and the share of their new part some worker held at the
    recovery (what a refill could write again). Results without reach_by_turn_after (before
    the drill measured it): the whole prompt's L3 share is judged, as it was then."""
    reach, base_reach = t.get("reach_by_turn_after"), base.get("reach_by_turn_after") or {}
    base_history = (base_reach.get("all") or {}).get("l3_hit_ratio_history")
    if not reach or base_history is None:
        share = (t.get("l3_share_by_turn_after") or {}).get("turn2")
        if phase in DRILL_L3_BACK and share is not None and base_l3:
            src.rows.append(Row(f"{phase}: L3 share, turn2 after, judged", share,
                                f">= {DRILL_L3_TURN_RATIO} x baseline ({base_l3})",
                                verdict(share >= DRILL_L3_TURN_RATIO * base_l3)))
        return
    for turn, row in reach.items():
        src.rows.append(Row(f"{phase}: L3 share of the history, {_turn_name(turn)} after",
                            row["l3_of_history"]))
        name = f"{phase}: L3 hit ratio of the history, {_turn_name(turn)} after"
        ratio = row.get("l3_hit_ratio_history")
        if ratio is not None and phase in DRILL_L3_BACK and turn == "turn2" and base_history:
            src.rows.append(Row(name, ratio, f">= {DRILL_L3_TURN_RATIO} x baseline ({base_history})",
                                verdict(ratio >= DRILL_L3_TURN_RATIO * base_history)))
        elif ratio is not None:
            src.rows.append(Row(name, ratio))
        if "held_of_new" in row:
            src.rows.append(Row(f"{phase}: new part held by a worker at the recovery, "
                                f"{_turn_name(turn)} after", row["held_of_new"]))
            src.rows.append(Row(f"{phase}: computed though held at the recovery, "
                                f"{_turn_name(turn)} after", row["computed_though_held"]))


def generic_rows(src: Source) -> None:
    """A JSON of `prefixcache_bench.harness` (flat metrics + check_goals), or any other: its
    goals, else its top-level numbers."""
    d = src.data
    if is_harness_goals(d.get("goals")):
        src.rows += harness_goal_rows(d, d["goals"])
    else:
        src.rows += [Row(k, v) for k, v in d.items()
                     if isinstance(v, int | float) and not isinstance(v, bool)][:12]


def kind_of(data: dict) -> Callable[[Source], None]:
    if "presets" in data and "kernels" in data:
        return compute_rows
    if "redis" in data and "break_even" in data:
        return tiers_rows
    if "policies" in data and "config" in data:
        return simulate_rows
    if "phases" in data and "exit_codes" in data:
        return drill_rows
    return generic_rows


# ---- commands and machines ---------------------------------------------------------------------

def commands_for(path: Path, data: dict) -> list[str]:
    """See the module docstring: the JSON's own, else its `.txt`'s header, else a mention."""
    cmd = data.get("command")
    if isinstance(cmd, list):
        return [" ".join(map(str, cmd))]
    if isinstance(cmd, str) and cmd:
        return [cmd]
    txt = path.with_suffix(".txt")
    if txt.exists():
        lines = []
        for line in txt.read_text().splitlines():
            if not line.startswith("#"):
                break
            text = line.lstrip("#").strip()
            if re.match(r"(\S*/)?(python3?|\.venv/bin/python)\b|\S+=\S+ python", text):
                lines.append(text)
        if lines:
            return lines
    for other in sorted(path.parent.glob("*.txt")):
        lines = [ln.lstrip("#").strip() for ln in other.read_text().splitlines()
                 if ln.startswith("#")]
        mentions = [ln for ln in lines if path.name in ln]
        if mentions:
            first = next((ln for ln in lines if ln.startswith("python")), None)
            return ([first] if first and first not in mentions else []) + mentions
    return []


def machine_line(m: Mapping | None) -> str:
    if not m:
        return "not recorded in the JSON"
    parts = []
    cpus = m.get("cpu_affinity") or m.get("cpu_count")
    if cpus:
        parts.append(f"{cpus} CPUs ({m.get('processor') or '?'})")
    if m.get("platform"):
        parts.append(str(m["platform"]))
    if m.get("python"):
        parts.append(f"Python {m['python']}")
    if m.get("torch"):
        parts.append(f"torch {m['torch']}")
    threads = m.get("torch_threads", m.get("threads"))
    if threads:
        parts.append(f"{threads} torch threads")
    if m.get("cuda"):
        parts.append(str(m["cuda"]))
    if isinstance(m.get("cpu_kernels"), Mapping):
        k = m["cpu_kernels"]
        parts.append(f"CPU kernels: GEMM {k.get('gemm')}, decode attention "
                     f"{k.get('decode_attention')}")
    if m.get("load_avg_start"):
        load = f"load {m['load_avg_start'][0]}"
        if m.get("load_avg_end"):
            load += f" -> {m['load_avg_end'][0]}"
        parts.append(load)
    if m.get("python_loop_s"):
        parts.append(f"a 10M-iteration Python loop {m['python_loop_s']} s")
    if m.get("git_commit"):
        parts.append(f"commit {str(m['git_commit'])[:10]}"
                     + (f" + uncommitted changes in {len(m['git_modified'])} files"
                        if m.get("git_modified") else ""))
    return ", ".join(parts)


def load_sources(root: Path = REPO) -> list[Source]:
    base = root / RESULTS
    sources = []
    for path in sorted(base.rglob("*.json")):
        rel = path.relative_to(base).as_posix()
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise SystemExit(f"{RESULTS / rel}: not JSON ({err})") from err
        if not isinstance(data, dict):
            continue
        txt = path.with_suffix(".txt")
        src = Source(rel, data, commands_for(path, data),
                     txt.relative_to(base).as_posix() if txt.exists() else None)
        kind_of(data)(src)
        sources.append(src)
    return sources
