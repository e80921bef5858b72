"""A fault drill: the whole local stack under steady multi-turn load while Redis, a worker, the
cache service and the gateway fail one after another; every request's greedy output is checked.

    python -m prefixcache_bench.stack.fault_drill [--clients 4] [--faults all] [--json docs/results/faults.json]

The stack starts as `python -m stack` starts it (service authentication on, L3 in Redis). Every
client sends conversations whose turns resend a growing history (the assistant's turns in the
history are fixed text, so each prompt's greedy answer is known): a baseline pass computes each
prompt's answer once, then the clients loop over them, each request a conversation's next turn
(after its last turn a conversation starts again; no two clients send the same conversation at
once), while the faults are injected in turn,
each followed by its recovery and a quiet period. A request fails when its stream ends in an
error (the clients do not retry a request: a retry would hide a failure; after a failure a client
waits BACKOFF_S before its next request, as real clients back off); an output is wrong when its
tokens differ from the baseline's. The summary is one row per fault, the requests that ran
from its injection to the next one's: sent, failed, wrong, the outage (first to last failure),
the p50 latency of the requests that succeeded, the longest gap in which no client received a
token (a stall shows there even when nothing fails), and where their prompt tokens came from
(device / host / L3 / shared with a sibling in flight / computed; lost reuse shows there), with
the L3 share also over the phase's second half and in each conversation's first, second and
later turns (requests) that started after the fault's recovery (issue 25, finding 7: back at
its baseline within two turns of a FLUSHALL or a Redis restart), the share computed of each
prompt's history (what its conversation's previous turn sent too) and of its new part (the rest,
cached only because the conversations repeat: after a FLUSHALL, lost unless a worker holds it),
the L3 hit ratio of the history (judged) and the new part held at the recovery (drill_reach),
and the pages stored in Redis
at the phase's end (after a FLUSHALL or a Redis restart they must be back: the workers write
them again). The workers' device pools (--device-pages) are smaller than the conversations, as
a serving pool is smaller than its users' histories: a turn often finds its history in L3 only
(written by the other worker, or by this one before it evicted it), so the L3 share is a real
part of the baseline and an L3 fault shows in it.
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

import grpc
import redis

from prefixcache.v1 import compute_service_pb2 as cpb, compute_service_pb2_grpc as cgrpc
from prefixcache_bench.harness import columns_table, machine_info, write_json
from prefixcache_bench.stack.drill_reach import held_tokens, prompt_ids
from prefixcache_bench.stack.drill_tally import Tally, prompt_sources
from stack.__main__ import TOKENS, start_stack  # the README's stack, exactly
from stack.launcher import Stack
from stack.workload import QUESTIONS, SYSTEM

MAX_TOKENS = 8
BACKOFF_S = 0.1
CONVERSATIONS = 24
TURNS = 4
DEVICE_PAGES = 96
# The longest quiet period after a fault, in `--quiet-s` (`_quiet`).
QUIET_CAP = 3
AUTH = (("authorization", f"Bearer {TOKENS['alice']}"),)


class Load:
    """`clients` threads looping over the prompts through the gateway; each result is added to
    the tally of the phase (`phase`, which the drill moves on) in which the request ended."""

    def __init__(self, gateway: str, prompts: list[str], expected: dict[str, list[int]],
                 clients: int, conversation: dict[str, int],
                 ids: dict[str, list[int]] | None = None):
        self.gateway, self.prompts, self.expected = gateway, prompts, expected
        self.conversation = conversation  # prompt -> its conversation's index
        self.phase = "baseline"
        self.tallies: dict[str, Tally] = {}
        self._last_token = 0.0  # when any client last received a token (monotonic)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True)
                         for i in range(clients)]
        self._recent: collections.deque[str] = collections.deque(maxlen=50)  # serving workers
        # Conversations progress: each request sends a conversation's next turn (after its last
        # it starts again), never one that another client has in flight.
        self._turns = len(prompts) // (max(conversation.values()) + 1)
        self._next_turn = {c: 0 for c in set(conversation.values())}
        self._in_flight: set[int] = set()
        self._picker = random.Random(7)
        self._new = new_since_previous_turn(prompts, self._turns, ids)

    def _next_prompt(self) -> str:
        with self._lock:
            free = sorted(set(self._next_turn) - self._in_flight)
            c = self._picker.choice(free)
            self._in_flight.add(c)
            turn = self._next_turn[c]
            self._next_turn[c] = (turn + 1) % self._turns
            return self.prompts[c * self._turns + turn]

    def busiest_worker(self) -> str:
        """The worker that served most of the last requests (the one a kill hurts most)."""
        with self._lock:
            return collections.Counter(self._recent).most_common(1)[0][0]

    def start(self) -> None:
        self._last_token = time.monotonic()
        self.tallies.setdefault(self.phase, Tally(started=self._last_token))
        for t in self._threads:
            t.start()

    def enter(self, phase: str) -> None:
        """The drill moves on to `phase` (a fault about to be injected)."""
        with self._lock:
            self.phase = phase
            self.tallies.setdefault(phase, Tally(started=time.monotonic()))

    def _received(self) -> None:
        """A client received tokens: the gap since the last ones counts in this phase."""
        now = time.monotonic()
        with self._lock:
            tally = self.tallies.setdefault(self.phase, Tally(started=now))
            tally.max_gap_s = max(tally.max_gap_s, now - self._last_token)
            self._last_token = now

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=60)

    def _client(self, index: int) -> None:
        channel = grpc.insecure_channel(self.gateway)
        stub = cgrpc.ComputeServiceStub(channel)
        n = 0
        while not self._stop.is_set():
            prompt = self._next_prompt()
            started = time.monotonic()
            stats = None
            try:
                tokens, worker, stats = ask(stub, f"drill-{index}-{n}", prompt, self._received)
                wrong, error = tokens != self.expected[prompt], None
            except grpc.RpcError as exc:
                wrong, error = False, exc.code().name
            ended = time.monotonic()
            n += 1
            with self._lock:
                self._in_flight.discard(self.conversation[prompt])
                phase = self.phase  # when it ended: a fault fails the requests it interrupts
                if error is None:
                    self._recent.append(worker)
                tally = self.tallies.setdefault(phase, Tally(started=ended))
                tally.sent += 1
                tally.wrong += wrong
                if error is None:
                    tally.latencies.append(ended - started)
                    if stats is not None:
                        tally.sources.append((ended, prompt_sources(stats)))
                        tally.turns.append((started, self.conversation[prompt],
                                            prompt_sources(stats), self._new[prompt], prompt))
                if error is not None:
                    now = time.monotonic()
                    tally.first_failure = tally.first_failure or now
                    tally.last_failure = now
                    tally.failed += 1
                    tally.errors[error] = tally.errors.get(error, 0) + 1
            if error is not None:
                time.sleep(BACKOFF_S)
        channel.close()


def ask(stub: cgrpc.ComputeServiceStub, request_id: str, prompt: str,
        received: Callable[[], None] = lambda: None
        ) -> tuple[list[int], str, cpb.GenerateStats | None]:
    """The answer's tokens, the worker that finished it and its stats; `received()` is
    called on each message that brings tokens."""
    req = cpb.GenerateRequest(request_id=request_id, text=prompt, sampling=cpb.SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True))
    tokens: list[int] = []
    worker, stats = "", None
    for msg in stub.Generate(req, metadata=AUTH, timeout=60):
        if msg.token_ids:
            received()
        tokens.extend(msg.token_ids)
        worker = msg.stats.worker or worker
        if msg.HasField("stats"):
            stats = msg.stats
    return tokens, worker, stats


def conversation_prompts(conversations: int, turns: int) -> list[str]:
    """Prompt i is turn i % turns of conversation i // turns."""
    # Turn t of a conversation resends turns 0..t-1 with fixed assistant answers.
    rng = random.Random(11)
    prompts = []
    for c in range(conversations):
        history = SYSTEM
        for _ in range(turns):
            history += f"Customer {c}: {rng.choice(QUESTIONS)}\nAssistant:"
            prompts.append(history)
            history += " Thank you for asking; let me check that for you.\n"
    return prompts


