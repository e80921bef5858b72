"""Pools sized from memory budgets (compute_service.sizing): exact page and slot counts for the
tiny presets, the flags' conflicts and limits, the tensors the engine really allocates, the pool
the cache service registers, GetModelInfo, the worker's KV gauges, and the CLI's log line."""
from __future__ import annotations

import re
import urllib.request

import pytest
import torch

from cache_service.core import CacheCore
from compute_service.__main__ import engine_config, load, parse_args
from compute_service.engine import Engine
from compute_service.model import preset_config
from compute_service.sizing import (SizingError, SizingRequest, check_flags, kv_bytes_per_page,
                                    mamba_bytes_per_slot, parse_bytes, size_pools)
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import common_pb2
from prefixcache_client.compute import ComputeClient
from tests.compute_service.server_harness import (SERVING, compute_process, greedy, health,
                                                  running, wait_until)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MiB = 1 << 20
F32 = torch.float32


def sized(model: str, **req) -> object:
    fields = dict(page_size=16, max_context=1024, max_running=4)
    fields.update(req)
    return size_pools(SizingRequest(**fields), preset_config(model), F32)


# ---- what one page and one slot cost ---------------------------------------------------------

def test_bytes_per_page_and_slot_follow_the_model_config():
    mc = preset_config("tiny-hybrid")
    # layers x (K, V) x page size x kv heads x head dim x fp32
    assert kv_bytes_per_page(mc, 16, F32) == 2 * 2 * 16 * mc.num_kv_heads * mc.head_dim * 4 \
        == 16384
    assert kv_bytes_per_page(mc, 16, torch.bfloat16) == 8192
    assert kv_bytes_per_page(preset_config("tiny-transformer"), 16, F32) == 32768
    # Mamba layers x (SSM heads x head dim x state, fp32 + conv dim x (kernel - 1), dtype)
    ssm = mc.mamba_num_heads * mc.mamba_head_dim * mc.mamba_state_size * 4
    conv = mc.mamba_conv_dim * (mc.mamba_conv_kernel - 1) * 4
    assert mamba_bytes_per_slot(mc, F32) == 2 * (ssm + conv) == 73216
    assert mamba_bytes_per_slot(preset_config("tiny-transformer"), F32) == 0


# ---- exact counts from a byte budget ---------------------------------------------------------

def test_attention_model_pages_are_the_budget_in_whole_pages():
    s = sized("tiny-transformer", kv_memory_bytes=8 * MiB, max_context=4096,
              host_memory_bytes=MiB)
    assert (s.device_pages, s.host_pages, s.checkpoint_slots, s.running_slots) == (256, 32, 0, 0)
    assert s.device_bytes == 8 * MiB and s.host_bytes == MiB and s.source == "bytes"
    # One byte less does not fit 256 pages, which one 4096-token request needs.
    with pytest.raises(SizingError, match=r"--kv-memory-bytes.*255 KV pages.*256 pages.*"
                                          r"--max-context 4096"):
        sized("tiny-transformer", kv_memory_bytes=8 * MiB - 1, max_context=4096)


def test_hybrid_budget_pays_running_slots_then_splits_checkpoints_and_pages():
    # 4 MiB - 4 running slots x 73216 = 3901440; half for checkpoints: 26 slots (1903616 B);
    # the remaining 1997824 B hold 121 pages of 16384 B.
    s = sized("tiny-hybrid", kv_memory_bytes=4 * MiB)
    assert (s.device_pages, s.checkpoint_slots, s.running_slots) == (121, 26, 4)
    assert s.device_bytes <= 4 * MiB < s.device_bytes + 16384
    # An explicit --checkpoint-slots is kept; the pages take the rest.
    s = sized("tiny-hybrid", kv_memory_bytes=4 * MiB, checkpoint_slots=10)
    assert (s.device_pages, s.checkpoint_slots) == (193, 10)
    s = sized("tiny-hybrid", kv_memory_bytes=4 * MiB, mamba_memory_share=0.25)
    assert (s.device_pages, s.checkpoint_slots) == (180, 13)
    # Without prefix caching there are no checkpoints: everything but the running slots is KV.
    s = sized("tiny-hybrid", kv_memory_bytes=4 * MiB, prefix_cache=False)
    assert (s.device_pages, s.checkpoint_slots) == (238, 0)


