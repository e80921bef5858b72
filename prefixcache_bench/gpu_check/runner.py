"""The run: stages in order, each under its own budget inside the overall deadline, each written
as soon as it ends; one table at the end; the exit status."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

STAGES = ("tests", "kernels", "engine", "sizing")
# Seconds per stage on a GPU (an H100's whole run must end within 8 minutes, start-up included);
# the dry run's are for a busy 2-core CPU machine.
BUDGETS_S = {"tests": 170.0, "kernels": 80.0, "engine": 160.0, "sizing": 35.0}
# (generous: the dry run checks that every path works, and a shared CPU can be slow)
DRY_BUDGETS_S = {"tests": 90.0, "kernels": 60.0, "engine": 90.0, "sizing": 30.0}
MIN_STAGE_S = 5.0  # a stage with less left than this is skipped, with the reason recorded
DEFAULT_DEADLINE_S = 450.0


class StageTimeout(Exception):
    """Raised in the main thread when a stage outlives its budget (SIGALRM)."""


@dataclass(slots=True)
class Context:
    outdir: Path
    dry_run: bool
    device: object  # torch.device
    deadline: float  # time.monotonic() by which the whole run must end
    stage_deadline: float = 0.0
    device_info: dict = field(default_factory=dict)
    # What one stage leaves for the next (the model of the engine stage for the sizing stage).
    shared: dict = field(default_factory=dict)

    def left(self) -> float:
        """Seconds left to this stage (its budget, within the overall deadline)."""
        return min(self.stage_deadline, self.deadline) - time.monotonic()


def check(name: str, ok: bool, **detail: object) -> dict:
    """One correctness check as the JSON records it; a failed one fails the run."""
    return {"name": name, "ok": bool(ok), **detail}


def skipped(reason: str) -> dict:
    return {"skipped": reason}


@contextlib.contextmanager
def alarm(seconds: float) -> Iterator[None]:
    """StageTimeout after `seconds` (main thread, POSIX); elsewhere, only the stages' own checks
    of `Context.left` bound them."""
    if not hasattr(signal, "SIGALRM") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def fire(signum, frame):
        raise StageTimeout(f"stage outlived its budget ({seconds:.0f} s)")

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    tmp.replace(path)


def _stage_fn(name: str) -> Callable[[Context], dict]:
    # Imported per stage: a stage whose imports fail is that stage's error, not the run's.
    if name == "tests":
        from prefixcache_bench.gpu_check import stage_tests as m
    elif name == "kernels":
        from prefixcache_bench.gpu_check import stage_kernels as m
    elif name == "engine":
        from prefixcache_bench.gpu_check import stage_engine as m
    else:
        from prefixcache_bench.gpu_check import stage_sizing as m
    return m.run


def failed_checks(result: dict) -> list[str]:
    """Names of the failed checks anywhere in a stage's result."""
    out: list[str] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            if node.get("ok") is False and "name" in node:
                out.append(str(node["name"]))
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(result)
    return out


def run_stage(name: str, ctx: Context, budget_s: float) -> dict:
    started = time.monotonic()
    left = ctx.deadline - started
    if left < MIN_STAGE_S:
        return {"status": "skipped", "reason": f"overall deadline: {left:.0f} s left, the stage "
                f"needs at least {MIN_STAGE_S:.0f}", "budget_s": budget_s, "seconds": 0.0}
    budget = min(budget_s, left)
    ctx.stage_deadline = started + budget
    print(f"[gpu_check] stage {name}: budget {budget:.0f} s", flush=True)
    try:
        # The stages watch ctx.left() themselves; the alarm is the backstop (a few seconds on).
        with alarm(budget + 15.0):
            result = _stage_fn(name)(ctx)
        status = "ok"
    except StageTimeout as e:
        result, status = {"error": str(e)}, "timeout"
    except Exception as e:  # noqa: BLE001 - one stage's failure is recorded, the run goes on
        result = {"error": f"{type(e).__name__}: {e}",
                  "traceback": traceback.format_exc(limit=12)[-4000:]}
        status = "error"
    result = {"status": status, "budget_s": round(budget, 1),
              "seconds": round(time.monotonic() - started, 2), **result}
    failed = failed_checks(result)
    result["failed_checks"] = failed
    if failed and status == "ok":
        result["status"] = "failed"
    elif result.get("part_errors") and status == "ok":
        result["status"] = "error"  # a part raised: recorded in the part, counted as an error
    try:
        from prefixcache_bench.gpu_check.device import free_memory
        free_memory(ctx.device)
    except Exception:  # noqa: BLE001
        pass
    return result


def summary_line(name: str, r: dict) -> str:
    keys = r.get("headline", {})
    head = ", ".join(f"{k} {v}" for k, v in keys.items())
    why = r.get("reason") or r.get("error") or ""
    failed = r.get("failed_checks") or []
    checks = f"{len(failed)} failed: {', '.join(failed)[:80]}" if failed else "-"
    return f"{name:<8} {r.get('status', '?'):<8} {r.get('seconds', 0):>7.1f} s  checks {checks}" \
        f"  {head or why}"[:400]


# Goals of the whole run, judged in the JSON the way prefixcache_bench.harness.check_goals
# writes them ({metric: {goal, pass}}), so that committed results render in docs/results.
GOALS = {"correctness_checks_failed": ("==", 0), "decode_prefix_cache_ratio": (">=", 0.98),
         "ttft_ratio_90": ("<=", 0.2)}


