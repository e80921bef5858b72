"""No failure of the launcher (`python -m stack`) leaves a process behind: a bad --model fails
before anything starts, and SIGTERM or SIGINT while the services are starting stops every child
already started. The children are found by their working directory (they inherit the
launcher's, a fresh tmp_path), since they run in their own sessions."""
from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def processes_in(directory: pathlib.Path) -> list[int]:
    """Pids whose working directory is `directory` (Linux /proc)."""
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if pathlib.Path(os.readlink(entry / "cwd")) == directory:
                    found.append(int(entry.name))
            except OSError:
                continue  # gone, or not ours to read
    return found


def wait_gone(directory: pathlib.Path, timeout_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while (left := processes_in(directory)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


pytestmark = pytest.mark.skipif(not pathlib.Path("/proc/self/cwd").exists(), reason="needs /proc")


def launcher(tmp_path, *args: str, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "stack", *args], cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_bad_model_fails_before_any_service_starts(tmp_path):
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    proc = launcher(tmp_path, "--model", "acme/no-such-model", HF_HUB_CACHE=str(cache),
                    HF_HUB_OFFLINE="1")
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, out + err
    assert "acme/no-such-model" in err and str(cache) in err, err
    assert "cache service" not in out  # nothing was started
    assert wait_gone(tmp_path) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_mid_start_leaves_no_process_behind(tmp_path, sig):
    proc = launcher(tmp_path, "--model", "tiny-hybrid")
    seen = []
    for line in proc.stdout:  # until the cache service is up: Redis too, workers starting
        seen.append(line)
        if line.startswith("cache service"):
            break
    assert seen and seen[-1].startswith("cache service"), "".join(seen) + proc.stderr.read()
    time.sleep(1.0)  # a worker is being started now
    assert len(processes_in(tmp_path)) >= 2  # the launcher and its children
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert "interrupted: stopping the stack" in out, out + err
    assert wait_gone(tmp_path) == [], "".join(seen) + out + err
