"""Prometheus metrics of the gateway. Counters are updated as things happen; the index and
worker gauges are read from the router at scrape time, so they are never stale."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import prometheus_client
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from gateway.core import index_native

MEDIA = ("device", "host", "remote")
# Routing decisions take tens of microseconds to a few milliseconds (long prompts, many workers).
_DECISION_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


# (index pages per (worker, medium), workers per state, index totals: entries, capacity,
# evictions, memory_bytes, table_bytes, swept_tombstones, and the policy's routed_pages,
# routed_memory_bytes)
Snapshot = tuple[dict[tuple[str, str], int], dict[str, int], dict[str, int]]


class _Gauges(Collector):
    """`snapshot()` -> Snapshot, read per scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot]):
        self._snapshot = snapshot

    def collect(self) -> Iterator[prometheus_client.Metric]:
        pages, states, totals = self._snapshot()
        yield from _index_totals(totals)
        index = GaugeMetricFamily("prefixcache_gateway_index_pages",
                                  "Pages the gateway's index holds, by worker and medium.",
                                  labels=["worker", "medium"])
        for (worker, medium), n in sorted(pages.items()):
            index.add_metric([worker, medium], n)
        workers = GaugeMetricFamily("prefixcache_gateway_workers",
                                    "Workers the gateway knows, by state (eligible: routed to).",
                                    labels=["state"])
        for state, n in sorted(states.items()):
            workers.add_metric([state], n)
        yield index
        yield workers


def _index_totals(totals: dict[str, int]) -> Iterator[prometheus_client.Metric]:
    """The routing index's bound and how full it is (gateway/core/index.py)."""
    for name, doc in (("entries", "(page hash, medium) keys the routing index holds."),
                      ("capacity", "Keys the routing index may hold (--index-memory-mb)."),
                      ("memory_bytes", "Estimated memory of the routing index (keys and sets "
                                       "of holders x their measured bytes)."),
                      ("table_bytes", "The routing index's page tables as allocated, a "
                                      "growth's old table and the next one's spare included."),
                      ("shared_pages", "Keys two or more workers hold: two or three name "
                                       "their pair or triple, four or more a set of holders, "
                                       "shared by every key with the same holders."),
                      ("holder_sets", "Distinct sets of 4+ holders of shared keys (~300 bytes "
                                      "each at 1,000 workers), in memory_bytes and the bound, "
                                      "not in table_bytes.")):
        g = GaugeMetricFamily(f"prefixcache_gateway_index_{name}", doc)
        g.add_metric([], totals[name])
        yield g
    c = CounterMetricFamily("prefixcache_gateway_index_evictions", "Keys the routing index "
                            "dropped at its bound: the fleet outgrew --index-memory-mb.")
    c.add_metric([], totals["evictions"])
    yield c
    c = CounterMetricFamily("prefixcache_gateway_index_tombstones_swept", "Tombstones of removed "
                            "pages the feed loop cleared in place (a steady state's table then "
                            "neither rebuilds nor holds a spare).")
    c.add_metric([], totals["swept_tombstones"])
    yield c
    c = CounterMetricFamily("prefixcache_gateway_index_growths", "Growths of the routing index's "
                            "page tables: arrays=ready took arrays the feed loop wrote ahead; "
                            "partial took them partly written and wrote the rest under the "
                            "routing lock; unready wrote fresh ones there (decisions wait: up "
                            "to ~0.2 s at 10M pages).", labels=["arrays"])
    for arrays in ("ready", "partial", "unready"):
        c.add_metric([arrays], totals[f"growths_{arrays}"])
    yield c
    c = CounterMetricFamily("prefixcache_gateway_index_shrinks", "Page tables of the routing "
                            "index moved into smaller arrays once their pages filled under a "
                            "fifth of them (a fleet scaled down), in the feed loop's idle steps.")
    c.add_metric([], totals["shrinks"])
    yield c
    for name, doc in (("pages", "Pages the routing policy remembers as routed to a worker (the "
                                "affinity policy: until events report them; at most its "
                                "recent_pages_per_worker a worker)."),
                      ("memory_bytes", "Memory of the pages the routing policy remembers (the C "
                                       "store's own count; the Python dicts' estimated).")):
        g = GaugeMetricFamily(f"prefixcache_gateway_routed_{name}", doc)
        g.add_metric([], totals[f"routed_{name}"])
        yield g


