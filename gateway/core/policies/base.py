"""What every routing policy takes and gives: the request as the router sees it, each worker's
score, the decision, and the `Policy` protocol."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from gateway.core.index import KvIndex
    from gateway.core.policies.load import LoadTracker

@dataclass(slots=True)
class RouteRequest:
    request_id: str
    # Hashes of the prompt's full pages, computed in the request's namespace (prefixcache_client.hash).
    page_hashes: Sequence[bytes]
    prompt_tokens: int
    page_size: int
    # The tokenizer a worker must have to be sent this prompt (GetModelInfo's
    # tokenizer_fingerprint): the gateway's for text and chats it tokenized, "" for token ids
    # (any worker). Keyword-only, so subclasses keep their positional fields.
    tokenizer_fingerprint: str = field(default="", kw_only=True)
    # (tenant scope, prompt_cache_key) when the request carries OpenAI's prompt_cache_key; the
    # router sends requests with the same one together (gateway/core/cache_keys.py).
    cache_key: tuple[str, str] | None = field(default=None, kw_only=True)


@dataclass(slots=True)
class WorkerLoad:
    queued_prefill_tokens: int = 0
    inflight_requests: int = 0
    # Prefill tokens routed to the worker lately (exponentially decayed): the longer-horizon
    # load that spreads new prefixes when every queue is empty.
    recent_prefill_tokens: float = 0.0


@dataclass(slots=True)
class WorkerScore:
    worker: str
    device_tokens: int = 0
    host_tokens: int = 0
    remote_tokens: int = 0
    confidence: float = 1.0
    queued_prefill_tokens: int = 0
    inflight_requests: int = 0
    recent_prefill_tokens: float = 0.0
    # Prompt tokens this worker would still compute (confidence-weighted, load costs included).
    prefill_tokens: float = 0.0
    # Recent routed prefill above the candidates' mean, as a fraction of the mean (>= 0).
    overload: float = 0.0
    score: float = 0.0


@dataclass(slots=True)
class RouteDecision:
    worker: str
    policy: str
    reason: str
    # Estimated prompt tokens the chosen worker computes (what LoadTracker.on_route is told).
    prefill_tokens: int
    scores: list[WorkerScore] = field(default_factory=list)


class Policy(Protocol):
    name: str

    def choose(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
               load: LoadTracker, all_scores: bool = True) -> RouteDecision:
        """Pick a worker and remember it (routed prefixes, rotation counters). Without
        `all_scores` the decision's scores may list the chosen worker alone (a policy that
        scores every candidate anyway lists them all)."""
        ...

    def preview(self, request: RouteRequest, candidates: Sequence[str], index: KvIndex,
                load: LoadTracker) -> RouteDecision:
        """The decision `choose` would make now, changing nothing."""
        ...

    def remove_worker(self, worker: str) -> None: ...

    def settle(self) -> None:
        """Applies what decisions queued for later (their records of the pages routed:
        gateway/core/routed_prefixes.py), which the next one reads first anyway. The router calls
        it under its lock, off the decisions: a request's path once its decision is on its way
        (`Router.settle`), and its ingest slices."""
        ...

    def remembered(self) -> tuple[int, int]:
        """(pages the policy remembers of what it routed, their memory): the gauges
        prefixcache_gateway_routed_pages and _routed_memory_bytes."""
        ...


def require_candidates(candidates: Sequence[str]) -> None:
    if not candidates:
        raise ValueError("candidates: no worker to route to")
