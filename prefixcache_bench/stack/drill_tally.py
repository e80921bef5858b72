"""The fault drill's tally of one phase (prefixcache_bench.stack.fault_drill): requests, failures,
wrong outputs, latencies and gaps, and each request's prompt tokens by source (device / host /
L3 / shared with a sibling in flight / computed), overall and per turn after the fault."""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

from prefixcache.v1 import compute_service_pb2 as cpb
from prefixcache_bench.stack.drill_reach import split_prompt

AFTER_TURNS = 2  # "back at its baseline within two turns" (issue 25, finding 7)


@dataclass
class Tally:
    sent: int = 0
    failed: int = 0
    wrong: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    first_failure: float = 0.0
    last_failure: float = 0.0
    started: float = 0.0  # when the phase began (monotonic)
    latencies: list[float] = field(default_factory=list)  # of the requests that succeeded
    max_gap_s: float = 0.0  # the longest time in which no client received a token
    l3_pages: int | None = None  # pages stored in Redis at the phase's end (None: not asked)
    recovered: float | None = None  # when the fault's injection and recovery returned
    # (end time, prompt tokens by source) of each request that succeeded
    sources: list[tuple[float, dict[str, int]]] = field(default_factory=list)
    # (start time, conversation, prompt tokens by source, prompt tokens new since the
    # conversation's previous turn, the prompt) of each request that succeeded
    turns: list[tuple[float, int, dict[str, int], int, str]] = field(default_factory=list)
    # prompt -> its leading tokens some worker held when the fault had recovered (drill_reach)
    held: dict[str, int] | None = None

    @property
    def outage_s(self) -> float:
        return round(self.last_failure - self.first_failure, 2)

    @property
    def p50_s(self) -> float:
        xs = sorted(self.latencies)
        return round(xs[len(xs) // 2], 3) if xs else 0.0

    def tokens(self, since: float = 0.0) -> dict[str, int]:
        total = dict.fromkeys(SOURCES, 0)
        for ended, counts in self.sources:
            if ended >= since:
                for k, v in counts.items():
                    total[k] += v
        return total

    def shares(self, since: float = 0.0) -> dict[str, float]:
        tokens = self.tokens(since)
        n = sum(tokens.values())
        return {k: round(v / n, 3) if n else 0.0 for k, v in tokens.items()}

    def l3_share_by_turn(self, after: int = AFTER_TURNS) -> dict[str, float] | None:
        """The L3 share of prompt tokens in each conversation's 1st, 2nd, ... turn (request)
        that started after the fault's recovery, and in its later ones ("later"); None when
        the phase has no recovery time (the baseline)."""
        by_turn = self.shares_by_turn(after)
        return None if by_turn is None else {k: v["l3"] for k, v in by_turn.items()}

    def shares_by_turn(self, after: int = AFTER_TURNS) -> dict[str, dict[str, float]] | None:
        """As l3_share_by_turn, every source's share (reuse that came back from the device
        instead of L3 shows there, and lost reuse as computed)."""
        if self.recovered is None:
            return None
        groups: dict[str, dict[str, int]] = {}
        for name, counts, _, _ in self._by_turn(after):
            group = groups.setdefault(name, dict.fromkeys(SOURCES, 0))
            for k, v in counts.items():
                group[k] += v
        return {name: {k: round(v / sum(g.values()), 3) if sum(g.values()) else 0.0
                       for k, v in g.items()} for name, g in groups.items()}

    def computed_history_new(self, after: int = AFTER_TURNS) -> dict[str, dict[str, float]]:
        """Lost reuse split by where it lies in each prompt: the share computed of its
        *history* (the tokens its conversation's previous turn sent too: reuse a fault need
        not lose, as that turn put them in the cache) and of its *new* part (the rest: cached
        only if this same prompt ran before, which the drill's conversations do, as they repeat;
        a FLUSHALL loses those of them no worker holds, and nothing can write them back). Per
        turn after the fault's recovery as l3_share_by_turn; for the baseline, over all its
        requests ("all"). The computed tokens are a prompt's tail: its new part first."""
        sums: dict[str, list[int]] = {}  # name -> [history, its computed, new, its computed]
        for name, counts, new, _ in self._by_turn(after):
            total, computed = sum(counts.values()), counts.get("computed", 0)
            acc = sums.setdefault(name, [0, 0, 0, 0])
            acc[0] += total - new
            acc[1] += max(0, computed - new)
            acc[2] += new
            acc[3] += min(computed, new)
        return {name: {"history": round(a[1] / a[0], 3) if a[0] else 0.0,
                       "new": round(a[3] / a[2], 3) if a[2] else 0.0}
                for name, a in sums.items()}

    def _by_turn(self, after: int):
        """(group name, prompt tokens by source, new tokens) per request, in start order:
        turn1.. turn`after` and "later" after the recovery; "all" without one (the
        baseline)."""
        names = [f"turn{k}" for k in range(1, after + 1)] + ["later"]
        if self.recovered is not None:
            yield from ((name, {}, 0, "") for name in names)  # every group, in order, even if empty
        seen: dict[int, int] = collections.Counter()
        for started, conv, counts, new, prompt in sorted(self.turns, key=lambda x: x[0]):
            if self.recovered is None:
                yield "all", counts, new, prompt
                continue
            if started < self.recovered:
                continue
            seen[conv] += 1
            yield names[min(seen[conv], after + 1) - 1], counts, new, prompt

    def reach_by_turn(self, after: int = AFTER_TURNS) -> dict[str, dict[str, float]]:
        """Per turn after the recovery (as l3_share_by_turn; the baseline: "all"), the L3 hit
        ratio of the prompts' history (what the conversation's previous turn sent too: the
        reuse a store loss need not lose after one turn): of its tokens that the worker's own
        tiers did not hold, those L3 gave (the drill judges it against the baseline's; a share
        of all tokens would also move with what the device holds, fuller after a fault's
        recomputing), the L3 share of the history and of the new part (drill_reach: an artefact of the repeating
        conversations), and with a snapshot of the workers at the recovery, the share of the
        new part some worker still held then (what a refill could write to L3 again) and the
        share of all prompt tokens held somewhere yet computed (a refill that came too late)."""
        sums: dict[str, collections.Counter] = {}
        for name, counts, new, prompt in self._by_turn(after):
            acc = sums.setdefault(name, collections.Counter())
            if not counts:
                continue
            held = None if self.held is None else self.held.get(prompt, 0)
            acc.update(split_prompt(counts, new, held))
            acc["total"] += sum(counts.values())

        def ratio(a: collections.Counter, num: str, den: str) -> float:
            return round(a[num] / a[den], 3) if a[den] else 0.0
        out = {}
        for name, a in sums.items():
            a["l3_or_computed"] = a["l3_history"] + a["computed_history"]
            row = {"l3_hit_ratio_history": ratio(a, "l3_history", "l3_or_computed"),
                   "l3_of_history": ratio(a, "l3_history", "history"),
                   "l3_of_new": ratio(a, "l3_new", "new"),
                   "reused_of_new": ratio(a, "reused_new", "new")}
            if self.held is not None and name != "all":
                row["held_of_new"] = ratio(a, "held_new", "new")
                row["computed_though_held"] = ratio(a, "computed_held", "total")
            out[name] = row
        return out

    def late_l3_share(self) -> float:
        """The L3 share of the requests that ended in the phase's second half."""
        if not self.sources:
            return 0.0
        end = self.sources[-1][0]
        return self.shares(self.started + (end - self.started) / 2)["l3"]


SOURCES = ("device", "host", "l3", "shared", "computed")


def prompt_sources(stats: cpb.GenerateStats) -> dict[str, int]:
    """A request's prompt tokens by where they came from; `shared` (a sibling in flight
    computed them) is taken out of device and host, where the stats count it, so the parts
    add up to the prompt."""
    shared = stats.shared_tokens_in_flight
    from_device = min(shared, stats.cached_tokens_device)
    return {"device": stats.cached_tokens_device - from_device,
            "host": max(0, stats.cached_tokens_host - (shared - from_device)),
            "l3": stats.cached_tokens_remote, "shared": shared,
            "computed": stats.computed_prompt_tokens}
