"""A static render of the Grafana dashboard's main panels (deploy/k8s/components/monitoring/
dashboards/prefixcache.json) with real data: the services run in this process, a workload goes
through the gateway, their /metrics endpoints are scraped every --every-s seconds, and each
panel is computed from the scrapes with its query's formula (rates over a sliding window,
histogram_quantile's linear interpolation), then drawn with matplotlib.

    python -m prefixcache_bench.stack.dashboard_render [--duration-s 60] [--png PATH]

The stack: redis-server (L3), a cache service whose L3 is it, two workers (tiny-transformer,
their Step calls over gRPC, their L3 the same Redis), a gateway. The workload: 4 clients, each a
multi-turn conversation on a shared system prompt (each turn extends the last; in the committed
render nearly every hit is on device: the conversations fit the workers' device pages). Redis is
stopped at 70 % of the run, so the L3 health panel shows an outage (L3 up 0, the breaker open)
while requests go on. The committed render: docs/results/stack/dashboard.png (45 s).
"""
from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import threading
import time
import urllib.request
from collections import defaultdict

import grpc
import torch
from prometheus_client.parser import text_string_to_metric_families

from cache_service.core import CacheCore
from cache_service.server import CacheServer, ServerConfig as CacheConfig
from compute_service.engine import Engine, EngineConfig
from compute_service.model import ByteTokenizer, build_preset
from compute_service.server import ServerConfig, serve
from gateway.assembly import GatewayConfig, GatewayServer
from gateway.core.discovery import WorkerAddress
from gateway.core.tenants import TenantDirectory
from pagestore.client import L3Client, L3Config
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache_bench.harness import log
from prefixcache_bench.local_redis import start_redis
from prefixcache_client.cache import CacheClient

Sample = dict[tuple[str, tuple], float]