def new_since_previous_turn(prompts: list[str], turns: int,
                            ids: dict[str, list[int]] | None = None) -> dict[str, int]:
    """Prompt -> its tokens that its conversation's previous turn (cyclically: the first turn
    follows the last) did not send: the tokens after the two prompts' common prefix of token
    ids (`ids`: drill_reach.prompt_ids; without them, of bytes, an estimate)."""
    seq = ids or {p: p.encode() for p in prompts}
    new = {}
    for i, prompt in enumerate(prompts):
        c, t = divmod(i, turns)
        mine, previous = seq[prompt], seq[prompts[c * turns + (t - 1) % turns]]
        new[prompt] = len(mine) - len(os.path.commonprefix([list(previous), list(mine)]))
    return new


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


def l3_pages(stack: Stack) -> int | None:
    """The pages stored in Redis now (keys under the L3 prefix, the cache service's sentinel
    keys left out), or None when Redis does not answer."""
    try:
        r = _redis(stack)
        return sum(1 for key in r.scan_iter(match="pc:*", count=1000)
                   if not key.startswith(b"pc:sentinel:"))
    except redis.RedisError:
        return None


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


def report(args: argparse.Namespace, argv: list[str], load: Load, stack: Stack,
           codes: dict) -> int:
    """Prints the table of phases and writes --json."""
    # Streams the gateway moved to another worker mid-answer (design.md §6, "Resuming a stream").
    resumed = stack.get("gateway").log_path.read_text().count("event=generate_resumed")
    rows = [[phase, FAULTS[phase][0] if phase in FAULTS else "no fault", t.sent, t.failed,
             t.wrong, t.outage_s, ", ".join(f"{k} {v}" for k, v in sorted(t.errors.items())) or "-",
             t.p50_s, round(t.max_gap_s, 2),
             " / ".join(f"{100 * v:.0f}" for v in t.shares().values()),
             f"{100 * t.late_l3_share():.0f}",
             " / ".join(f"{100 * v:.0f}" for v in by_turn.values()) if by_turn else "-",
             "; ".join(f"{100 * v['history']:.0f} / {100 * v['new']:.0f}"
                       for v in t.computed_history_new().values()),
             " / ".join(f"{100 * v['l3_hit_ratio_history']:.0f}" for v in t.reach_by_turn().values()),
             " / ".join(f"{100 * v.get('held_of_new', 0):.0f}"
                        for v in t.reach_by_turn().values()) if t.held is not None else "-",
             t.l3_pages]
            for phase, t in load.tallies.items() for by_turn in [t.l3_share_by_turn()]]
    print()
    print(columns_table(["phase", "fault", "requests", "failed", "wrong output", "outage s",
                         "errors", "p50 s", "max gap s", "% dev/host/L3/shared/computed",
                         "% L3 2nd half", "% L3 turn 1/2/later after",
                         "% computed of history / new: turn 1; 2; later (all)",
                         "% L3 hit ratio of history: turn 1/2/later (all)",
                         "% of new held at recovery: turn 1/2/later",
                         "L3 pages at end"],
                        rows))
    print(f"streams the gateway moved to another worker mid-answer: {resumed}")
    if args.json:
        write_json(args.json, {
            "command": " ".join(["python -m prefixcache_bench.stack.fault_drill", *argv]),
            "machine": machine_info(), "clients": args.clients, "max_tokens": MAX_TOKENS,
            "backoff_s": BACKOFF_S, "resumed_streams": resumed,
            "conversations": args.conversations, "turns": TURNS,
            "device_pages": args.device_pages,
            "phases": {phase: {"fault": row[1], "requests": t.sent, "failed": t.failed,
                               "wrong": t.wrong, "outage_s": t.outage_s, "errors": t.errors,
                               "p50_s": t.p50_s, "max_gap_s": round(t.max_gap_s, 3),
                               "prompt_tokens": t.tokens(), "share": t.shares(),
                               "l3_share_second_half": t.late_l3_share(),
                               "l3_share_by_turn_after": t.l3_share_by_turn(),
                               "share_by_turn_after": t.shares_by_turn(),
                               "computed_history_new": t.computed_history_new(),
                               "reach_by_turn_after": t.reach_by_turn(),
                               "l3_pages_at_end": t.l3_pages}
                       for (phase, t), row in zip(load.tallies.items(), rows)},
            "exit_codes": dict(codes)})
    return 0


