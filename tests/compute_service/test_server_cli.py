"""`python -m compute_service`: flags, SIGTERM and drain, two workers sharing one Redis."""
from __future__ import annotations

import os
import signal
import urllib.request

import pytest

from compute_service.__main__ import parse_args
from prefixcache_client.compute import ComputeClient
from stack.launcher import free_port
from tests.cache_service.grpc_harness import running_server
from tests.compute_service.server_harness import (PAGE, SERVING, ABORT, greedy, wait_until, health,
                                                  compute_process)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- python -m compute_service -------------------------------------------------------------------

def test_cli_serves_until_sigterm_then_drains_and_exits_0():
    with compute_process("--model", "tiny-hybrid", "--cache-service", "embedded",
                         "--page-size", str(PAGE), "--device-pages", "64",
                         "--grace-s", "0") as (proc, target, read_log):
        wait_until(lambda: health(target, "readiness") == SERVING, timeout_s=60)
        with ComputeClient(target) as client:
            info = client.model_info()
            assert info.model_id == "tiny-hybrid-seed0" and info.architecture == "bamba"
            assert info.worker.endswith(f"-{target.rsplit(':', 1)[1]}")  # HOSTNAME-PORT
            first = client.generate("a prompt long enough for pages", greedy(4)).result()
            second = client.generate("a prompt long enough for pages", greedy(4)).result()
            assert second.stats.cached_tokens_device > 0 and second.token_ids == first.token_ids
            running = client.generate([1, 2, 3], greedy(200))
            next(running)
            proc.send_signal(signal.SIGTERM)
            assert running.result().stats.finish_reason == ABORT
        assert proc.wait(timeout=30) == 0, read_log()
        log = read_log()
        for event in ("event=worker_ready", "event=signal_received", "event=drain_started",
                      "event=request_finished", "event=server_stopped"):
            assert event in log, event


# ---- python -m compute_service: flags ------------------------------------------------------------

def test_l3_and_lora_flags_defaults_and_env(monkeypatch):
    for var in [v for v in os.environ if v.startswith("PREFIXCACHE_")]:
        monkeypatch.delenv(var)
    args = parse_args(["--model", "tiny-transformer"])
    assert (args.redis_url, args.l3_write_policy, args.l3_lookup) == ("", "none", False)
    assert (args.max_loaded_adapters, args.max_lora_rank, args.max_loras) == (4, 16, 4)
    assert args.adapters == [] and args.lease_ttl_s == 0
    args = parse_args(["--model", "tiny-transformer", "--redis-url", "redis://r:6379/0"])
    assert (args.l3_write_policy, args.l3_lookup, args.l3_prefix) == ("write-through", True,
                                                                      "pc")
    args = parse_args(["--model", "tiny-transformer", "--redis-url", "redis://r:6379/0",
                       "--no-l3-lookup", "--l3-write-policy", "hot", "--l3-min-hits", "3",
                       "--adapter", "a=/x", "--adapter", "b=/y=z"])
    assert (args.l3_write_policy, args.l3_lookup, args.l3_min_hits) == ("hot", False, 3)
    assert args.adapters == [("a", "/x"), ("b", "/y=z")]
    env = {"REDIS_URL": "redis://r:6379/0", "L3_LOOKUP": "off", "L3_WRITE_POLICY": "write-back",
           "L3_TIMEOUT_S": "0.5", "L3_PREFIX": "shared", "L3_TTL_S": "60",
           "L3_WRITE_QUEUE_MB": "8", "L3_BATCH_PAGES": "4", "LEASE_TTL_S": "90",
           "MAX_LOADED_ADAPTERS": "6", "MAX_LORA_RANK": "32", "MAX_LORAS": "3",
           "ADAPTERS": "a=/x, b=/y"}
    for key, value in env.items():
        monkeypatch.setenv(f"PREFIXCACHE_{key}", value)
    args = parse_args(["--model", "tiny-transformer"])
    assert (args.l3_lookup, args.l3_write_policy, args.l3_timeout_s) == (False, "write-back", 0.5)
    assert (args.l3_prefix, args.l3_ttl_s, args.l3_write_queue_mb, args.l3_batch_pages) == (
        "shared", 60, 8, 4)  # one variable for the engine and its cache sidecar
    assert args.lease_ttl_s == 90
    assert (args.max_loaded_adapters, args.max_lora_rank, args.max_loras) == (6, 32, 3)
    assert args.adapters == [("a", "/x"), ("b", "/y")]


