"""The one benchmark harness: every benchmark, simulator report and replay of this project takes
its percentiles, machine description, thread rule, goal checks, tables and JSON from here, so that
two figures with the same name were computed the same way.

Torch-free (the gateway's tools use it); a torch-using benchmark passes its torch facts in through
`machine_info(extra=...)` and `choose_threads(default=torch.get_num_threads())`.
"""
from __future__ import annotations

import contextlib
import cProfile
import io
import json
import math
import os
import platform
import pstats
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


# ---- statistics --------------------------------------------------------------------------------

def percentile(samples: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in [0, 1], of a non-empty sample: always a value that was
    measured, never an interpolation between two."""
    if not samples:
        raise ValueError("percentile: empty sample")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile: q={q} is outside [0, 1]")
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(prefix: str, samples: Sequence[float], scale: float = 1.0,
              digits: int = 3) -> dict[str, float]:
    """`{prefix}_p50`, `_p99` and `_mean` of `samples`, multiplied by `scale` (e.g. 1e6 for
    seconds to microseconds) and rounded to `digits`."""
    return {f"{prefix}_p50": round(percentile(samples, 0.50) * scale, digits),
            f"{prefix}_p99": round(percentile(samples, 0.99) * scale, digits),
            f"{prefix}_mean": round(sum(samples) / len(samples) * scale, digits)}


# ---- the machine -------------------------------------------------------------------------------

def usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def choose_threads(requested: int | None, default: int, busy_applies: bool = True
                   ) -> tuple[int, str]:
    """Intra-op threads for a torch benchmark, and why. When other processes already keep every
    CPU busy, OpenMP workers wait on each other at every op's barrier, so a run with the default
    threads measures the scheduler more than the code: one thread then measures the code. An idle machine keeps torch's default. `busy_applies=False` (a GPU
    run) always keeps the default."""
    if requested:
        return requested, "--threads"
    load, cpus = os.getloadavg()[0], usable_cpus()
    if busy_applies and default > 1 and load >= cpus:
        return 1, (f"auto: 1-min load average {load:.1f} >= {cpus} usable CPUs, so the default "
                   f"of {default} threads would contend (--threads N to override)")
    return default, "auto: torch's default"


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# The loop `python_loop_s` times, run as a script's top level runs it (its variable a global, as
# in `python -c "for i in range(10_000_000): pass"`, the figure earlier notes quote; a loop in a
# function, its variable local, takes about half as long).
_LOOP = compile("for i in range(10_000_000): pass", "<python_loop_s>", "exec")


def python_loop_s() -> float:
    """Seconds this process takes for an empty Python loop of 10M iterations: the machine's speed
    when a bench ran (0.17-0.21 s on the 2-core development machine when it is quiet, 0.3-0.6 s
    on its noisy days, when neighbours share its host), so that a tail latency judged against an
    absolute goal can be read against how fast the machine was. The load average does not show
    it: a busy host slows every instruction without queueing runnable tasks here."""
    start = time.perf_counter()
    exec(_LOOP, {})  # noqa: S102 (a constant loop)
    return round(time.perf_counter() - start, 3)


def machine_info(extra: Mapping[str, object] | None = None,
                 watched: Sequence[str] = ()) -> dict:
    """What the figures were measured on: interpreter, CPU, load, speed (`python_loop_s`), git
    commit, and the uncommitted changes under `watched` paths (numbers depend on them too)."""
    info: dict = {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": usable_cpus(),
        "load_avg_start": load_average(),
        "python_loop_s": python_loop_s(),
    }
    with contextlib.suppress(Exception):
        import grpc
        from google.protobuf.internal import api_implementation
        info["protobuf_backend"] = api_implementation.Type()
        info["grpc"] = grpc.__version__
    with contextlib.suppress(Exception):
        def git(*args: str) -> str:
            return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout
        info["git_commit"] = git("rev-parse", "HEAD").strip()
        if watched:
            info["git_modified"] = sorted(line[3:] for line in git(
                "status", "--porcelain", "--", *watched).splitlines()
                if not line.startswith("??"))
    info.update(extra or {})
    return info


# ---- goals -------------------------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Goal:
    """A bound a metric must meet: `Goal("<=", 200)`. Shown as "<= 200" in tables and JSON."""
    op: str
    bound: float

    _OPS = {"<=": lambda v, b: v <= b, ">=": lambda v, b: v >= b, "==": lambda v, b: v == b,
            "<": lambda v, b: v < b, ">": lambda v, b: v > b}

    def __post_init__(self) -> None:
        if self.op not in self._OPS:
            raise ValueError(f"Goal.op: {self.op!r} is not one of {', '.join(self._OPS)}")

    def __str__(self) -> str:
        bound = int(self.bound) if float(self.bound).is_integer() else self.bound
        return f"{self.op} {bound}"

    def met(self, value: float | None) -> bool:
        return value is not None and bool(self._OPS[self.op](value, self.bound))


def check_goals(metrics: Mapping[str, object], goals: Mapping[str, Goal]) -> dict[str, dict]:
    """`{metric: {"goal": "<= 200", "pass": bool}}` for every goal whose metric was measured."""
    return {key: {"goal": str(goal), "pass": goal.met(metrics[key])}  # type: ignore[arg-type]
            for key, goal in goals.items() if key in metrics}


# ---- output ------------------------------------------------------------------------------------

def fmt(value: object) -> str:
    """A value as tables show it: thousands separators, 4 significant digits for fractions."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e4 else f"{value:,.0f}"
    return str(value)


