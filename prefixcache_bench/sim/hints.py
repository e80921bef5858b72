"""What OpenAI's prompt-cache hints gain on a many-tenant chat workload with a small device pool:
the real gateway router (affinity policy, its index fed by the real cache cores' events) over W
workers, each a real cache-service core (cache_service.core.CacheCore) with a small device pool.

    python -m prefixcache_bench.sim.hints --json docs/results/gateway/prompt_cache_hints.json

Workload (deterministic, seeded): `tenants` tenants, each with a system prompt of its own, hold
chats of `turns` turns (each turn: the chat so far + a new user message; the reply is the next
turn's history); between two turns of a chat come requests from other chats and one-off prompts
(`churn` per chat turn) that push the chat's pages out of the device pool. A `hinted` fraction
of the tenants send both hints (prompt_cache_key = the chat's id, prompt_cache_retention "24h").
Each request runs on its worker's core as an engine runs it (match, allocate, publish the
prompt's full pages, release) and its events go to the router's index at once (no event lag:
the comparison is of the hints, not of staleness). No queues build (each request finishes before
the next is routed), so key routing is never bounded by load here.

Modes: none (hints ignored), key (prompt_cache_key only), retention (prompt_cache_retention
only, within --retention-pages per tenant), both. Reported per mode: the prompt tokens served from
cache over all requests and over the hinted tenants' requests, and the cores' retention counters.
"""
from __future__ import annotations

import argparse
import random
import time
from dataclasses import dataclass

from cache_service.core import CacheCore
from cache_service.retention import RetentionConfig
from gateway.core.cache_keys import CacheKeyAffinity
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import AffinityPolicy, RouteRequest
from gateway.core.router import Router, Worker
from prefixcache.v1 import cache_service_pb2 as cpb, common_pb2
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_bench.harness import write_json
from prefixcache_client.hash import chain_hashes, namespace_seed

MODEL = "hints-sim"
MODES = ("none", "key", "retention", "both")
DAY = 86400.0


@dataclass(frozen=True, slots=True)
class Params:
    workers: int = 4
    device_pages: int = 1024
    page_size: int = 16
    tenants: int = 48
    hinted: float = 0.25
    chats_per_tenant: int = 2
    turns: int = 6
    system_tokens: int = 1024
    user_tokens: int = 96
    reply_tokens: int = 160
    churn: int = 6
    churn_tokens: int = 2048
    retention_pages: int = 512
    retention_max_s: float = 600.0
    retention_pool_fraction: float = 0.5
    seconds_per_request: float = 0.05
    seed: int = 0


@dataclass(slots=True)
class Request:
    tenant: int
    chat: str
    tokens: list[int]
    hinted: bool


def workload(p: Params) -> list[Request]:
    """Chats interleaved at random with one-off prompts, in arrival order."""
    rng = random.Random(p.seed)
    fresh = iter(range(1 << 20, 1 << 31))

    def text(n: int) -> list[int]:
        return [next(fresh) % 50_000 for _ in range(n)]

    chats = []
    for t in range(p.tenants):
        system = text(p.system_tokens)
        for c in range(p.chats_per_tenant):
            chats.append({"tenant": t, "id": f"chat-{t}-{c}", "history": list(system),
                          "turns": p.turns, "hinted": t < p.tenants * p.hinted})
    out: list[Request] = []
    while chats:
        chat = rng.choice(chats)
        prompt = chat["history"] + text(p.user_tokens)
        out.append(Request(chat["tenant"], chat["id"], prompt, chat["hinted"]))
        chat["history"] = prompt + text(p.reply_tokens)
        chat["turns"] -= 1
        if not chat["turns"]:
            chats.remove(chat)
        for _ in range(p.churn):
            out.append(Request(-1 - len(out), "", text(p.churn_tokens), False))
    return out