@pytest.mark.parametrize("argv, message", [
    (["--l3-lookup"], "need --redis-url"),
    (["--l3-write-policy", "write-through"], "need --redis-url"),
    (["--redis-url", "redis://r/0", "--l3-write-policy", "sometimes"], "invalid choice"),
    (["--redis-url", "redis://r/0", "--l3-timeout-s", "0"], "--l3-timeout-s"),
    (["--redis-url", "redis://r/0", "--l3-prefix", "a b"], "--l3-prefix"),
    (["--adapter", "noequals"], "NAME=PATH"),
    (["--adapter", "bad name=/x"], "name"),
    (["--adapter", "a=/x", "--adapter", "a=/y"], "twice"),
    (["--max-loaded-adapters", "1", "--adapter", "a=/x", "--adapter", "b=/y"],
     "--max-loaded-adapters"),
    (["--max-loras", "0"], "--max-loras"),
])
def test_bad_l3_and_lora_flags_are_usage_errors(monkeypatch, capsys, argv, message):
    for var in [v for v in os.environ if v.startswith("PREFIXCACHE_")]:
        monkeypatch.delenv(var)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "tiny-transformer", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("env, message", [
    ({"L3_KEY_PREFIX": "mine"}, "PREFIXCACHE_L3_KEY_PREFIX was renamed: set PREFIXCACHE_L3_PREFIX"),
    ({"PREFIX_CACHE": "maybe"}, "--prefix-cache: 'maybe' is not a boolean"),
    ({"L3_LOOKUP": "nope"}, "(from PREFIXCACHE_L3_LOOKUP)"),
    ({"PAGE_SIZE": "abc"}, "argument --page-size: invalid int value 'abc' (from "
                           "PREFIXCACHE_PAGE_SIZE)"),
    ({"GRACE_S": "nan"}, "(from PREFIXCACHE_GRACE_S)"),
    ({"DEVICE": "tpu"}, "argument --device: invalid choice 'tpu' (from PREFIXCACHE_DEVICE)"),
    ({"CPU_NATIVE": "sometimes"}, "(from PREFIXCACHE_CPU_NATIVE)"),
    ({"HASH_SPEC": "prefixcache-ns-v2"}, "--hash-spec 'prefixcache-ns-v2'"),
])
def test_bad_environment_values_are_usage_errors_naming_flag_and_variable(monkeypatch, capsys,
                                                                          env, message):
    for var in [v for v in os.environ if v.startswith("PREFIXCACHE_")]:
        monkeypatch.delenv(var)
    for key, value in env.items():
        monkeypatch.setenv(f"PREFIXCACHE_{key}", value)
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--model", "tiny-transformer"])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_two_workers_share_pages_through_redis(redis_server, adapter_dirs, tmp_path):
    """Two `python -m compute_service` workers, embedded cache services, one Redis: what the
    first computed under adapter "a" the second loads from L3 (and not under the base model);
    --adapter loads at start; pages carry the MAC of --l3-mac-key-file; the L3 counters reach
    the metrics endpoint."""
    mac_key = tmp_path / "l3-mac-key"
    mac_key.write_text("a-test-l3-mac-key-0123456789\n")
    flags = ["--model", "tiny-transformer", "--l3-mac-key-file", str(mac_key), "--cache-service", "embedded", "--page-size",
             str(PAGE), "--device-pages", "64", "--grace-s", "0", "--redis-url",
             redis_server.url, "--l3-prefix", "cli", "--l3-timeout-s", "1",
             "--l3-batch-pages", "4", "--max-lora-rank", "8", "--max-loaded-adapters", "2",
             "--adapter", f"a={adapter_dirs['a']}"]
    text = "a shared prompt, long enough for several pages"
    metrics_one = free_port()  # --metrics-port 0 means none
    with compute_process(*flags, "--metrics-port", str(metrics_one)) as (one, target_one,
                                                                         log_one), \
            compute_process(*flags) as (two, target_two, log_two):
        assert one.stdout.readline().strip() == f"metrics on 127.0.0.1:{metrics_one}"
        for target in (target_one, target_two):
            wait_until(lambda t=target: health(t, "readiness") == SERVING, timeout_s=90)
        with ComputeClient(target_one) as c1, ComputeClient(target_two) as c2:
            assert list(c1.model_info().adapters) == list(c2.model_info().adapters) == ["a"]
            first = c1.generate(text, greedy(4), adapter="a").result()
            assert first.stats.cached_tokens_remote == 0
            pages = first.stats.prompt_tokens // PAGE
            # Write-through is asynchronous: wait until the first worker's pages are in Redis.
            import redis
            db = redis.Redis.from_url(redis_server.url)
            wait_until(lambda: len(db.keys("cli:tiny-transformer-seed0:*")) >= pages)
            base = c2.generate(text, greedy(4)).result()
            assert base.stats.cached_tokens_remote == 0  # another namespace, other keys
            second = c2.generate(text, greedy(4), adapter="a").result()
            assert second.stats.cached_tokens_remote > 0
            assert second.stats.cached_tokens_remote + second.stats.computed_prompt_tokens == \
                second.stats.prompt_tokens
            assert second.token_ids == first.token_ids
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{metrics_one}/metrics",
                                         timeout=5).read().decode()
        assert "prefixcache_compute_l3_write_pages_ok_total" in scraped
        assert "prefixcache_compute_l3_up 1.0" in scraped
        assert 'prefixcache_compute_l3_rejected_total{reason="bad_mac"} 0.0' in scraped
        assert "prefixcache_compute_adapters_loaded 1.0" in scraped
        for proc in (one, two):
            proc.send_signal(signal.SIGTERM)
        assert one.wait(timeout=30) == 0, log_one()
        assert two.wait(timeout=30) == 0, log_two()
        assert "event=adapter_loaded" in log_one()
        assert "event=l3_unauthenticated" not in log_one() + log_two()


def test_cli_remote_cache_service_without_l3_refuses_lookup():
    """The lookup is the cache service's: a worker asking for it from a cache service without
    Redis exits 1 and says how to fix it."""
    with running_server() as cache_server:
        with compute_process("--model", "tiny-transformer", "--cache-service",
                             f"127.0.0.1:{cache_server.port}", "--page-size", str(PAGE),
                             "--device-pages", "16", "--redis-url",
                             "redis://127.0.0.1:1/0") as (proc, _, read_log):
            assert proc.wait(timeout=60) == 1
            log = read_log()
            assert "event=startup_failed" in log and "--no-l3-lookup" in log, log[-3000:]