def goals_of(report: dict, failed: dict) -> dict:
    """Flat headline metrics and the goals judged on them (None: not measured this run)."""
    stages = report["stages"]
    engine = stages.get("engine", {})
    metrics = {
        "correctness_checks_failed": sum(len(v) for v in failed.values()),
        "decode_prefix_cache_ratio": engine.get("prefix_cache_overhead", {}).get(
            "decode_prefix_cache_ratio") if isinstance(engine.get("prefix_cache_overhead"),
                                                      dict) else None,
        "ttft_ratio_90": engine.get("ttft", {}).get("ttft_ratio_90")
        if isinstance(engine.get("ttft"), dict) else None,
    }
    goals = {}
    for name, (op, bound) in GOALS.items():
        v = metrics.get(name)
        ok = None if v is None else {"==": v == bound, ">=": v >= bound, "<=": v <= bound}[op]
        goals[name] = {"goal": f"{op} {bound}", "pass": ok}
    return metrics | {"goals": goals}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m prefixcache_bench.gpu_check",
                                description=__doc__)
    p.add_argument("outdir", type=Path, help="where the JSON goes")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shapes, Triton interpreted: every stage's code path, fast")
    p.add_argument("--deadline-s", type=float, default=None,
                   help=f"the whole run's deadline (default {DEFAULT_DEADLINE_S:.0f} s; "
                        "dry run: the sum of its budgets)")
    p.add_argument("--stages", default=",".join(STAGES),
                   help=f"comma-separated subset of {','.join(STAGES)}")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        # Before triton is first imported: the Triton kernels run interpreted on CPU tensors.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    started = time.monotonic()
    import torch

    from prefixcache_bench.gpu_check.device import device_info, memory_report

    budgets = DRY_BUDGETS_S if args.dry_run else BUDGETS_S
    deadline_s = args.deadline_s or (sum(budgets.values()) if args.dry_run
                                     else DEFAULT_DEADLINE_S)
    args.outdir.mkdir(parents=True, exist_ok=True)
    names = [s for s in args.stages.split(",") if s]
    unknown = [s for s in names if s not in STAGES]
    if unknown:
        print(f"unknown stages {unknown}; known: {STAGES}", file=sys.stderr)
        return 2
    cuda = torch.cuda.is_available()
    report: dict = {"schema": "prefixcache.gpu_check/1", "dry_run": args.dry_run,
                    "started_unix": round(time.time(), 1), "deadline_s": deadline_s,
                    "budgets_s": budgets, "argv": sys.argv,
                    "command": " ".join(["scripts/gpu_check.sh", "OUTDIR", *(argv if argv
                                         is not None else sys.argv[2:])]),
                    "stages": {}}
    if not args.dry_run and not cuda:
        report["error"] = "no CUDA device: run on a GPU, or pass --dry-run"
        write_json(args.outdir / "gpu_check.json", report)
        print(report["error"], file=sys.stderr)
        return 2
    device = torch.device("cuda" if not args.dry_run else "cpu")
    if args.dry_run:
        torch.set_num_threads(1)  # a busy shared CPU: threads only oversubscribe it
    ctx = Context(args.outdir, args.dry_run, device, started + deadline_s)
    ctx.device_info = device_info(device)
    report["device"] = ctx.device_info
    write_json(args.outdir / "gpu_check.json", report)
    for name in STAGES:
        if name not in names:
            report["stages"][name] = {"status": "skipped", "reason": "not in --stages"}
            continue
        result = run_stage(name, ctx, budgets[name])
        result["memory"] = memory_report(device)
        report["stages"][name] = result
        write_json(args.outdir / f"stage_{name}.json", result)
        report["elapsed_s"] = round(time.monotonic() - started, 2)
        write_json(args.outdir / "gpu_check.json", report)
        print(f"[gpu_check] {summary_line(name, result)}", flush=True)
    failed = {n: r.get("failed_checks") for n, r in report["stages"].items()
              if r.get("failed_checks")}
    errors = {n: r.get("status") for n, r in report["stages"].items()
              if r.get("status") in ("error", "timeout")}
    # What this run imported beyond the standard library: the packages a device must have
    # (scripts/gpu_wheels.txt carries those its image lacks).
    report["imported_packages"] = sorted(
        {m.split(".")[0] for m in list(sys.modules)} - set(sys.stdlib_module_names)
        - {"prefixcache_bench", "compute_service", "cache_service", "prefixcache",
           "prefixcache_client", "service_shell", "gateway", "stack", "tests"}
        - {m for m in list(sys.modules) if m.startswith("_")})
    report |= goals_of(report, failed)
    report["correctness_failures"] = failed
    report["stage_errors"] = errors
    report["exit_status"] = 1 if failed else (2 if errors else 0)
    report["elapsed_s"] = round(time.monotonic() - started, 2)
    write_json(args.outdir / "gpu_check.json", report)
    print()
    print(f"gpu_check on {ctx.device_info.get('name')} ({'dry run' if args.dry_run else 'GPU'}),"
          f" {report['elapsed_s']:.0f} s of {deadline_s:.0f}; JSON in {args.outdir}")
    print(f"{'stage':<8} {'status':<8} {'time':>9}  checks / headline")
    for name, r in report["stages"].items():
        print(summary_line(name, r))
    if failed:
        print(f"CORRECTNESS FAILED: {failed}")
    return report["exit_status"]
