"""Issue 25, finding 2: a worker identity with a wildcard pool pattern (the manifests'
`compute-*`) registered 16 pools at the per-pool cap in 5-7 s, taking the cache service from
77 to 685 MB, and 271 MB stayed after it unregistered them. Now an identity owns at most
--max-pools-per-identity pools, all pools together hold at most --max-total-pages pages, and an
unregistered pool's memory goes back to the operating system.

Measured on a real `python -m cache_service` subprocess (its RSS from /proc), pools kept modest
so the suite stays fast."""
from __future__ import annotations

import contextlib
import json
import pathlib
import time
from collections.abc import Iterator

import grpc
import pytest

from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache.v1 import cache_service_pb2_grpc as pb_grpc
from service_shell.service_token import with_service_token
from tests.cache_service.grpc_harness import ServerProcess, server_process
from tests.security.harness import PAGE, refused

TOKENS = {"compute": "compute-token-0123456789abcdef", "other": "other-token-0123456789abcdef",
          "operator": "operator-token-0123456789abcdef"}
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
FLOOD = 16


def _identities(directory: pathlib.Path) -> pathlib.Path:
    path = directory / "identities.json"
    path.write_text(json.dumps({"identities": [
        {"name": "compute", "role": "worker", "token": TOKENS["compute"], "pools": ["compute-*"]},
        {"name": "other", "role": "worker", "token": TOKENS["other"], "pools": ["other-*"]},
        {"name": "ops", "role": "operator", "token": TOKENS["operator"]}]}))
    return path


@contextlib.contextmanager
def _cache(tmp_path, *flags: str) -> Iterator[ServerProcess]:
    with server_process(0, "--service-identities-file", str(_identities(tmp_path)),
                        *flags) as proc:
        yield proc


@contextlib.contextmanager
def _stub(proc: ServerProcess, who: str) -> Iterator[pb_grpc.CacheServiceStub]:
    with grpc.insecure_channel(proc.target) as channel:
        yield pb_grpc.CacheServiceStub(with_service_token(channel, TOKENS[who]))


def _register(stub, pool_id: str, pages: int, host: int = 0, mamba: int = 0, epoch: int = 1):
    return stub.RegisterPool(pb.RegisterPoolRequest(
        pool_id=pool_id, epoch=epoch, page_size=PAGE, model_id="m", device_pages=pages,
        host_pages=host, mamba_slots=mamba), timeout=60)


def _rss_mb(proc: ServerProcess) -> float:
    with open(f"/proc/{proc.proc.pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _flood(stub, prefix: str, pages: int, **sizes) -> tuple[list[str], list[str]]:
    """FLOOD RegisterPools; the pool ids that got in, and the refusals' messages."""
    ok, messages = [], []
    for i in range(FLOOD):
        pool_id = f"{prefix}-{i}"
        try:
            _register(stub, pool_id, pages, **sizes)
            ok.append(pool_id)
        except grpc.RpcError:
            messages.append(refused(lambda: _register(stub, pool_id, pages, **sizes), EXHAUSTED))
    return ok, messages


def test_attack_wildcard_identity_registers_pools_past_its_count(tmp_path):
    pages = 1 << 16
    with _cache(tmp_path, "--max-pool-pages", str(pages), "--max-total-pages", str(1 << 30)) \
            as proc, _stub(proc, "compute") as compute, _stub(proc, "other") as other:
        ok, messages = _flood(compute, "compute", pages)
        assert len(ok) == 4 and len(messages) == FLOOD - 4  # the default, 4
        assert all("--max-pools-per-identity 4" in m for m in messages), messages[0]
        assert "identity 'compute' owns 4 pools" in messages[0]
        # Re-registering an owned pool (a worker restart) is not a new pool.
        _register(compute, ok[0], pages, epoch=2)
        # Another identity has its own count; after an unregister there is room again.
        _register(other, "other-0", pages)
        compute.UnregisterPool(pb.UnregisterPoolRequest(pool_id=ok[0]), timeout=10)
        _register(compute, "compute-again", pages)


def test_attack_pools_past_the_total_pages(tmp_path):
    pages = 1 << 16
    # Default --max-total-pages: 4 x --max-pool-pages. Pools at the cap in all three sizes (3 x
    # pages each): one fits, the next refused whoever asks, an operator included.
    with _cache(tmp_path, "--max-pool-pages", str(pages)) as proc, \
            _stub(proc, "compute") as compute, _stub(proc, "operator") as ops:
        ok, messages = _flood(compute, "compute", pages, host=pages, mamba=pages)
        assert len(ok) == 1
        assert all(f"--max-total-pages {4 * pages}" in m for m in messages), messages[0]
        message = refused(lambda: _register(ops, "ops-pool", pages, host=pages, mamba=pages),
                          EXHAUSTED)
        assert "--max-total-pages" in message
        _register(ops, "ops-pool", pages)  # what is left of the budget, exactly
        refused(lambda: _register(ops, "ops-pool-2", 1), EXHAUSTED)
        # A re-registration counts its new size in place of its old one.
        _register(compute, ok[0], 1, epoch=2)
        _register(ops, "ops-pool-2", pages, host=pages, mamba=pages - 1)


@pytest.mark.parametrize("sizes", ["device", "all"])
def test_memory_comes_back_after_unregister(tmp_path, sizes):
    """Pools at the per-pool cap (raised limits, so the flood gets in), then unregistered:
    the process returns to near its start."""
    pages = 1 << 20
    extra = {} if sizes == "device" else {"host": pages, "mamba": pages}
    with _cache(tmp_path, "--max-pool-pages", str(pages), "--max-total-pages", str(1 << 32),
                "--max-pools-per-identity", str(FLOOD)) as proc, _stub(proc, "compute") as stub:
        _register(stub, "compute-warm", 1)  # the code paths' own first-use memory
        stub.UnregisterPool(pb.UnregisterPoolRequest(pool_id="compute-warm"), timeout=10)
        start = _rss_mb(proc)
        ok, _ = _flood(stub, "compute", pages, **extra)
        assert len(ok) == FLOOD
        flooded = _rss_mb(proc)
        for pool_id in ok:
            stub.UnregisterPool(pb.UnregisterPoolRequest(pool_id=pool_id), timeout=60)
        time.sleep(0.2)
        after = _rss_mb(proc)
        print(f"RSS MB ({sizes}): start {start:.0f}, flooded {flooded:.0f}, after {after:.0f}")
        assert flooded - start > 40  # the flood did cost memory
        assert after - start < 8, (start, flooded, after)