def metric_table(metrics: Mapping[str, object], goals: Mapping[str, dict] | None = None,
                 title: str | None = None) -> str:
    """Metric, value, goal and PASS/FAIL: the goal rows first, then every other scalar.
    `goals` is `check_goals`' output."""
    goals = goals or {}
    rows = [(k, metrics[k], g["goal"], "PASS" if g["pass"] else "FAIL") for k, g in goals.items()]
    rows += [(k, v, "", "") for k, v in metrics.items()
             if k not in goals and not isinstance(v, Mapping | list | tuple)]
    if not rows:
        return f"== {title}\n(no metrics)" if title else "(no metrics)"
    width = max(len("metric"), *(len(r[0]) for r in rows))
    vwidth = max(len("value"), *(len(fmt(r[1])) for r in rows))
    gwidth = max(len("goal"), *(len(r[2]) for r in rows))
    lines = [f"== {title}"] if title else []
    lines += [f"{'metric':<{width}}  {'value':>{vwidth}}  {'goal':<{gwidth}}  result",
              "-" * (width + vwidth + gwidth + 12)]
    lines += [f"{k:<{width}}  {fmt(v):>{vwidth}}  {g:<{gwidth}}  {r}".rstrip() for k, v, g, r in rows]
    return "\n".join(lines)


def columns_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain table: the first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in header]] + [[fmt(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r: Sequence[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                         for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
    return "\n".join([line(cells[0]), "-" * (sum(widths) + 2 * (len(widths) - 1))]
                     + [line(r) for r in cells[1:]])


def write_json(path: str | Path, results: Mapping[str, object]) -> Path:
    """Writes `results` as indented JSON (parents created), so a run is diffable."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")
    return path


def print_and_write(results: Mapping[str, object], text: str, json_path: str | None) -> None:
    """Prints a run's text table; with `json_path`, writes the results there and the table beside
    them (the same name, .txt)."""
    print(text)
    if json_path:
        write_json(json_path, results).with_suffix(".txt").write_text(text + "\n")


def report(results: dict, goals: Mapping[str, Goal], title: str, command: str,
           machine: Mapping[str, object], json_path: str | None) -> bool:
    """Judges `results` against `goals`, records the command and the machine in them, prints
    the table and writes the JSON when asked; True when every goal passed."""
    results["goals"] = check_goals(results, goals)
    results["command"] = command
    results["machine"] = machine
    shown = {k: v for k, v in results.items() if k != "command"}
    print(metric_table(shown, results["goals"], title))
    if json_path:
        write_json(json_path, results)
    return all(g["pass"] for g in results["goals"].values())


# ---- progress and profiling --------------------------------------------------------------------

def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Progress:
    """Rate-limited progress lines on stderr, so that a long part shows it is alive; plus one
    line when `done` first reaches `total`, so that a short run still shows how it ended.
    `note` (e.g. "errors 2") is appended to the line. Not thread-safe: callers on several
    threads hold a lock around `update`."""

    def __init__(self, label: str, total: int, every_s: float = 2.0,
                 out: Callable[[str], None] = log):
        self.label, self.total, self.every_s, self.out = label, total, every_s, out
        self.start = self.last = time.perf_counter()
        self.finished = False

    def update(self, done: int, note: str = "") -> None:
        now = time.perf_counter()
        final = done >= self.total and not self.finished
        if final or now - self.last >= self.every_s:
            self.last, self.finished = now, self.finished or final
            rate = done / max(now - self.start, 1e-9)
            self.out(f"  {self.label}: {done:,}/{self.total:,} ({rate:,.0f}/s)"
                     + (f" {note}" if note else ""))


@contextlib.contextmanager
def maybe_profile(enabled: bool, label: str) -> Iterator[None]:
    """cProfile of the calling thread, top entries by own time to stderr."""
    if not enabled:
        yield
        return
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
        log(f"---- profile of {label} (tottime) ----\n{text.getvalue()}")
