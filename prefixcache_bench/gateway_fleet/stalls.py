"""What tasks outside the bench took of its cores: the stalls no setting of the gateway shortens.

The timed routing thread (run.py) notes, around each decision, how long it waited on its core's
run queue (Linux's /proc/thread-self/schedstat). The gateway's own ingest cannot make it wait:
the feed loop and the feed process run SCHED_IDLE in the bench, and a waking request preempts
them (waits of 0-17 us measured). A wait past `STALL_S` is another task holding the core.

On this VM that task is mostly the platform's DAMON thread, kdamond.0: it ran in 7 of the 10
stalls of the ingest phases and 36 of the 64 idle ones in docs/results/gateway/fleet/stalls/
(the routing thread reads the DAMON threads' CPU time around each decision too: `Kdamond`).
Its bursts are 1-3.5 ms, about one a second, on either core. The guest kernel is built
PREEMPT_NONE, so a kernel thread keeps the core until it yields, from a waking thread of any
priority. A burst on the gateway's core delays the decision due in it and the ones due after
it until it ends: one burst of ~3 ms moves a phase's p99 from the due time past 1 ms on its
own. The other stalls' tasks are not identified.

So each phase also reports its decisions that waited behind such a task (and of those, the ones
in which a DAMON thread ran for at least half the wait), and its p99 from the due time over the
decisions not caught in one (`p99_from_due_outside_stalls_us`); the run, the tasks outside it
that ran longest (`other_tasks`). Where /proc lacks these files, the figures are left out."""
from __future__ import annotations

import os

# A decision's wait on its core's run queue past this: another task held the core.
STALL_S = 250e-6


def runqueue_wait_s() -> float | None:
    """The calling thread's seconds on a run queue so far, waiting for a core (None: unknown)."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class Kdamond:
    """The DAMON threads (kdamond.N) running when made, and their CPU time so far."""

    def __init__(self) -> None:
        pids = [pid for pid in filter(str.isdigit, _listdir("/proc"))
                if _name(pid).startswith("kdamond")]
        self.paths = [f"/proc/{pid}/task/{pid}/schedstat" for pid in pids]

    def ran_s(self) -> float:
        total = 0
        for path in self.paths:
            try:
                with open(path) as f:
                    total += int(f.read().split()[0])
            except (OSError, IndexError, ValueError):
                pass  # it stopped
        return total / 1e9


def stalled_windows(waits: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """From each decision's (planned wake-up, end, run-queue wait): the spans in which another
    task held the core, as wide as the decision's span (where in it the wait fell is not known)."""
    return [(wake, end) for wake, end, wait in waits if wait >= STALL_S]


def outside_stalls(decisions: list[tuple[float, float]],
                   windows: list[tuple[float, float]]) -> list[int]:
    """The indices of the decisions, each (due time, end), whose span meets no stall window:
    neither caught in one nor due during one and waiting for it to end."""
    return [i for i, (due, end) in enumerate(decisions)
            if not any(due < hi and lo < end for lo, hi in windows)]


def task_cpu() -> dict[str, tuple[str, int, int, int]]:
    """Every task now: "pid/tid" -> (name, parent pid, CPU ns so far, times run)."""
    tasks = {}
    for pid in filter(str.isdigit, _listdir("/proc")):
        ppid = _parent(pid)
        for tid in _listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    ran_ns, _, runs = (int(x) for x in f.read().split()[:3])
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
            except (OSError, ValueError):
                continue  # it ended meanwhile
            tasks[f"{pid}/{tid}"] = (name, ppid, ran_ns, runs)
    return tasks


def other_tasks(before: dict, after: dict, top: int = 3) -> list[dict]:
    """The tasks outside this process and its children that ran longest between two `task_cpu`
    snapshots: name, CPU ms, times run, and the mean run (a burst's length)."""
    mine = {os.getpid()}
    mine |= {int(k.split("/")[0]) for k, (_, ppid, _, _) in after.items() if ppid in mine}
    ran = []
    for key, (name, _, ns, runs) in after.items():
        if int(key.split("/")[0]) in mine:
            continue
        _, _, ns0, runs0 = before.get(key, (name, 0, 0, 0))
        if ns > ns0:
            ran.append((ns - ns0, runs - runs0, name))
    ran.sort(reverse=True)
    return [{"task": name, "cpu_ms": round(ns / 1e6, 1), "runs": runs,
             "mean_run_ms": round(ns / 1e6 / max(runs, 1), 2)} for ns, runs, name in ran[:top]]


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _name(pid: str) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def _parent(pid: str) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def stalls_note(results: dict) -> str | None:
    """A line for a run whose decisions during ingest waited behind other tasks (flattened
    figures, __main__.py): how many, how long, the p99 from due without them, and who ran."""
    stalled = results.get("routing_stalled_decisions_during_ingest")
    if not stalled:
        return None
    outside = results.get("routing_p99_from_due_outside_stalls_during_ingest_us")
    ran = ", ".join(f"{t['task']} {t['cpu_ms']} ms in {t['runs']} runs"
                    for t in results.get("other_tasks", []))
    damon = results.get("routing_stalled_decisions_kdamond_ran_during_ingest", 0)
    return (f"note: {stalled} decision(s) during ingest waited up to "
            f"{results['routing_runqueue_wait_max_during_ingest_us'] / 1e3:.1f} ms behind another "
            f"task on the gateway's core (kdamond ran in {damon}); "
            f"p99 from due outside those stalls: "
            + (f"{outside:,.0f} us" if outside is not None else "none left")
            + f" (the run's busiest other tasks: {ran or 'none'})")
