"""A fault drill: the whole local stack under steady multi-turn load while Redis, a worker, the
cache service and the gateway fail one after another; every request's greedy output is checked.

    python -m prefixcache_bench.stack.fault_drill [--clients 4] [--faults all] [--json docs/results/faults.json]

The stack starts as `python -m stack` starts it (service authentication on, L3 in Redis). Every
client sends conversations whose turns resend a growing history (the assistant's turns in the
history are fixed text, so each prompt's greedy answer is known): a baseline pass computes each
prompt's answer once, then the clients loop over them while the faults are injected in turn,
each followed by its recovery and a quiet period. A request fails when its stream ends in an
error (the clients do not retry a request: a retry would hide a failure; after a failure a client
waits BACKOFF_S before its next request, as real clients back off); an output is wrong when its
tokens differ from the baseline's. The summary is one row per fault, the requests that ran
from its injection to the next one's: sent, failed, wrong, and the outage (first to last
failure).
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
import redis

from prefixcache.v1 import compute_service_pb2 as cpb, compute_service_pb2_grpc as cgrpc
from prefixcache_bench.harness import columns_table, machine_info, write_json
from stack.__main__ import TOKENS, start_stack  # the README's stack, exactly
from stack.launcher import Stack
from stack.workload import QUESTIONS, SYSTEM

MAX_TOKENS = 8
BACKOFF_S = 0.1


@dataclass
class Tally:
    sent: int = 0
    failed: int = 0
    wrong: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    first_failure: float = 0.0
    last_failure: float = 0.0

    @property
    def outage_s(self) -> float:
        return round(self.last_failure - self.first_failure, 2)


class Load:
    """`clients` threads looping over the prompts through the gateway; each result is added to
    the tally of the phase (`phase`, which the drill moves on) in which the request ended."""

    def __init__(self, gateway: str, prompts: list[str], expected: dict[str, list[int]],
                 clients: int):
        self.gateway, self.prompts, self.expected = gateway, prompts, expected
        self.phase = "baseline"
        self.tallies: dict[str, Tally] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(clients)]
        self._recent: collections.deque[str] = collections.deque(maxlen=50)  # serving workers

    def busiest_worker(self) -> str:
        """The worker that served most of the last requests (the one a kill hurts most)."""
        with self._lock:
            return collections.Counter(self._recent).most_common(1)[0][0]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _client(self, index: int) -> None:
        rng = random.Random(index)
        channel = grpc.insecure_channel(self.gateway)
        stub = cgrpc.ComputeServiceStub(channel)
        n = 0
        while not self._stop.is_set():
            prompt = rng.choice(self.prompts)
            try:
                tokens, worker = ask(stub, f"drill-{index}-{n}", prompt)
                wrong, error = tokens != self.expected[prompt], None
            except grpc.RpcError as exc:
                wrong, error = False, exc.code().name
            phase = self.phase  # when it ended: a fault fails the requests it interrupts
            n += 1
            with self._lock:
                if error is None:
                    self._recent.append(worker)
                tally = self.tallies.setdefault(phase, Tally())
                tally.sent += 1
                tally.wrong += wrong
                if error is not None:
                    now = time.monotonic()
                    tally.first_failure = tally.first_failure or now
                    tally.last_failure = now
                    tally.failed += 1
                    tally.errors[error] = tally.errors.get(error, 0) + 1
            if error is not None:
                time.sleep(BACKOFF_S)
        channel.close()


def ask(stub: cgrpc.ComputeServiceStub, request_id: str, prompt: str) -> tuple[list[int], str]:
    """The answer's tokens and the worker that finished it."""
    req = cpb.GenerateRequest(request_id=request_id, text=prompt, sampling=cpb.SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens: list[int] = []
    worker = ""
    for msg in stub.Generate(req, metadata=(("authorization", f"Bearer {TOKENS['alice']}"),),
                             timeout=60):
        tokens.extend(msg.token_ids)
        worker = msg.stats.worker or worker
    return tokens, worker


def conversation_prompts(conversations: int, turns: int) -> list[str]:
    """Turn t of a conversation resends turns 0..t-1 with fixed assistant answers."""
    rng = random.Random(11)
    prompts = []
    for c in range(conversations):
        history = SYSTEM
        for _ in range(turns):
            history += f"Customer {c}: {rng.choice(QUESTIONS)}\nAssistant:"
            prompts.append(history)
            history += " Thank you for asking; let me check that for you.\n"
    return prompts


# ---- the faults ----------------------------------------------------------------------------

def _signal(stack: Stack, name: str, sig: int) -> None:
    os.kill(stack.get(name).proc.pid, sig)


def _kill_and_restart(stack: Stack, name: str, down_s: float, grpc_health: bool = True) -> None:
    svc = stack.get(name)
    svc.proc.kill()
    svc.proc.wait()
    time.sleep(down_s)
    stack.restart(name, grpc_health=grpc_health)


def _redis(stack: Stack) -> redis.Redis:
    host, port = stack.get("redis").address.rsplit(":", 1)
    return redis.Redis(host=host, port=int(port), socket_timeout=5)


def _garbage(stack: Stack) -> None:
    """Overwrites every stored page with random bytes of the same length."""
    r = _redis(stack)
    rng = random.Random(3)
    for key in r.scan_iter(count=500):
        if r.type(key) == b"string":
            r.set(key, rng.randbytes(r.strlen(key)))


def _pause(stack: Stack, name: str, seconds: float) -> None:
    _signal(stack, name, signal.SIGSTOP)
    time.sleep(seconds)
    _signal(stack, name, signal.SIGCONT)


def _gateway_restart(stack: Stack) -> None:
    svc = stack.get("gateway")
    svc.proc.send_signal(signal.SIGTERM)
    svc.proc.wait(timeout=60)
    stack.restart("gateway")


FAULTS: dict[str, tuple[str, Callable[[Stack, Load], None]]] = {
    "redis-sigstop": ("Redis paused (SIGSTOP) for 3 s", lambda s, _: _pause(s, "redis", 3.0)),
    "redis-flushall": ("Redis FLUSHALL", lambda s, _: _redis(s).flushall()),
    "redis-garbage": ("every page in Redis overwritten with random bytes",
                      lambda s, _: _garbage(s)),
    "redis-sigkill": ("Redis killed (SIGKILL), back 2 s later, empty",
                      lambda s, _: _kill_and_restart(s, "redis", 2.0, grpc_health=False)),
    "worker-sigkill": ("the busiest worker killed (SIGKILL), restarted",
                       lambda s, load: _kill_and_restart(s, load.busiest_worker(), 0.5)),
    "cache-sigkill": ("the cache service killed (SIGKILL), restarted",
                      lambda s, _: _kill_and_restart(s, "cache_service", 0.5)),
    "gateway-sigterm": ("the only gateway stopped (SIGTERM: drain), restarted",
                        lambda s, _: _gateway_restart(s)),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixcache_bench.stack.fault_drill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--faults", default="all",
                        help=f"comma-separated, of: {', '.join(FAULTS)} (default all)")
    parser.add_argument("--quiet-s", type=float, default=6.0,
                        help="load after each fault's recovery before the next fault")
    parser.add_argument("--model", default="tiny-hybrid")
    parser.add_argument("--json", help="write the results here")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    names = list(FAULTS) if args.faults == "all" else args.faults.split(",")
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        parser.error(f"--faults: unknown {', '.join(unknown)}; known: {', '.join(FAULTS)}")

    run_dir = pathlib.Path("runs") / time.strftime("drill-%Y%m%d-%H%M%S")
    run_dir.mkdir(parents=True, exist_ok=True)
    stack = Stack(run_dir)
    load = None
    try:
        gateway, _ = start_stack(stack, run_dir, argparse.Namespace(model=args.model, workers=2))
        if not stack.has("redis"):
            raise RuntimeError("the drill needs redis-server (the L3 faults)")
        prompts = conversation_prompts(conversations=6, turns=4)
        with grpc.insecure_channel(gateway) as channel:
            stub = cgrpc.ComputeServiceStub(channel)
            expected = {p: ask(stub, f"baseline-{i}", p)[0] for i, p in enumerate(prompts)}
        load = Load(gateway, prompts, expected, args.clients)
        load.start()
        time.sleep(args.quiet_s)
        for name in names:
            print(f"fault: {FAULTS[name][0]}", flush=True)
            load.phase = name
            FAULTS[name][1](stack, load)
            time.sleep(args.quiet_s)
        load.stop()
    except RuntimeError as exc:
        print(f"drill failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if load is not None:
            load.stop()
        codes = stack.stop()
    # Streams the gateway moved to another worker mid-answer (design.md §6, "Resuming a stream").
    resumed = stack.get("gateway").log_path.read_text().count("event=generate_resumed")
    rows = [[phase, FAULTS[phase][0] if phase in FAULTS else "no fault", t.sent, t.failed,
             t.wrong, t.outage_s, ", ".join(f"{k} {v}" for k, v in sorted(t.errors.items())) or "-"]
            for phase, t in load.tallies.items()]
    print()
    print(columns_table(["phase", "fault", "requests", "failed", "wrong output", "outage s",
                         "errors"], rows))
    print(f"streams the gateway moved to another worker mid-answer: {resumed}")
    if args.json:
        write_json(args.json, {
            "command": " ".join(["python -m prefixcache_bench.stack.fault_drill", *argv]),
            "machine": machine_info(), "clients": args.clients, "max_tokens": MAX_TOKENS,
            "backoff_s": BACKOFF_S, "resumed_streams": resumed,
            "phases": {phase: {"fault": row[1], "requests": t.sent, "failed": t.failed,
                               "wrong": t.wrong, "outage_s": t.outage_s, "errors": t.errors}
                       for (phase, t), row in zip(load.tallies.items(), rows)},
            "exit_codes": dict(codes)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