def scrape(port: int) -> Sample:
    """One endpoint's samples, each labelled with `instance` (as Prometheus does: two workers
    export the same names)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {(s.name, tuple(sorted({**s.labels, "instance": str(port)}.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}


def total(sample: Sample, name: str, **match: str) -> float:
    return sum(v for (n, labels), v in sample.items() if n == name
               and all(dict(labels).get(k) == w for k, w in match.items()))


def by_label(sample: Sample, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for (n, labels), v in sample.items():
        if n == name and label in dict(labels):
            out[dict(labels)[label]] += v
    return out


def quantile(q: float, old: Sample, new: Sample, name: str) -> float | None:
    """histogram_quantile(q, sum by (le) (increase(name_bucket[window]))), as Prometheus does."""
    buckets: dict[float, float] = defaultdict(float)  # summed over instances: sum by (le)
    for key in (k for k in new if k[0] == f"{name}_bucket"):
        buckets[float(dict(key[1])["le"])] += new[key] - old.get(key, 0.0)
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank, lower, below = q * buckets[bounds[-1]], 0.0, 0.0
    for bound in bounds:
        if buckets[bound] >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / max(buckets[bound] - below, 1e-12)
        lower, below = bound, buckets[bound]
    return lower


class Stack:
    def __init__(self, workdir: str):
        l3_at = lambda port: L3Client(L3Config(  # noqa: E731
            f"redis://127.0.0.1:{port}/0", prefix="render", timeout_s=0.2, mac_key=b"r" * 16))
        self.redis, self.redis_port = start_redis(
            lambda port: ["--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--appendonly", "no", "--dir", workdir],
            lambda port: l3_at(port).check(0.5))
        l3 = lambda: l3_at(self.redis_port)  # noqa: E731
        self.cache = CacheServer(CacheCore(remote=l3()), CacheConfig(
            host="127.0.0.1", port=0, grace_s=0, metrics_port=0)).start()
        address = f"127.0.0.1:{self.cache.port}"
        model = build_preset("tiny-transformer", seed=0)
        self.workers = []
        for name in ("w1", "w2"):
            engine = Engine(model, ByteTokenizer(), CacheClient(address, timeout_s=10),
                            EngineConfig(page_size=16, device_pages=96, host_pages=64,
                                         token_budget=512, max_running=8,
                                         model_id="tiny-transformer", pool_id=name,
                                         l3=l3(), l3_write_policy="write-through",
                                         l3_lookup=True))
            self.workers.append(serve(engine, ServerConfig(host="127.0.0.1", port=0,
                                                           grace_s=0, metrics_port=0)))
        self.gateway = GatewayServer(GatewayConfig(
            workers=lambda: [WorkerAddress(f"127.0.0.1:{w.port}", address)
                             for w in self.workers],
            host="127.0.0.1", port=0, metrics_port=0, grace_s=0.0, resolve_interval_s=0.2,
            tenants=TenantDirectory({}, allow_anonymous=True))).start()
        while not self.gateway.router.ready():
            time.sleep(0.1)

    @property
    def ports(self) -> list[int]:
        return [self.cache.metrics_port, self.gateway.metrics_port,
                *(w.metrics_port for w in self.workers)]

    def stop_redis(self) -> None:
        self.redis.kill()
        self.redis.wait()

    def close(self) -> None:
        self.gateway.drain()
        for w in self.workers:
            w.drain()
        self.cache.drain()
        if self.redis.poll() is None:
            self.stop_redis()


def conversation(stub, seed: int, stop: threading.Event) -> None:
    """Turns of one conversation on the shared system prompt; a new one every 6 turns."""
    rng = random.Random(seed)
    system = [(7 * i) % 200 + 20 for i in range(96)]
    while not stop.is_set():
        history = system + [rng.randrange(20, 250) for _ in range(8)]
        for _ in range(6):
            if stop.is_set():
                return
            history += [rng.randrange(20, 250) for _ in range(rng.randrange(8, 40))]
            req = pb.GenerateRequest(sampling=pb.SamplingParams(
                max_tokens=rng.randrange(8, 32), ignore_eos=True))
            req.token_ids.ids.extend(history[-900:])
            try:
                for msg in stub.Generate(req, timeout=60):
                    history += list(msg.token_ids)
            except grpc.RpcError:
                time.sleep(0.2)


def record(args) -> list[tuple[float, Sample]]:
    with tempfile.TemporaryDirectory(prefix="dashboard-render-") as workdir:
        stack = Stack(workdir)
        channel = grpc.insecure_channel(stack.gateway.address)
        stub = pb_grpc.ComputeServiceStub(channel)
        stop = threading.Event()
        clients = [threading.Thread(target=conversation, args=(stub, i, stop), daemon=True)
                   for i in range(4)]
        for c in clients:
            c.start()
        scrapes: list[tuple[float, Sample]] = []
        started = time.monotonic()
        outage = False
        try:
            while (now := time.monotonic() - started) < args.duration_s:
                merged: Sample = {}
                for port in stack.ports:
                    merged.update(scrape(port))
                scrapes.append((now, merged))
                if not outage and now >= 0.7 * args.duration_s:
                    log(f"  {now:.0f} s: stopping redis-server (an L3 outage)")
                    stack.stop_redis()
                    outage = True
                time.sleep(args.every_s)
        finally:
            stop.set()
            for c in clients:
                c.join(30)
            channel.close()
            stack.close()
    return scrapes


PANELS = ("Prompt tokens served from cache, by tier", "Prefill saved", "Time to first token (s)",
          "Time per output token (s)", "Routing reasons (per s)", "L3 (Redis) health",
          "Queue and KV usage")


def panels(scrapes: list[tuple[float, Sample]], window: int) -> dict[str, dict[str, list]]:
    """Panel -> series -> [(t, value)], each from the formula of the dashboard's query."""
    out: dict[str, dict[str, list]] = {title: defaultdict(list) for title in PANELS}
    for i in range(window, len(scrapes)):
        (t0, old), (t, new) = scrapes[i - window], scrapes[i]
        d = lambda n, **m: total(new, n, **m) - total(old, n, **m)  # noqa: E731
        prompt = d("prefixcache_compute_prompt_tokens_total")
        if prompt > 0:
            for medium in ("device", "host", "remote"):
                out["Prompt tokens served from cache, by tier"][medium].append(
                    (t, d("prefixcache_compute_cached_prompt_tokens_total", medium=medium) / prompt))
            out["Prefill saved"]["prefill saved"].append(
                (t, 1 - d("prefixcache_compute_computed_prompt_tokens_total") / prompt))
        for q in (0.5, 0.9, 0.99):
            for panel, name in (("Time to first token (s)", "vllm:time_to_first_token_seconds"),
                                ("Time per output token (s)", "prefixcache_compute_tpot_seconds")):
                v = quantile(q, old, new, name)
                if v is not None:
                    out[panel][f"p{int(q * 100)}"].append((t, v))
        span = t - t0
        reasons = by_label(new, "prefixcache_gateway_routing_decisions_total", "reason")
        before = by_label(old, "prefixcache_gateway_routing_decisions_total", "reason")
        for reason, n in reasons.items():
            out["Routing reasons (per s)"][reason[:40]].append((t, (n - before.get(reason, 0)) / span))
        health = out["L3 (Redis) health"]
        ups = [v for (n, _), v in new.items() if n == "prefixcache_compute_l3_up"]
        health["workers: L3 up (min)"].append((t, min(ups) if ups else 0))
        health["cache service: L3 up"].append((t, total(new, "prefixcache_cache_l3_up")))
        breakers = [v for (n, _), v in new.items() if n == "prefixcache_compute_l3_breaker_open"]
        health["breaker (max; 2 = open)"].append((t, max(breakers) if breakers else 0))
        queue = out["Queue and KV usage"]
        queue["waiting"].append((t, total(new, "vllm:num_requests_waiting")))
        queue["running"].append((t, total(new, "vllm:num_requests_running")))
        kv = [v for (n, _), v in new.items() if n == "vllm:kv_cache_usage_perc"]
        queue["KV usage (max)"].append((t, max(kv) if kv else 0))
    return out


def draw(series: dict[str, dict[str, list]], path: str, duration_s: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 2, figsize=(14, 14))
    for ax, (title, lines) in zip(axes.flat, series.items()):
        for label, points in lines.items():
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=label)
        ax.axvline(0.7 * duration_s, color="grey", linestyle=":", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("s")
        ax.legend(fontsize=7, loc="best")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(series):]:
        ax.axis("off")
    fig.suptitle("prefixcache dashboard, rendered from live scrapes (dotted: Redis stopped)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixcache_bench.stack.dashboard_render",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration-s", type=float, default=60.0)
    ap.add_argument("--every-s", type=float, default=1.0, help="scrape interval")
    ap.add_argument("--window", type=int, default=5, help="scrapes per rate window")
    ap.add_argument("--png", default="docs/results/stack/dashboard.png")
    args = ap.parse_args(argv)
    if shutil.which("redis-server") is None:
        ap.error("redis-server is not installed (scripts/setup.sh installs it)")
    torch.set_num_threads(1)
    log(f"[dashboard render] {args.duration_s:.0f} s of conversations through the gateway")
    scrapes = record(args)
    draw(panels(scrapes, args.window), args.png, args.duration_s)
    log(f"wrote {args.png} ({len(scrapes)} scrapes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
