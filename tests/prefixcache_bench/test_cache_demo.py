"""The cache service's demo (`python -m prefixcache_bench.cache_demo`) runs end to end and prints
its summary."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_demo_runs_and_reports(tmp_path):
    res = subprocess.run([sys.executable, "-m", "prefixcache_bench.cache_demo"], cwd=tmp_path,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "hit ratio" in out and "cache service stopped cleanly" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("chat", "burst", "tenant"))}
    assert int(rows["chat0-turn1"][3]) > 0  # the second turn reuses the first
    assert int(rows["burst-1"][3]) > 0  # published mid-flight, reused at once
    assert rows["tenant-b-q"][3] == "0"  # another tenant never hits