def reason_kind(reason: str) -> str:
    """A routing reason without its particulars: the part before ':' with every number as N
    ("near-tie of 3 workers within 12 tokens: ..." -> "near-tie of N workers within N tokens")."""
    return re.sub(r"\d+(\.\d+)?", "N", reason.split(":", 1)[0]).strip()[:80]


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = r = prometheus_client.CollectorRegistry()
        self.requests = prometheus_client.Counter(
            "prefixcache_gateway_requests", "Generate calls by the worker that served them and "
            "outcome (ok, abort, cancelled, or the gRPC status code).",
            ["worker", "outcome"], registry=r)
        self.retries = prometheus_client.Counter(
            "prefixcache_gateway_retries", "Generate calls moved to another worker after this one "
            "failed before the first token.", ["worker"], registry=r)
        self.resumes = prometheus_client.Counter(
            "prefixcache_gateway_resumes", "Generate streams moved to another worker, with the "
            "tokens already streamed, after this one failed mid-stream.", ["worker"], registry=r)
        self.decision_seconds = prometheus_client.Histogram(
            "prefixcache_gateway_routing_decision_seconds", "Time the routing policy took to "
            "choose a worker.", buckets=_DECISION_BUCKETS, registry=r)
        self.prompt_tokens = prometheus_client.Counter(
            "prefixcache_gateway_prompt_tokens", "Prompt tokens of routed requests.", registry=r)
        self.matched_tokens = prometheus_client.Counter(
            "prefixcache_gateway_matched_tokens", "Prompt tokens the chosen worker held by the "
            "index when it was chosen, by medium.", ["medium"], registry=r)
        self.cached_tokens = prometheus_client.Counter(
            "prefixcache_gateway_cached_tokens", "Prompt tokens the workers reported served from "
            "cache, by medium.", ["medium"], registry=r)
        self.feed_process_restarts = prometheus_client.Counter(
            "prefixcache_gateway_feed_process_restarts", "Times the feed process "
            "(--feed-process) died and was replaced; its feeds resumed from the index.",
            registry=r)
        self.resyncs = prometheus_client.Counter(
            "prefixcache_gateway_resyncs", "Event stream resubscriptions after a gap, a new epoch "
            "or a broken snapshot.", ["worker"], registry=r)
        self.tokenizer_refusals = prometheus_client.Counter(
            "prefixcache_gateway_tokenizer_refusals", "Text and chat prompts refused because no "
            "worker tokenizes as the gateway does (no_compatible_worker), no worker has a "
            "tokenizer (no_tokenizer), or the gateway has not received it yet (unknown).",
            ["reason"], registry=r)
        self.tokenizer_mismatched_workers = prometheus_client.Gauge(
            "prefixcache_gateway_tokenizer_mismatched_workers", "Admitted workers whose tokenizer "
            "fingerprint differs from the gateway's: they are sent token-id prompts only.",
            registry=r)
        self.index_table = prometheus_client.Gauge(
            "prefixcache_gateway_index_table", "1 for what serves the routing index's page "
            "tables: implementation c (gateway/core/index_native.py) or numpy (--index-native).",
            ["implementation"], registry=r)
        native = index_native.implementation()
        for name in ("c", "numpy"):
            self.index_table.labels(name).set(name == native)

        self.ingest_floor_sleeps = prometheus_client.Counter(
            "prefixcache_gateway_ingest_floor_sleeps", "Routing decisions that slept first to "
            "let starved ingest run (gateway/core/decisions_first.py): the request threads keep "
            "the gateway's core busy.", registry=r)
        self.routing_decisions = prometheus_client.Counter(
            "prefixcache_gateway_routing_decisions", "Workers chosen, by policy and the kind "
            "of reason it gave (RouteDecision.reason with its numbers as N: a bounded set).",
            ["policy", "reason"], registry=r)

    def routed(self, policy: str, reason: str) -> None:
        self.routing_decisions.labels(policy, reason_kind(reason)).inc()

    def watch(self, snapshot: Callable[[], Snapshot]) -> None:
        self.registry.register(_Gauges(snapshot))

    def shared_index(self, health: Callable[[], tuple[bool, int, int]],
                     leases_held: Callable[[], int]) -> Callable[[float], None]:
        """`--index-backend redis`: the view's health (Redis down; lookups and failed round
        trips, read per scrape) and the workers whose lease this replica holds. Returns what
        observes each round trip's seconds."""
        rtt = prometheus_client.Histogram(
            "prefixcache_gateway_shared_index_round_trip_seconds", "Round trips to the shared "
            "index in Redis (a routing lookup's, the worker table's refresh).",
            buckets=_DECISION_BUCKETS, registry=self.registry)
        self.registry.register(_SharedIndexGauges(health, leases_held))
        return rtt.observe


class _SharedIndexGauges(Collector):
    def __init__(self, health: Callable[[], tuple[bool, int, int]],
                 leases_held: Callable[[], int]):
        self._health, self._leases_held = health, leases_held

    def collect(self) -> Iterator[prometheus_client.Metric]:
        down, lookups, failures = self._health()
        g = GaugeMetricFamily("prefixcache_gateway_shared_index_redis_down", "1 while the last "
                              "round trip to the shared index failed: routing by load only.")
        g.add_metric([], int(down))
        yield g
        for name, doc, n in (("lookups", "Routing lookups asked of the shared index.", lookups),
                             ("failures", "Round trips to the shared index that failed.",
                              failures)):
            c = CounterMetricFamily(f"prefixcache_gateway_shared_index_{name}", doc)
            c.add_metric([], n)
            yield c
        leases = GaugeMetricFamily("prefixcache_gateway_shared_index_leases_held", "Workers "
                                   "whose indexer lease this replica holds (it writes their "
                                   "events to the shared index).")
        leases.add_metric([], self._leases_held())
        yield leases