class _Fleet:
    """W real cache cores under the real router, their events fed to its index as they happen."""

    def __init__(self, p: Params, mode: str) -> None:
        self.p, self.now = p, 1000.0
        clock = lambda: self.now  # noqa: E731 - the simulated time of every part
        retention = RetentionConfig(p.retention_pages, p.retention_max_s,
                                    p.retention_pool_fraction)
        self.cores = {f"w{i}": CacheCore(clock=clock, retention=retention)
                      for i in range(p.workers)}
        self.router = Router(AffinityPolicy(), GatewayMetrics(), clock=clock,
                             cache_keys=CacheKeyAffinity(clock=clock))
        self.keys, self.retain = mode in ("key", "both"), mode in ("retention", "both")
        self.seq: dict[str, int] = {}
        self.failed_allocations = 0  # requests the pool had no pages for (not published)
        for name, core in self.cores.items():
            core.register_pool(cpb.RegisterPoolRequest(
                pool_id=name, epoch=1, page_size=p.page_size, device_pages=p.device_pages,
                model_id=MODEL))
            self.router.add(Worker(name, name, name, client=None,  # type: ignore[arg-type]
                                   info=pb.GetModelInfoResponse()))
            self.seq[name] = -1
            self._feed(name)

    def _feed(self, name: str) -> None:
        pool = self.cores[name]._pools[name]
        for b in pool.log.since(self.seq[name]):
            self.router.on_stream_item(name, cpb.SubscribeResponse(batch=b))
            self.seq[name] = b.seq

    def run(self, r: Request) -> int:
        """Routes and runs one request; the prompt tokens its worker had cached."""
        p, salt = self.p, f"tenant-{r.tenant}"
        data = b"".join(t.to_bytes(4, "little") for t in r.tokens)
        hashes = chain_hashes(namespace_seed(MODEL, "", salt), data, p.page_size)
        key = (salt, r.chat) if self.keys and r.hinted else None
        rid = f"r{self.now}"
        route = self.router.route(RouteRequest(rid, hashes, len(r.tokens), p.page_size,
                                               cache_key=key))
        name = route.worker.name
        core = self.cores[name]

        def step(**ops) -> cpb.StepResponse:
            return core.step(cpb.StepRequest(pool_id=name, epoch=1, **ops))

        retain = DAY if self.retain and r.hinted else 0.0
        m = step(matches=[cpb.MatchOp(request_id=rid, packed_token_ids=data, retain_s=retain,
                                      namespace=common_pb2.Namespace(salt=salt))]).matches[0]
        need = -(-len(r.tokens) // p.page_size) - len(m.device_pages)
        ok = step(allocations=[cpb.AllocateOp(lease_id=m.lease_id, num_pages=need)]
                  ).allocations[0].ok if need else True
        self.failed_allocations += not ok
        if ok:
            step(publishes=[cpb.PublishOp(lease_id=m.lease_id,
                                          computed_pages=len(r.tokens) // p.page_size)])
        step(releases=[cpb.ReleaseOp(lease_id=m.lease_id)])
        self.router.finish(rid)
        self._feed(name)
        self.now += p.seconds_per_request
        return m.cached_tokens

    def retention_counters(self) -> dict[str, int]:
        stats = [core.get_stats(cpb.GetStatsRequest()).pools[0] for core in self.cores.values()]
        return {"retained_requests": sum(s.retained_requests for s in stats),
                "retention_ignored": sum(s.retention_ignored for s in stats),
                "evicted_pages": sum(s.media[0].evictions for s in stats),
                "protected_pages_at_end": sum(s.retained_pages for s in stats),
                "failed_allocations": self.failed_allocations}


def run_mode(p: Params, mode: str, requests: list[Request]) -> dict:
    fleet = _Fleet(p, mode)
    total = hit = hinted_total = hinted_hit = 0
    started = time.perf_counter()
    for r in requests:
        cached = fleet.run(r)
        total, hit = total + len(r.tokens), hit + cached
        if r.hinted:
            hinted_total, hinted_hit = hinted_total + len(r.tokens), hinted_hit + cached
    return {"hit_ratio": hit / total, "hinted_hit_ratio": hinted_hit / max(hinted_total, 1),
            "requests": len(requests), "seconds": time.perf_counter() - started,
            **fleet.retention_counters()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in Params.__dataclass_fields__.values():
        ap.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default)
    ap.add_argument("--json", help="write the results here")
    args = vars(ap.parse_args(argv))
    out = args.pop("json")
    p = Params(**args)
    requests = workload(p)
    results = {"params": {k: getattr(p, k) for k in Params.__dataclass_fields__},
               "modes": {mode: run_mode(p, mode, requests) for mode in MODES}}
    base = results["modes"]["none"]
    print(f"{'mode':<10} {'hit ratio':>9} {'hinted':>7} {'x none (hinted)':>16} "
          f"{'protected':>9} {'ignored':>7}")
    for mode, r in results["modes"].items():
        gain = r["hinted_hit_ratio"] / base["hinted_hit_ratio"] if base["hinted_hit_ratio"] else 0
        r["hinted_gain_vs_none"] = gain
        print(f"{mode:<10} {r['hit_ratio']:>9.3f} {r['hinted_hit_ratio']:>7.3f} {gain:>16.2f} "
              f"{r['retained_requests']:>9} {r['retention_ignored']:>7}")
    if out:
        write_json(out, results)


if __name__ == "__main__":
    main()
