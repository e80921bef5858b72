"""redis: page payloads with and without a Mamba checkpoint written to and read from Redis,
pipelined (one round trip per `batch_pages`) vs one page per round trip; payload encode and
decode+validate throughput."""
from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import redis
import torch

from cache_service.l3 import L3Client
from compute_service.bench_tiers.params import Params
from compute_service.model import preset_config
from compute_service.tiers import PageLayout, decode, encode
from prefixcache_bench.harness import log


@contextlib.contextmanager
def redis_at(url: str | None) -> Iterator[str]:
    """`url`, or a throwaway redis-server's (no persistence, allkeys-lru)."""
    if url:
        yield url
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", tmp, "--maxmemory", "2gb",
             "--maxmemory-policy", "allkeys-lru"], stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        try:
            deadline = time.monotonic() + 10
            while True:
                with contextlib.suppress(redis.ConnectionError):
                    if redis.Redis.from_url(url).ping():
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)
            yield url
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
        start = time.perf_counter()
        payloads = [encode(h, lay, kv, mamba) for h in hashes]
        encode_s = time.perf_counter() - start
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
        start = time.perf_counter()
        for h, payload in zip(hashes, got, strict=True):
            decode(payload, h, lay)
        res["decode"] = rate(n, n * size, time.perf_counter() - start)
        out["kinds"][kind] = res
        log(f"redis {kind}: {size / 1e3:.0f} KB/page, write pipelined "
            f"{res['write_pipelined']['mb_s']} MB/s, read pipelined "
            f"{res['read_pipelined']['mb_s']} MB/s")
    return out
