"""The README's main job: the whole stack, the demo workload, the summary, a clean shutdown."""
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE_SIZE = 16  # the stack's workers


def rows(out: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in out.splitlines()
            if line.startswith(("chat", "burst", "alice", "bob", "base", "lora"))}


def test_the_stack_runs_the_demo_and_stops_cleanly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-m", "stack"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "all services stopped cleanly" in res.stdout
    r = rows(res.stdout)
    # columns: request tenant prompt device host L3 shared computed ttft worker why...
    device, remote, computed, worker = 3, 5, 7, 9
    assert int(r["chat0-turn1"][device]) > 0  # the next turn reuses the conversation
    # The burst's new prompt is computed once per worker that got part of it: every other sample
    # either waited for its sibling's publishes (shared) or arrived after them (device hit), so
    # it computes only its last partial page. (Which of the two happens depends on timing.)
    burst = [v for k, v in r.items() if k.startswith("burst")]
    computing = [v for v in burst if int(v[computed]) >= PAGE_SIZE]
    assert len(burst) == 6 and len(computing) == len({v[worker] for v in burst}), burst
    assert r["bob-sunday"][device] == "0"  # another tenant never shares a page
    assert r["lora-hours"][device] == "0"  # an adapter never shares the base model's pages
    assert int(r["lora-hours-2"][device]) > 0
    assert all(int(r[f"chat{i}-turn3"][remote]) > 0 for i in range(3))  # L3 after a drain
    assert "hit ratio" in res.stdout
