"""Stage `tests`: pytest in a child process, its junit XML folded into the JSON.

1. `-m gpu` over tests/compute_service: every test that skips without CUDA (bf16 kernels
   against their references; the `gpu` marker, helpers.requires_cuda);
2. the rest of the kernel tests, which on a CUDA machine run the compiled
   Triton kernels (fp16, fp32) against the references (tests/compute_service/kernels/helpers.py:
   DEVICE is cuda there), with what time is left.

Dry run: the same two invocations narrowed to one small file each (on CPU the gpu tests skip,
which the JSON then says).
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from prefixcache_bench.gpu_check.runner import Context, check, skipped

REPO = Path(__file__).resolve().parents[2]
GPU_RUN = ["tests/compute_service/kernels", "-m", "gpu"]
KERNEL_RUN = ["tests/compute_service/kernels",
              "-m", "not gpu"]
DRY_GPU_RUN = ["tests/compute_service/kernels/test_lora.py", "-m", "gpu"]
DRY_KERNEL_RUN: list[str] = []  # not run: see run()
PER_TEST_TIMEOUT_S = 120


def parse_junit(path: Path) -> dict:
    """Counts, the failed tests with the head of their message, and the skip reasons."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures: list[dict] = []
    skip_reasons: dict[str, int] = {}
    for suite in suites:
        for case in suite.iter("testcase"):
            counts["tests"] += 1
            name = f"{case.get('classname')}::{case.get('name')}"
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            skip = case.find("skipped")
            if bad is not None:
                counts["failed" if bad.tag == "failure" else "errors"] += 1
                text = (bad.get("message") or "") + "\n" + (bad.text or "")
                failures.append({"test": name, "kind": bad.tag, "message": text.strip()[:1500]})
            elif skip is not None:
                counts["skipped"] += 1
                reason = (skip.get("message") or "")[:200]
                skip_reasons[reason] = skip_reasons.get(reason, 0) + 1
            else:
                counts["passed"] += 1
    return {**counts, "failures": failures[:40], "skip_reasons": skip_reasons}


_VERBOSE_LINE = re.compile(r"(?:\[gw\d+\] \[\s*\d+%\] |^)(PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)"
                           r" (\S+::\S+)|^(\S+::\S+) (PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)")


def counts_from_log(text: str) -> dict:
    """What a killed `pytest -v` run printed before it died: counts and the failed tests."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    key = {"PASSED": "passed", "FAILED": "failed", "ERROR": "errors", "SKIPPED": "skipped",
           "XFAIL": "skipped", "XPASS": "passed"}
    for line in text.splitlines():
        m = _VERBOSE_LINE.search(line.strip())
        if not m:
            continue
        outcome, name = (m.group(1), m.group(2)) if m.group(1) else (m.group(4), m.group(3))
        counts["tests"] += 1
        counts[key[outcome]] += 1
        if outcome in ("FAILED", "ERROR"):
            failures.append({"test": name, "kind": outcome.lower(),
                             "message": "see pytest.log (run killed before its junit)"})
    return {**counts, "failures": failures[:40], "counted_from": "pytest.log"}


def run_pytest(label: str, selection: list[str], ctx: Context, timeout_s: float,
               workers: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="gpu-check-junit-") as tmp:
        junit = Path(tmp) / "junit.xml"
        # -v: one line per test in pytest.log, which tells what ran when the budget kills the
        # run before its junit is written.
        cmd = [sys.executable, "-m", "pytest", *selection, "-v", "-p", "no:cacheprovider",
               f"--junitxml={junit}", f"--timeout={PER_TEST_TIMEOUT_S}", "-o", "addopts="]
        if workers > 1:
            cmd += ["-n", str(workers)]
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        started = time.monotonic()
        log_path = ctx.outdir / "pytest.log"
        with open(log_path, "a") as log:
            log.write(f"\n===== {label}: {' '.join(cmd)}\n")
            log.flush()
            log_start = log.tell()
            # A session of its own: at the budget the whole group goes (xdist's workers too,
            # which would otherwise keep their GPU memory).
            proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                rc: int | None = proc.wait(timeout=timeout_s)
            except BaseException:  # the budget, or the stage's alarm
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                rc = None
                if not isinstance(sys.exc_info()[1], subprocess.TimeoutExpired):
                    raise
        out: dict = {"command": cmd[1:], "returncode": rc,
                     "seconds": round(time.monotonic() - started, 2)}
        if rc is None:
            out["timed_out"] = f"killed after {timeout_s:.0f} s (budget); see pytest.log"
        junit_found = junit.exists()
        if junit_found:
            out |= parse_junit(junit)
        else:
            out["junit"] = "not written (pytest killed or crashed before the end)"
            with open(log_path) as log:
                log.seek(log_start)
                out |= counts_from_log(log.read())
    # pytest: 0 all passed, 1 some failed, 5 nothing collected (e.g. every test deselected).
    # Killed at the budget with no junit: no verdict (an error of the stage, not a failed
    # check); pytest.log holds what ran.
    if rc is not None or junit_found or out.get("failed") or out.get("errors"):
        out["check"] = check(f"pytest {label}", rc in (0, 5) and not out.get("failed")
                             and not out.get("errors"), returncode=rc)
    return out


def _workers(ctx: Context) -> int:
    """pytest-xdist workers: several on a GPU machine (16 cores; the Triton compiles are
    CPU-bound and the GPU is shared fine by small tests), none in the dry run."""
    if ctx.dry_run:
        return 1
    try:
        import xdist  # noqa: F401
    except ImportError:
        return 1
    return min(8, os.cpu_count() or 1)


def run(ctx: Context) -> dict:
    gpu_sel, rest_sel = (DRY_GPU_RUN, DRY_KERNEL_RUN) if ctx.dry_run else (GPU_RUN, KERNEL_RUN)
    workers = _workers(ctx)
    result: dict = {"workers": workers, "log": "pytest.log"}
    # The gpu-marked tests first: they are the point; the rest gets what is left.
    result["gpu_marked"] = run_pytest("gpu-marked", gpu_sel, ctx,
                                      max(5.0, ctx.left() * (0.9 if ctx.dry_run else 0.5)),
                                      workers)
    left = ctx.left() - 3.0
    if ctx.dry_run:
        # One pytest start costs ~15 s on a busy 2-core machine: the first invocation has
        # exercised run_pytest; on a GPU the second runs here.
        result["kernels_on_device"] = skipped("dry run: one pytest invocation is enough here")
    elif left < 15.0:
        result["kernels_on_device"] = skipped(f"stage budget: {left:.0f} s left")
    else:
        result["kernels_on_device"] = run_pytest("kernel tests on device", rest_sel, ctx, left,
                                                 workers)
    if any("timed_out" in r for r in (result["gpu_marked"], result["kernels_on_device"])):
        result["part_errors"] = [k for k in ("gpu_marked", "kernels_on_device")
                                 if "timed_out" in result[k]]
    g = result["gpu_marked"]
    result["headline"] = {"gpu_tests_passed": f"{g.get('passed', '?')}/{g.get('tests', '?')}"}
    k = result["kernels_on_device"]
    if "tests" in k:
        result["headline"]["kernel_tests_passed"] = f"{k.get('passed')}/{k.get('tests')}"
    return result
