"""What service authentication costs the engine's hottest call: the round trip of a cache-service
Step over loopback with auth off and with auth on (design.md §8, "Service identities").

    python -m prefixcache_bench.stack.auth [--steps 5000] [--rounds 4] [--json PATH]

Two cache services in this process, one without an identities file and one with it, each with
the pool a worker registered under its token. A client (one channel each, as an engine keeps)
sends the Step an engine sends when it has nothing to ask (a pool's empty step: the RPC's and
the interceptors' cost, not the core's) through the engine's client (`CacheClient.step`),
`--steps` times per round, the two servers alternating by round, so that both see the same
machine. With auth on the client sends its token as call metadata and the server's interceptor
authenticates and authorizes every call; the pool-ownership check runs in both (it is the same
code, it only has nothing to check when off).

The goal: auth adds at most 100 µs to the p50 round trip (`auth_overhead_p50_us`, the
difference of the two p50s over all rounds).
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import sys
import tempfile
import time

from cache_service.core import CacheCore
from cache_service.server import CacheServer, ServerConfig
from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache_client.cache import CacheClient
from prefixcache_bench.harness import Goal, log, machine_info, report, summarize
from service_shell.auth import ServiceIdentities
from stack.identities import write_credentials

GOALS = {"auth_overhead_p50_us": Goal("<=", 100.0)}
POOL = "worker-1"


@contextlib.contextmanager
def _server(auth: ServiceIdentities | None, token: str | None):
    """A cache service and the engine's own client of it (CacheClient), the pool registered."""
    server = CacheServer(CacheCore(), ServerConfig(host="127.0.0.1", port=0, grace_s=0.0,
                                                   auth=auth)).start()
    client = CacheClient(f"127.0.0.1:{server.port}", timeout_s=10, service_token=token)
    try:
        client.register_pool(pb.RegisterPoolRequest(pool_id=POOL, epoch=1, page_size=16,
                                                    model_id="bench", device_pages=64))
        yield client
    finally:
        client.close()
        server.drain()


def _time(client: CacheClient, n: int) -> list[float]:
    req = pb.StepRequest(pool_id=POOL, epoch=1)
    out = []
    for _ in range(n):
        started = time.perf_counter()
        client.step(req)
        out.append(time.perf_counter() - started)
    return out


def run(steps: int, rounds: int, workdir: pathlib.Path) -> dict:
    creds = write_credentials(workdir, [POOL])
    token = creds.tokens[POOL].read_text().strip()
    auth = ServiceIdentities.from_file(creds.identities)
    samples: dict[str, list[float]] = {"off": [], "on": []}
    with _server(None, None) as off, _server(auth, token) as on:
        stubs = {"off": off, "on": on}
        for stub in stubs.values():
            _time(stub, min(500, steps))  # warm both channels and servers
        for r in range(rounds):
            order = ("off", "on") if r % 2 == 0 else ("on", "off")
            for mode in order:
                samples[mode] += _time(stubs[mode], steps)
            log(f"  round {r + 1}/{rounds}")
    out = {**summarize("step_auth_off_us", samples["off"], 1e6, 1),
           **summarize("step_auth_on_us", samples["on"], 1e6, 1)}
    out["auth_overhead_p50_us"] = round(out["step_auth_on_us_p50"] - out["step_auth_off_us_p50"], 1)
    out["steps_per_mode"] = steps * rounds
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m prefixcache_bench.stack.auth", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5000, help="timed Steps per server per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds, the servers alternating")
    ap.add_argument("--json", metavar="PATH", help="write the results here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        ap.error("--steps and --rounds: must be at least 1")
    machine = machine_info(watched=["service_shell", "cache_service"])
    with tempfile.TemporaryDirectory(prefix="bench-auth-") as tmp:
        log(f"[service auth] {args.rounds} rounds of {args.steps} Steps, auth off and on")
        results = run(args.steps, args.rounds, pathlib.Path(tmp))
    report(results, GOALS, "cache Step round trip: service auth off vs on",
           "python -m prefixcache_bench.stack.auth " + " ".join(argv or sys.argv[1:]), machine, args.json)
    return 0  # a figure to report, not a gate


if __name__ == "__main__":
    raise SystemExit(main())