def test_pure_mamba_budget_is_all_slots_and_pages_stay_bookkeeping():
    s = sized("tiny-mamba2", kv_memory_bytes=4 * MiB, device_pages=None)
    # (4 MiB - 4 x 224256) // 224256 = 14 checkpoint slots; pages cost nothing.
    assert (s.checkpoint_slots, s.running_slots, s.device_pages, s.kv_bytes_per_page) == \
        (14, 4, 1024, 0)
    with pytest.raises(SizingError, match="--host-memory-bytes: this model has no attention"):
        sized("tiny-mamba2", kv_memory_bytes=4 * MiB, host_memory_bytes=MiB)
    with pytest.raises(SizingError, match="running Mamba slots"):
        sized("tiny-mamba2", kv_memory_bytes=MiB // 2)


def test_fraction_is_of_the_free_memory_after_the_load():
    req = SizingRequest(page_size=16, max_context=1024, max_running=4, kv_memory_fraction=0.5)
    s = size_pools(req, preset_config("tiny-transformer"), F32, free_bytes=16 * MiB)
    assert (s.device_pages, s.device_budget_bytes, s.source) == (256, 8 * MiB, "fraction")


def test_counts_without_a_budget_keep_working():
    s = sized("tiny-hybrid", device_pages=64, host_pages=8, checkpoint_slots=5)
    assert (s.device_pages, s.host_pages, s.checkpoint_slots, s.source) == (64, 8, 5, "pages")
    s = sized("tiny-transformer")
    assert (s.device_pages, s.host_pages, s.checkpoint_slots) == (1024, 0, 0)


@pytest.mark.parametrize("fields, device, message", [
    (dict(device_pages=8, kv_memory_bytes=MiB), "cpu", "--device-pages and --kv-memory-bytes"),
    (dict(device_pages=8, kv_memory_fraction=0.5), "cuda",
     "--device-pages and --kv-memory-fraction"),
    (dict(host_pages=8, host_memory_bytes=MiB), "cpu", "--host-pages and --host-memory-bytes"),
    (dict(kv_memory_bytes=MiB, kv_memory_fraction=0.5), "cuda", "give one device budget"),
    (dict(kv_memory_fraction=0.5), "cpu", "needs --device cuda; on CPU give --kv-memory-bytes"),
    (dict(kv_memory_fraction=1.5), "cuda", r"--kv-memory-fraction: 1.5 is not in \(0, 1\]"),
    (dict(kv_memory_bytes=0), "cpu", "--kv-memory-bytes: 0 must be > 0"),
    (dict(mamba_memory_share=1.0), "cpu", "--mamba-memory-share"),
])
def test_conflicting_or_bad_flags_are_refused_naming_them(fields, device, message):
    with pytest.raises(SizingError, match=message):
        check_flags(SizingRequest(page_size=16, max_context=1, max_running=1, **fields), device)


def test_byte_counts_take_kubernetes_suffixes():
    assert parse_bytes("16Gi") == 16 << 30 and parse_bytes("512Mi") == 512 << 20
    assert parse_bytes("2G") == 2 * 10**9 and parse_bytes("4096") == 4096
    with pytest.raises(ValueError, match="not a byte count"):
        parse_bytes("lots")


# ---- the CLI: flags, the engine's tensors, the registered pool, GetModelInfo, gauges ----------

def test_cli_flag_conflicts_are_usage_errors(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        parse_args(["--model", "tiny-transformer", "--device-pages", "8",
                    "--kv-memory-bytes", "1Mi"])
    assert "--device-pages and --kv-memory-bytes" in capsys.readouterr().err
    monkeypatch.setenv("PREFIXCACHE_DEVICE_PAGES", "8")
    with pytest.raises(SystemExit):
        parse_args(["--model", "tiny-transformer", "--kv-memory-bytes", "1Mi"])
    assert "PREFIXCACHE_DEVICE_PAGES" in capsys.readouterr().err
    monkeypatch.delenv("PREFIXCACHE_DEVICE_PAGES")
    with pytest.raises(SystemExit):
        parse_args(["--model", "tiny-transformer", "--kv-memory-fraction", "0.9",
                    "--device", "cpu"])
    assert "on CPU give --kv-memory-bytes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_args(["--model", "tiny-transformer", "--kv-memory-bytes", "much"])
    assert "--kv-memory-bytes: invalid byte count value: 'much'" in capsys.readouterr().err


def test_sized_worker_allocates_registers_and_reports_its_pools():
    args = parse_args(["--model", "tiny-hybrid", "--device", "cpu", "--page-size", "16",
                       "--max-running", "4", "--max-context", "1024", "--kv-memory-bytes", "4Mi",
                       "--host-memory-bytes", "1Mi", "--max-loaded-adapters", "0"])
    model, tokenizer, model_id, defaults = load(args)
    core = CacheCore()
    engine = Engine(model, tokenizer, core, engine_config(args, model, model_id, 1, None))
    # The tensors the engine allocated are exactly what was sized, within the budget.
    kv = sum(t.numel() * t.element_size() for pair in engine.kv for t in pair)
    states = sum(t.numel() * t.element_size() for pair in engine.states for t in pair)
    host = sum(t.numel() * t.element_size() for pair in engine.host_kv for t in pair)
    assert kv == 121 * 16384 and states == (4 + 26) * 73216 and host == 64 * 16384
    assert kv + states <= 4 * MiB
    # The cache service's pool has the sized pages and slots.
    pool = core.get_stats(cpb.GetStatsRequest()).pools[0]
    totals = {m.medium: m.total_pages for m in pool.media}
    assert totals[common_pb2.MEDIUM_DEVICE] == 121 and totals[common_pb2.MEDIUM_HOST] == 64
    assert pool.mamba_slots_total == 26
    with running(engine, defaults, metrics_port=0) as (server, client):
        info = client.model_info()
        assert (info.device_pages, info.host_pages, info.mamba_slots) == (121, 64, 26)
        assert (info.kv_bytes_per_page, info.mamba_bytes_per_slot) == (16384, 73216)
        assert info.kv_device_bytes == kv + states
        # The gauges an autoscaler reads: a request holding pages shows in the usage ratio.
        stream = client.generate(list(range(40)), greedy(400))
        next(stream)
        text = _scrape(server.metrics_port)
        assert _gauge(text, "prefixcache_compute_kv_device_pages") == 121
        used = _gauge(text, "prefixcache_compute_kv_device_pages_used")
        assert used >= 3  # 40 prompt tokens and the first output token: at least 3 pages of 16
        assert _gauge(text, "prefixcache_compute_kv_device_usage_ratio") == \
            pytest.approx(used / 121)
        assert _gauge(text, "prefixcache_compute_running_requests") == 1
        assert _gauge(text, "prefixcache_compute_waiting_requests") == 0
        assert _gauge(text, "prefixcache_compute_max_running_requests") == 4
        stream.cancel()
        wait_until(lambda: _gauge(_scrape(server.metrics_port),
                                  "prefixcache_compute_kv_device_pages_used") == 0)


def test_cli_logs_the_sizing_and_serves_it(tmp_path):
    with compute_process("--model", "tiny-transformer", "--page-size", "16", "--max-context",
                         "4096", "--kv-memory-bytes", "8Mi", "--host-memory-bytes", "1Mi",
                         "--grace-s", "0") as (proc, target, read_log):
        wait_until(lambda: health(target, "readiness") == SERVING, timeout_s=60)
        with ComputeClient(target) as client:
            info = client.model_info()
        assert (info.device_pages, info.host_pages, info.kv_bytes_per_page) == (256, 32, 32768)
        line = next(l for l in read_log().splitlines() if "event=kv_sizing" in l)
        for field in ("source=bytes", "device_pages=256", "host_pages=32",
                      "kv_bytes_per_page=32768", f"device_budget_bytes={8 * MiB}",
                      f"device_bytes={8 * MiB}", "max_context=4096"):
            assert field in line, (field, line)


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert m is not None, name
    return float(m.group(1))
