"""redis: page payloads with and without a Mamba checkpoint written to and read from Redis,
pipelined (one round trip per `batch_pages`) vs one page per round trip; payload encode and
decode+validate throughput, with the page MAC (keyed BLAKE2b, what the services run with a
--l3-mac-key-file) and with the unkeyed checksum: their difference is the MAC's cost on the load
path."""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import redis
import torch

from pagestore.client import L3Client
from prefixcache_bench.tiers.params import Params
from compute_service.model import preset_config
from compute_service.tiers import PageLayout, decode, encode
from prefixcache_bench.harness import log
from prefixcache_bench.local_redis import RedisClusterServers, start_redis


BENCH_MAC_KEY = b"prefixcache-bench-l3-mac-key-0123"  # any 16+ bytes: the cost is the same


@contextlib.contextmanager
def redis_at(url: str | None, cluster: bool = False) -> Iterator[str]:
    """`url`, or a throwaway redis-server's (no persistence, allkeys-lru), or with `cluster` a
    throwaway 3-master Redis Cluster's (prefixcache_bench.local_redis)."""
    if url:
        yield url
        return
    if cluster:
        with tempfile.TemporaryDirectory() as tmp, \
                RedisClusterServers(Path(tmp), masters=3, maxmemory="1gb") as servers:
            yield servers.url
        return
    with tempfile.TemporaryDirectory() as tmp:
        proc, port = start_redis(
            lambda port: ["--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", tmp, "--maxmemory", "2gb",
                          "--maxmemory-policy", "allkeys-lru"],
            lambda port: redis.Redis(port=port).ping())
        try:
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            proc.kill()
            proc.wait()


def rate(pages: int, nbytes: int, seconds: float) -> dict:
    return {"pages_s": round(pages / seconds, 1), "mb_s": round(nbytes / seconds / 1e6, 1),
            "seconds": round(seconds, 4)}


def bench_redis(p: Params, client: L3Client) -> dict:
    lay = PageLayout.of_model(preset_config(p.payload_preset), p.page_size, torch.float32)
    out = {"payload_preset": p.payload_preset, "page_size": p.page_size, "dtype": "float32",
           "batch_pages": p.batch_pages, "kinds": {}}
    gen = torch.Generator().manual_seed(p.seed)
    for kind, n, ckpt in (("kv", p.throughput_pages, False),
                          ("kv+checkpoint", max(4, p.throughput_pages // 16), True)):
        kv = torch.randn(lay.kv_shape, generator=gen)
        mamba = ([(torch.randn(lay.ssm_shape, generator=gen),
                   torch.randn(lay.conv_shape, generator=gen))
                  for _ in range(lay.mamba_layers)] if ckpt and lay.mamba_layers else None)
        hashes = [os.urandom(16) for _ in range(n)]
        ctx = {h: client.key("bench", h).encode() for h in hashes}
        start = time.perf_counter()
        payloads = [encode(h, lay, kv, mamba, mac_key=BENCH_MAC_KEY, context=ctx[h])
                    for h in hashes]
        encode_s = time.perf_counter() - start
        unkeyed = [encode(h, lay, kv, mamba, context=ctx[h]) for h in hashes]
        size = len(payloads[0])
        items = list(zip(hashes, payloads, strict=True))
        batches = [items[i:i + p.batch_pages] for i in range(0, n, p.batch_pages)]
        res = {"payload_bytes": size, "pages": n, "encode": rate(n, n * size, encode_s)}
        for label, groups in (("write_one_by_one", [[it] for it in items]),
                              ("write_pipelined", batches)):
            start = time.perf_counter()
            ok = all([client.set_many("bench", group) for group in groups])
            res[label] = rate(n, n * size, time.perf_counter() - start) | {"ok": ok}
        for label, groups in (("read_one_by_one", [[h] for h in hashes]),
                              ("read_pipelined", [[h for h, _ in b] for b in batches])):
            start = time.perf_counter()
            got = [v for group in groups for v in client.get_many("bench", group)]
            res[label] = rate(n, n * size, time.perf_counter() - start) | {
                "found": sum(v is not None for v in got)}
        assert all(g == p for g, p in zip(got, payloads, strict=True))
        # Keyed and unkeyed decodes interleaved, best of three each: their ratio is the MAC's
        # cost, not the order they ran in.
        decode_s = checksum_s = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for h, payload in zip(hashes, got, strict=True):
                decode(payload, h, lay, mac_key=BENCH_MAC_KEY, context=ctx[h])
            decode_s = min(decode_s, time.perf_counter() - start)
            start = time.perf_counter()
            for h, payload in zip(hashes, unkeyed, strict=True):
                decode(payload, h, lay, context=ctx[h])
            checksum_s = min(checksum_s, time.perf_counter() - start)
        res["decode"] = rate(n, n * size, decode_s)
        res["decode_checksum"] = rate(n, n * size, checksum_s)
        # The MAC's cost on the load path: keyed over unkeyed decode, and per page against a
        # pipelined read of the same page.
        res["mac_over_checksum_decode"] = round(decode_s / checksum_s, 3)
        res["decode_us_per_page"] = round(decode_s / n * 1e6, 1)
        # The MAC alone (keyed BLAKE2b over a whole payload), against no digest at all.
        start = time.perf_counter()
        for payload in got:
            hashlib.blake2b(payload, key=BENCH_MAC_KEY, digest_size=16).digest()
        res["mac_us_per_page"] = round((time.perf_counter() - start) / n * 1e6, 1)
        res["read_pipelined_us_per_page"] = round(res["read_pipelined"]["seconds"] / n * 1e6, 1)
        out["kinds"][kind] = res
        log(f"redis {kind}: {size / 1e3:.0f} KB/page, write pipelined "
            f"{res['write_pipelined']['mb_s']} MB/s, read pipelined "
            f"{res['read_pipelined']['mb_s']} MB/s")
    return out
