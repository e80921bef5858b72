"""The cache service's demo: a real server process, an engine-shaped workload, a readable summary.

    python -m prefixcache_bench.cache_demo [--keep-running]

Starts `python -m cache_service` on a free port (log in runs/<time>/cache_service.log), waits for
its health check, registers a worker pool, follows its KV event stream the way a gateway does,
and drives the requests an engine would send through the batched Step call: multi-turn
conversations, a burst of requests sharing a system prompt, and two tenants sending the same
prompt (which must not share cache). No model runs here: this shows what the cache service
decides, page by page.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from prefixcache.v1 import cache_service_pb2 as pb, common_pb2
from prefixcache_client.cache import CacheClient
from service_shell import sleep_until_interrupted

PAGE = 16
POOL = "worker-0"
MODEL = "demo-model"


@dataclass(slots=True)
class Row:
    name: str
    tenant: str
    prompt: int
    device_hit: int
    host_hit: int

    @property
    def computed(self) -> int:
        return self.prompt - self.device_hit - self.host_hit


class EventIndex(threading.Thread):
    """What a gateway keeps: page hash -> media, rebuilt from the event stream alone."""

    def __init__(self, client: CacheClient):
        super().__init__(daemon=True)
        self.sub = client.subscribe(POOL, heartbeat_interval_s=0.2)
        self.pages: dict[bytes, set[int]] = {}
        self.events = 0
        self.head = -1

    def run(self) -> None:
        for item in self.sub:
            if item.HasField("heartbeat"):
                continue
            for ev in item.batch.events:
                kind = ev.WhichOneof("event")
                if kind == "cleared":
                    self.pages.clear()
                elif kind == "stored":
                    for h in ev.stored.block_hashes:
                        self.pages.setdefault(h, set()).add(ev.stored.medium)
                else:
                    for h in ev.removed.block_hashes:
                        media = self.pages.get(h, set())
                        media.discard(ev.removed.medium)
                        if not media:
                            self.pages.pop(h, None)
                self.events += 1
            self.head = item.batch.seq


class Engine:
    """Sends what an engine's scheduler would, one batched Step per engine step."""

    def __init__(self, client: CacheClient, epoch: int):
        self.client, self.epoch = client, epoch
        self.rows: list[Row] = []

    def step(self, **ops) -> pb.StepResponse:
        return self.client.step(pb.StepRequest(pool_id=POOL, epoch=self.epoch, **ops))

    def start(self, names_prompts: list[tuple[str, list[int]]], salt: str = "") -> list[str]:
        """Match a batch of new requests in one step; allocate the rest of each prompt."""
        ns = common_pb2.Namespace(salt=salt)
        resp = self.step(matches=[pb.MatchOp(request_id=n, namespace=ns, token_ids=p)
                                  for n, p in names_prompts])
        leases = []
        allocs = []
        for (name, prompt), m in zip(names_prompts, resp.matches):
            self.rows.append(Row(name, salt or "-", len(prompt), m.device_hit_tokens, m.host_hit_tokens))
            need = -(-len(prompt) // PAGE) + 8 - len(m.device_pages)  # + room for the answer
            allocs.append(pb.AllocateOp(lease_id=m.lease_id, num_pages=need))
            leases.append(m.lease_id)
        for a in self.step(allocations=allocs).allocations:
            if not a.ok:
                raise SystemExit(f"demo: allocation failed: {a.reason}")
        return leases

    def finish(self, lease: str, prompt: list[int], answer: list[int]) -> None:
        """Publish prompt + answer pages (for the next turn) and release, in one step."""
        full = (len(prompt) + len(answer)) // PAGE
        self.step(publishes=[pb.PublishOp(lease_id=lease, append_token_ids=answer, computed_pages=full)],
                  releases=[pb.ReleaseOp(lease_id=lease)])

    def prefill_chunk(self, lease: str, pages: int) -> None:
        self.step(publishes=[pb.PublishOp(lease_id=lease, computed_pages=pages)])


def workload(engine: Engine, rng: random.Random) -> None:
    words = lambda n: [rng.randrange(1000, 30000) for _ in range(n)]  # noqa: E731
    system = words(512)
    # 1. Three conversations, three turns each: every turn resends the whole history.
    for conv in range(3):
        history = system + words(40)
        for turn in range(3):
            [lease] = engine.start([(f"chat{conv}-turn{turn}", history)])
            answer = words(60)
            engine.finish(lease, history, answer)
            history = history + answer + words(30)
    # 2. A burst of 8 samples of one new prompt (RL rollouts): the first request's prefill is
    #    published chunk by chunk, so the seven that arrive a step later reuse it mid-flight.
    prompt = words(1024)
    [first] = engine.start([("burst-0", prompt)])
    engine.prefill_chunk(first, 32)  # first 512-token chunk computed and published
    others = engine.start([(f"burst-{i}", prompt) for i in range(1, 8)])
    engine.prefill_chunk(first, 64)
    for lease in [first, *others]:
        engine.finish(lease, prompt, words(20))
    # 3. Two tenants, the same prompt: the salt keeps them apart.
    shared = words(300)
    for tenant in ("tenant-a", "tenant-b", "tenant-a"):
        [lease] = engine.start([(f"{tenant}-q", shared)], salt=tenant)
        engine.finish(lease, shared, words(10))


def summary(engine: Engine, index: EventIndex, stats: pb.PoolStats) -> str:
    lines = [f"{'request':<16}{'tenant':<10}{'prompt':>7}{'device':>8}{'host':>6}{'computed':>10}"]
    for r in engine.rows:
        lines.append(f"{r.name:<16}{r.tenant:<10}{r.prompt:>7}{r.device_hit:>8}{r.host_hit:>6}{r.computed:>10}")
    prompt = sum(r.prompt for r in engine.rows)
    hit = sum(r.device_hit + r.host_hit for r in engine.rows)
    dev = next(m for m in stats.media if m.medium == common_pb2.MEDIUM_DEVICE)
    lines += [
        "",
        f"hit ratio            {hit / prompt:.1%} of {prompt} prompt tokens ({hit} tokens not recomputed)",
        f"server stats         queried {stats.queried_tokens}, skipped {stats.skipped_prefill_tokens}, "
        f"computed {stats.computed_prefill_tokens}, duplicates deduplicated {stats.duplicate_pages} pages",
        f"device pages         {dev.cached_pages} cached, {dev.pinned_pages} pinned, {dev.free_pages} free "
        f"of {dev.total_pages}; {stats.media[1].cached_pages} demoted to host",
        f"event stream         {index.events} events up to seq {index.head}; index built from it holds "
        f"{len(index.pages)} pages",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixcache_bench.cache_demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keep-running", action="store_true",
                        help="leave the cache service running after the workload (Ctrl-C stops it)")
    args = parser.parse_args(argv)
    run_dir = pathlib.Path("runs") / time.strftime("%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / "cache_service.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "cache_service", "--port", "0"],
                              stdout=subprocess.PIPE, stderr=log, text=True)
    try:
        line = server.stdout.readline().strip()
        if not line.startswith("listening on "):
            raise SystemExit(f"demo: cache service did not start; see {log.name}")
        target = line.removeprefix("listening on ")
        with CacheClient(target) as client:
            client.wait_until_ready(timeout_s=20)
            print(f"cache service ready at {target} (log: {log.name})")
            epoch = time.time_ns()
            client.register_pool(pb.RegisterPoolRequest(
                pool_id=POOL, epoch=epoch, page_size=PAGE, device_pages=640, host_pages=256,
                model_id=MODEL))
            index = EventIndex(client)
            index.start()
            engine = Engine(client, epoch)
            workload(engine, random.Random(7))
            stats = client.get_stats(pb.GetStatsRequest(pool_id=POOL)).pools[0]
            deadline = time.monotonic() + 5
            while index.head < stats_head(client) and time.monotonic() < deadline:
                time.sleep(0.05)
            print(summary(engine, index, stats))
            cached = sum(m.cached_pages for m in stats.media)
            if len(index.pages) != cached:
                raise SystemExit(f"demo: event index holds {len(index.pages)} pages, tree {cached}")
            if args.keep_running:
                print(f"\ncache service still running at {target}; Ctrl-C to stop")
                sleep_until_interrupted()
            index.sub.close()
    except KeyboardInterrupt:
        pass
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
    print("cache service stopped cleanly" if server.returncode == 0 else
          f"cache service exited with {server.returncode}")
    return 0 if server.returncode == 0 else 1


def stats_head(client: CacheClient) -> int:
    return next(p.head_seq for p in client.list_pools().pools if p.pool_id == POOL)


if __name__ == "__main__":
    raise SystemExit(main())
