"""Routing policies: one interface, `choose(request, candidates, index, load) -> RouteDecision`,
and `preview` with the same arguments: the decision `choose` would make now, without recording
the prompt as routed or advancing a rotation (RoutePreview uses it). For every policy,
`choose(...) == preview(...)` followed by the state change `choose` makes; a preview never
changes a later choice.

- `affinity` (default, `affinity.py`): prefill still to do, weighted by overload for new
  prompts, plus load; `approx`: the same score without events (the gateway remembers what it
  routed where).
- baselines (`baselines.py`): `round_robin`, `least_loaded`, and `sglang` (SGLang router's
  cache_aware rule).

Load (`LoadTracker`, `load.py`) = what this gateway has in flight per worker combined with the
worker's own LoadReport. Policies are not thread-safe; the gateway calls them under its routing
lock.
"""
from __future__ import annotations

from gateway.core.policies.affinity import AffinityConfig, AffinityPolicy, ApproxPolicy
from gateway.core.policies.base import (Policy, RouteDecision, RouteRequest, WorkerLoad,
                                        WorkerScore)
from gateway.core.policies.baselines import (LeastLoadedPolicy, RoundRobinPolicy, SglangConfig,
                                             SglangPolicy)
from gateway.core.policies.load import RECENT_HALFLIFE_S, LoadTracker

POLICY_NAMES = ("affinity", "approx", "round_robin", "least_loaded", "sglang")


def make_policy(name: str, *, affinity: AffinityConfig | None = None, sglang: SglangConfig | None = None,
                approx_max_pages: int = 65536) -> Policy:
    """A policy by name (see POLICY_NAMES)."""
    if name == "affinity":
        return AffinityPolicy(affinity)
    if name == "approx":
        return ApproxPolicy(affinity, approx_max_pages)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "sglang":
        return SglangPolicy(sglang)
    raise ValueError(f"policy: unknown {name!r}, expected one of {', '.join(POLICY_NAMES)}")


__all__ = ["POLICY_NAMES", "RECENT_HALFLIFE_S", "AffinityConfig", "AffinityPolicy", "ApproxPolicy",
           "LeastLoadedPolicy", "LoadTracker", "Policy", "RoundRobinPolicy", "RouteDecision",
           "RouteRequest", "SglangConfig", "SglangPolicy", "WorkerLoad", "WorkerScore", "make_policy"]
