"""prefixcache_bench.gpu_check: the prepared GPU check. Its dry run (CPU, tiny shapes, Triton
interpreted) runs every stage's code end to end, as on a GPU; the pieces that decide the exit
status and the peaks are checked on their own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from prefixcache_bench.gpu_check import runner
from prefixcache_bench.gpu_check.device import peaks_for
from prefixcache_bench.gpu_check.stage_tests import counts_from_log, parse_junit

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_runs_every_stage(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-m", "prefixcache_bench.gpu_check", str(tmp_path),
                           "--dry-run"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stage    status" in proc.stdout  # the table
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["dry_run"] and report["exit_status"] == 0
    for name in runner.STAGES:
        stage = json.loads((tmp_path / f"stage_{name}.json").read_text())
        assert stage["status"] == "ok", (name, stage.get("error"), stage.get("part_errors"))
        assert report["stages"][name]["status"] == "ok"
    tests = report["stages"]["tests"]
    # On CPU the gpu-marked tests are collected and skip, and the junit says why.
    assert tests["gpu_marked"]["tests"] >= 1
    assert tests["gpu_marked"]["skipped"] == tests["gpu_marked"]["tests"]
    kernels = report["stages"]["kernels"]
    for part in ("decode", "extend", "mamba_scan", "mamba_state_update", "lora"):
        rows = kernels[part]
        assert isinstance(rows, list) and rows, part
        assert any(r.get("check", {}).get("ok") for r in rows), part
    assert kernels["decode"][0]["sdpa_dense"]["median_ms"] > 0
    engine = report["stages"]["engine"]
    for b, row in engine["decode"]["batches"].items():
        assert row["engine"]["steady_tok_s"], b
        assert "hf_generate" in row and "error" not in row["hf_generate"], row
    assert engine["ttft"]["cached_tokens_device"] >= engine["ttft"]["shared_tokens"] > 0
    assert engine["prefix_cache_overhead"]["check"]["ok"]
    assert engine["prefix_cache_overhead"]["decode_prefix_cache_ratio"] > 0
    assert "SmolLM2-135M" in engine["smollm2_135m_shape"]["weights"]
    sizing = report["stages"]["sizing"]
    assert sizing["sizing"]["source"] == "bytes" and sizing["sizing"]["device_pages"] > 0
    assert all(c["ok"] for c in sizing["refusals"])
    assert "torch" in report["imported_packages"]


def test_failed_check_fails_the_run(tmp_path, monkeypatch):
    ctx = runner.Context(tmp_path, True, None, deadline=1e12)
    monkeypatch.setattr(runner, "_stage_fn", lambda name: lambda ctx: {
        "rows": [runner.check("good", True), runner.check("bad", False, rel_err=1.0)]})
    monkeypatch.setattr("prefixcache_bench.gpu_check.device.free_memory", lambda device: None)
    result = runner.run_stage("kernels", ctx, 10.0)
    assert result["status"] == "failed" and result["failed_checks"] == ["bad"]

    def boom(ctx):
        raise RuntimeError("no kernel image")

    monkeypatch.setattr(runner, "_stage_fn", lambda name: boom)
    result = runner.run_stage("kernels", ctx, 10.0)
    assert result["status"] == "error" and "no kernel image" in result["error"]


def test_stage_skipped_with_reason_past_the_deadline(tmp_path):
    import time

    ctx = runner.Context(tmp_path, True, None, deadline=time.monotonic() + 1.0)
    result = runner.run_stage("engine", ctx, 100.0)
    assert result["status"] == "skipped" and "deadline" in result["reason"]


def test_peaks_by_device_name():
    assert peaks_for("NVIDIA H100 80GB HBM3")["hbm_gb_s"] == 3350.0
    assert peaks_for("NVIDIA H100 PCIe")["hbm_gb_s"] == 2000.0
    assert peaks_for("NVIDIA H100 NVL")["bf16_dense_tflop_s"] == 835.0
    assert peaks_for("NVIDIA H200")["hbm_gb_s"] == 4800.0
    assert peaks_for("Some GPU")["hbm_gb_s"] is None


def test_parse_junit(tmp_path):
    path = tmp_path / "j.xml"
    path.write_text(textwrap.dedent("""\
        <testsuites><testsuite name="pytest" tests="4">
        <testcase classname="t" name="a"/>
        <testcase classname="t" name="b"><failure message="assert 1 == 2">tb</failure></testcase>
        <testcase classname="t" name="c"><skipped message="needs a CUDA GPU"/></testcase>
        <testcase classname="t" name="d"><error message="boom"/></testcase>
        </testsuite></testsuites>"""))
    got = parse_junit(path)
    assert (got["tests"], got["passed"], got["failed"], got["errors"], got["skipped"]) == \
        (4, 1, 1, 1, 1)
    assert got["failures"][0]["test"] == "t::b" and "assert 1 == 2" in got["failures"][0]["message"]
    assert got["skip_reasons"] == {"needs a CUDA GPU": 1}


@pytest.mark.parametrize("argv", [["--stages", "nope"]])
def test_unknown_stage_is_refused(tmp_path, argv):
    assert runner.main([str(tmp_path), "--dry-run", *argv]) == 2


def test_killed_pytest_is_counted_from_its_log():
    got = counts_from_log(
        "tests/a.py::test_x[1] PASSED                    [ 10%]\n"
        "[gw0] [ 20%] PASSED tests/a.py::test_y\n"
        "[gw1] [ 30%] FAILED tests/a.py::test_z[cuda-bf16]\n"
        "tests/a.py::test_w SKIPPED (needs a CUDA GPU)   [ 40%]\n")
    assert (got["tests"], got["passed"], got["failed"], got["skipped"]) == (4, 2, 1, 1)
    assert got["failures"][0]["test"] == "tests/a.py::test_z[cuda-bf16]"
