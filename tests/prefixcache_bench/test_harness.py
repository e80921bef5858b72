"""prefixcache_bench.harness: the one definition of every benchmark's percentiles, goals, tables,
JSON and machine description."""
from __future__ import annotations

import json
import os

import pytest

from prefixcache_bench import harness
from prefixcache_bench.harness import (Goal, Progress, check_goals, choose_threads, columns_table,
                                       fmt, machine_info, metric_table, percentile, summarize,
                                       write_json)


def test_percentile_is_nearest_rank():
    samples = [float(x) for x in range(1, 101)]
    assert percentile(samples, 0.5) == 50
    assert percentile(samples, 0.99) == 99
    assert percentile(samples, 0.999) == 100
    # Always a measured value, never an interpolation: the median of 1..4 is 2, not 2.5.
    assert percentile([4.0, 1.0, 3.0, 2.0], 0.5) == 2.0
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0


def test_percentile_edges():
    samples = [5.0, 1.0, 9.0]
    assert percentile(samples, 0.0) == 1.0
    assert percentile(samples, 1.0) == 9.0
    assert percentile([3.0], 0.0) == percentile([3.0], 0.99) == percentile([3.0], 1.0) == 3.0
    with pytest.raises(ValueError, match="empty"):
        percentile([], 0.5)
    with pytest.raises(ValueError, match="outside"):
        percentile(samples, 1.5)
    with pytest.raises(ValueError, match="outside"):
        percentile(samples, -0.1)


def test_summarize_scales_and_rounds():
    samples = [0.001, 0.002, 0.003, 0.004]  # seconds
    assert summarize("x_ms", samples, 1e3) == {"x_ms_p50": 2.0, "x_ms_p99": 4.0, "x_ms_mean": 2.5}
    assert summarize("y", [1 / 3], digits=2) == {"y_p50": 0.33, "y_p99": 0.33, "y_mean": 0.33}
    with pytest.raises(ValueError):
        summarize("z", [])


def test_goal_operators_text_and_missing_values():
    assert Goal("<=", 200).met(200) and not Goal("<=", 200).met(200.5)
    assert Goal(">=", 5).met(5) and not Goal(">=", 5).met(4)
    assert Goal("==", 0).met(0) and not Goal("==", 0).met(1)
    assert Goal("<", 1).met(0.5) and not Goal("<", 1).met(1)
    assert Goal(">", 1).met(2) and not Goal(">", 1).met(1)
    assert not Goal("<=", 200).met(None)  # not measured is not met
    assert str(Goal("<=", 200)) == "<= 200" and str(Goal(">=", 50_000.0)) == ">= 50000"
    assert str(Goal(">=", 0.97)) == ">= 0.97"
    with pytest.raises(ValueError):
        Goal("~", 1)


def test_check_goals_skips_metrics_not_measured():
    goals = {"a": Goal("<=", 2), "b": Goal("==", 0), "c": Goal(">=", 1)}
    assert check_goals({"a": 3, "b": 0, "other": 1}, goals) == {
        "a": {"goal": "<= 2", "pass": False}, "b": {"goal": "== 0", "pass": True}}
    assert check_goals({"c": None}, goals) == {"c": {"goal": ">= 1", "pass": False}}


def test_fmt():
    assert fmt(None) == "null" and fmt(True) == "True"
    assert fmt(1234567) == "1,234,567"
    assert fmt(0.123456) == "0.1235" and fmt(12345.6) == "12,346"
    assert fmt("text") == "text"


def test_metric_table_puts_goal_rows_first_with_pass_or_fail():
    metrics = {"x": 1, "speed": 10.0, "lost": 0, "nested": {"a": 1}, "listed": [1, 2], "y": "s"}
    goals = check_goals(metrics, {"lost": Goal("==", 0), "speed": Goal(">=", 20)})
    lines = metric_table(metrics, goals, title="bench").splitlines()
    assert lines[0] == "== bench"
    assert lines[1].split() == ["metric", "value", "goal", "result"]
    assert set(lines[2]) == {"-"}
    rows = [line.split() for line in lines[3:]]
    assert [r[0] for r in rows] == ["lost", "speed", "x", "y"]  # goals first, in goal order
    assert rows[0] == ["lost", "0", "==", "0", "PASS"]
    assert rows[1] == ["speed", "10", ">=", "20", "FAIL"]
    assert rows[2] == ["x", "1"] and rows[3] == ["y", "s"]  # no goal: no result
    assert metric_table({}) == "(no metrics)"


def test_columns_table_aligns_the_first_column_left_and_the_others_right():
    text = columns_table(["name", "n", "ratio"], [["a", 1234, "0.5"], ["longer", 5, 0.25]])
    lines = text.splitlines()
    assert lines[0] == "name        n  ratio"
    assert lines[1] == "-" * len(lines[0])
    assert lines[2] == "a       1,234    0.5"
    assert lines[3] == "longer      5   0.25"


def test_write_json_round_trips(tmp_path):
    results = {"a": 1, "b": [1.5, None], "c": {"d": "e"}, "ok": True}
    path = write_json(tmp_path / "deep" / "out.json", results)
    assert path == tmp_path / "deep" / "out.json"
    assert json.loads(path.read_text()) == results
    assert path.read_text().endswith("\n")


def test_choose_threads(monkeypatch):
    assert choose_threads(3, default=8) == (3, "--threads")
    cpus = harness.usable_cpus()
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert choose_threads(None, default=4) == (4, "auto: torch's default")
    monkeypatch.setattr(os, "getloadavg", lambda: (float(cpus), 0.0, 0.0))
    threads, why = choose_threads(None, default=4)
    assert threads == 1 and why.startswith("auto: 1-min load average")
    # A GPU run keeps the default however busy the CPUs are; so does a default of one thread.
    assert choose_threads(None, default=4, busy_applies=False) == (4, "auto: torch's default")
    assert choose_threads(None, default=1)[0] == 1


def test_machine_info_names_the_commit_and_takes_extra_facts():
    info = machine_info(extra={"torch": "x.y", "python": "overridden"}, watched=("cache_service",))
    assert len(info["git_commit"]) == 40
    assert isinstance(info["git_modified"], list)
    assert info["torch"] == "x.y" and info["python"] == "overridden"  # extra wins
    assert info["cpu_count"] >= 1 and info["cpu_affinity"] >= 1
    assert len(info["load_avg_start"]) == 3
    assert 0 < info["python_loop_s"] < 60  # the machine's speed: seconds of a fixed loop
    assert "git_modified" not in machine_info()  # nothing watched, nothing listed


def test_progress_is_rate_limited_and_shows_the_end():
    lines: list[str] = []
    progress = Progress("part", 10, every_s=3600, out=lines.append)
    for done in range(1, 10):
        progress.update(done)
    assert lines == []
    progress.update(10, "errors 0")
    progress.update(11)  # past the total: the end was shown once
    assert len(lines) == 1 and lines[0].startswith("  part: 10/10 (") and lines[0].endswith(
        "/s) errors 0")
