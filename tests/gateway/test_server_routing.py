"""Gateway routing over gRPC: by prefix, spreading, tenant and adapter isolation, RoutePreview."""
from __future__ import annotations

import threading

from service_shell import SALT_METADATA_KEY
from tests.gateway.helpers import settles
from tests.gateway.server_helpers import cached_on, preview, prompt, sample


# ---- routing ---------------------------------------------------------------------------------

def test_routes_to_the_holder_with_the_tenant_salt_never_the_clients(fleet):
    gw, _, workers, caller = fleet
    tokens = prompt(1)
    cached_on(fleet, "w2", tokens)
    out = caller.generate(tokens, extra=((SALT_METADATA_KEY, "forged"),))
    assert out[-1].stats.worker == "w2"
    seen = workers["w2"].seen[-1]
    assert list(seen.request.token_ids.ids) == tokens
    assert seen.salts == ["salt-a"]  # the tenant's, the client's own dropped
    assert sample(gw, "prefixcache_gateway_requests_total", worker="w2", outcome="ok") >= 1
    assert sample(gw, "prefixcache_gateway_matched_tokens_total", medium="device") >= 60


def test_equal_scores_are_spread(fleet):
    _, _, _, caller = fleet
    chosen = {caller.generate(prompt(100 + i))[-1].stats.worker for i in range(6)}
    assert chosen == {"w1", "w2"}


def test_namespace_isolation_is_paired(fleet):
    _, _, workers, caller = fleet
    tokens = prompt(2)
    cached_on(fleet, "w1", tokens, salt="salt-a")
    same = preview(caller, tokens, "tok-a")
    assert same.worker == "w1"
    assert {c.worker: c.device_tokens for c in same.candidates}["w1"] == 60
    for other in (preview(caller, tokens, "tok-b"), preview(caller, tokens, "tok-a", "lora-x")):
        assert all(c.device_tokens + c.host_tokens + c.remote_tokens == 0
                   for c in other.candidates)
    assert caller.generate(tokens, "tok-a")[-1].stats.worker == "w1"
    caller.generate(tokens, "tok-b")
    assert any(s.salts == ["salt-b"] for w in workers.values() for s in w.seen)


def test_route_preview_explains(fleet):
    _, _, workers, caller = fleet
    tokens, busy = prompt(3), prompt(4)
    cached_on(fleet, "w2", tokens[:33])
    cached_on(fleet, "w1", busy)
    gate = workers["w1"].gate = threading.Event()  # one request in flight on w1 meanwhile
    try:
        running = caller.stream(busy, request_id="preview-load")
        next(running)
        resp = preview(caller, tokens)
        running.cancel()
    finally:
        workers["w1"].gate = None
        gate.set()
    assert resp.policy == "affinity" and resp.prompt_tokens == 64 and resp.worker == "w2"
    assert resp.reason.startswith("holds 32 of 64 prompt tokens (device 32, host 0, remote 0)")
    rows = {c.worker: c for c in resp.candidates}
    assert rows.keys() == {"w1", "w2"} and all(c.eligible for c in rows.values())
    assert (rows["w2"].device_tokens, rows["w1"].device_tokens) == (32, 0)
    assert rows["w2"].score < rows["w1"].score
    assert all(0 <= c.staleness_s < 5 and c.address for c in rows.values())
    assert (rows["w1"].in_flight, rows["w2"].in_flight) == (1, 0)
    # A preview changes nothing: the policy does not remember the prompt as routed.
    gw = fleet[0]
    sizes = {w: gw.router.policy.recent.size(w) for w in workers}
    for _ in range(3):
        assert preview(caller, prompt(18)).worker
    assert {w: gw.router.policy.recent.size(w) for w in workers} == sizes


def test_a_request_applies_its_decisions_record_once_its_call_is_on_its_way(fleet):
    """The decision queues its record of the pages it routed (routed_prefixes.py); the proxy
    applies it after starting the worker's call, not the next decision."""
    gw, _, workers, caller = fleet
    recent = gw.router.policy.recent
    before = {w: recent.size(w) for w in workers}
    with settles(gw.router) as queued_after:
        worker = caller.generate(prompt(31))[-1].stats.worker
    assert queued_after == [0]
    assert recent.size(worker) > before[worker]