def _quiet(load: Load, phase: str, quiet_s: float, baseline_sent: int) -> None:
    """The quiet period after a fault: `quiet_s`, and on until the phase has sent as many
    requests as the baseline did (at most QUIET_CAP times `quiet_s`). After a FLUSHALL each
    request recomputes what L3 held, so in a fixed time fewer run, and on a slow machine the
    refill then read under half the baseline's pages for want of requests, not of writes."""
    start = time.monotonic()
    time.sleep(quiet_s)
    while (load.tallies[phase].sent < baseline_sent
           and time.monotonic() - start < QUIET_CAP * quiet_s):
        time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m prefixcache_bench.stack.fault_drill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--faults", default="all",
                        help=f"comma-separated, of: {', '.join(FAULTS)} (default all)")
    parser.add_argument("--quiet-s", type=float, default=6.0,
                        help="load after each fault's recovery before the next fault (longer, up "
                             f"to {QUIET_CAP}x, until the phase sent as many requests as the "
                             "baseline)")
    parser.add_argument("--model", default="tiny-hybrid")
    parser.add_argument("--conversations", type=int, default=CONVERSATIONS,
                        help=f"conversations of {TURNS} turns the clients pick from")
    parser.add_argument("--device-pages", type=int, default=DEVICE_PAGES,
                        help="each worker's device pool, in pages (`python -m stack`: 512); "
                             "smaller than the conversations, so that a turn often finds its "
                             "history in L3 only and the L3 faults show in the L3 share")
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
        gateway, _ = start_stack(stack, run_dir, argparse.Namespace(model=args.model, workers=2),
                                 device_pages=args.device_pages)
        if not stack.has("redis"):
            raise RuntimeError("the drill needs redis-server (the L3 faults)")
        operator = (("x-prefixcache-service-token", (run_dir / "service-auth/operator.token")
                      .read_text().strip()),)
        prompts = conversation_prompts(conversations=args.conversations, turns=TURNS)
        ids = prompt_ids(run_dir / "demo-chat" / "tokenizer.json", prompts)
        with grpc.insecure_channel(gateway) as channel:
            stub = cgrpc.ComputeServiceStub(channel)
            expected = {p: ask(stub, f"baseline-{i}", p)[0] for i, p in enumerate(prompts)}
        load = Load(gateway, prompts, expected, args.clients,
                    {p: i // TURNS for i, p in enumerate(prompts)}, ids)
        load.start()
        time.sleep(args.quiet_s)
        load.tallies[load.phase].l3_pages = l3_pages(stack)
        for name in names:
            print(f"{time.strftime('%H:%M:%S')} fault: {FAULTS[name][0]}", flush=True)
            load.enter(name)
            FAULTS[name][1](stack, load)
            load.tallies[name].recovered = time.monotonic()
            if name.startswith("redis-") and ids:  # what a refill can write (drill_reach)
                load.tallies[name].held = held_tokens(stack.get("cache_service").address, [
                    w.name for w in stack.services if w.name.startswith("worker-")], operator, ids)
            _quiet(load, name, args.quiet_s, load.tallies["baseline"].sent)
            load.tallies[name].l3_pages = l3_pages(stack)
        load.stop()
    except RuntimeError as exc:
        print(f"drill failed: {exc}", file=sys.stderr)
        return 1
    finally:
        if load is not None:
            load.stop()
        codes = stack.stop()
    return report(args, argv, load, stack, codes)


if __name__ == "__main__":
    raise SystemExit(main())
