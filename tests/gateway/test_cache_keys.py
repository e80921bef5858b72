"""OpenAI's `prompt_cache_key` (gateway/core/cache_keys.py): a tenant's requests with one key go
to one worker, bounded by load; the map is bounded and entries expire. Then the hints over real
gRPC and HTTP (the fake fleet): validation errors naming the field, the route reason."""
from __future__ import annotations

import os

import grpc
import httpx
import pytest
from pydantic import ValidationError

from gateway.core.cache_keys import CacheKeyAffinity, CacheKeyConfig
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import AffinityPolicy, RouteRequest
from gateway.core.router import Router, Worker
from gateway.http.schemas import ChatCompletionRequest
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import gateway_pb2 as gpb
from tests.gateway.gateway_harness import request, wait_until
from tests.gateway.helpers import FakeClock, NoClient, batch, stored
from tests.gateway.http_helpers import post
from tests.gateway.server_helpers import fake_fleet, prompt, rpc_error

WORKERS = ("w0", "w1", "w2", "w3")


def _router(clock: FakeClock, config: CacheKeyConfig | None = None) -> Router:
    router = Router(AffinityPolicy(), GatewayMetrics(), clock=clock,
                    cache_keys=CacheKeyAffinity(config, clock))
    for name in WORKERS:
        router.add(Worker(name, f"{name}:1", f"{name}:2", client=NoClient(),  # type: ignore[arg-type]
                          info=pb.GetModelInfoResponse()))
    return router


def _new_prompt(key: tuple[str, str] | None, pages: int = 4) -> RouteRequest:
    """A prompt no worker holds (fresh random page hashes): affinity alone spreads these."""
    hashes = [os.urandom(16) for _ in range(pages)]
    return RouteRequest(os.urandom(8).hex(), hashes, pages * 16, 16, cache_key=key)


def _route(router: Router, key: tuple[str, str] | None) -> tuple[str, str]:
    """(worker, reason) of a new prompt with `key`, finished at once (no load stays behind)."""
    req = _new_prompt(key)
    route = router.route(req)
    assert route is not None
    router.finish(req.request_id)
    return route.worker.name, route.decision.reason


def test_requests_with_one_key_go_to_one_worker_and_others_spread():
    router = _router(FakeClock())
    keyed = [_route(router, ("tenant-a", "conv-1")) for _ in range(12)]
    assert len({w for w, _ in keyed}) == 1
    assert all(r.startswith("cache-key:") for _, r in keyed[1:])
    assert not keyed[0][1].startswith("cache-key")  # the first one: the policy chose
    unkeyed = {_route(router, None)[0] for _ in range(12)}
    assert len(unkeyed) > 1  # without a key the same prompts spread over the workers


def test_keys_are_per_tenant():
    router = _router(FakeClock())
    a = _route(router, ("tenant-a", "k"))[0]
    # Another tenant's same key is a new key: the policy picks, and it may pick another worker.
    b, reason = _route(router, ("tenant-b", "k"))
    assert not reason.startswith("cache-key")
    assert router.cache_keys.worker_for(("tenant-a", "k"), WORKERS, router.load) == a
    assert router.cache_keys.worker_for(("tenant-b", "k"), WORKERS, router.load) == b


def test_an_overloaded_key_worker_sends_the_key_elsewhere_and_the_key_follows():
    router = _router(FakeClock())
    key = ("tenant-a", "hot")
    home = _route(router, key)[0]
    # Requests in flight on the key's worker with more queued prefill than the bound.
    router.load.on_route(home, "busy", int(CacheKeyConfig().max_queue_tokens) + 1)
    moved, reason = _route(router, key)
    assert moved != home and not reason.startswith("cache-key")
    again, reason = _route(router, key)
    assert again == moved and reason.startswith("cache-key")
    router.load.on_finish("busy")


def test_a_key_follows_its_prefix_when_the_index_shows_it_on_another_worker():
    router = _router(FakeClock())
    key = ("tenant-a", "chat")
    req = _new_prompt(key, pages=6)
    home = router.route(req).worker.name
    router.finish(req.request_id)
    other = next(w for w in WORKERS if w != home)
    # The chat's first 3 pages are reported on `other` (its pages left `home`, say).
    router.on_stream_item(other, cpb.SubscribeResponse(batch=batch(other, 0, stored(
        list(req.page_hashes[:3])))))
    again = RouteRequest("again", req.page_hashes, req.prompt_tokens, req.page_size, cache_key=key)
    route = router.route(again)
    assert route.worker.name == other and not route.decision.reason.startswith("cache-key")
    router.finish("again")
    assert router.cache_keys.worker_for(key, WORKERS, router.load) == other


def test_a_key_whose_worker_is_not_a_candidate_or_left_is_routed_by_the_policy():
    router = _router(FakeClock())
    key = ("tenant-a", "k")
    home = _route(router, key)[0]
    req = _new_prompt(key)
    route = router.route(req, exclude=[home])
    assert route is not None and route.worker.name != home
    router.finish(req.request_id)
    router.remove(route.worker.name)
    assert router.cache_keys.worker_for(key, WORKERS, router.load) is None


def test_keys_expire_and_the_map_is_bounded():
    clock = FakeClock()
    keys = CacheKeyAffinity(CacheKeyConfig(max_keys=2, ttl_s=60.0), clock)
    router = _router(clock)
    keys.record(("t", "a"), "w1")
    clock.now += 59.0
    assert keys.worker_for(("t", "a"), WORKERS, router.load) == "w1"
    clock.now += 1.0
    assert keys.worker_for(("t", "a"), WORKERS, router.load) is None and len(keys) == 0
    for name in ("a", "b", "c"):
        keys.record(("t", name), "w2")
    assert len(keys) == 2 and keys.worker_for(("t", "a"), WORKERS, router.load) is None
    with pytest.raises(ValueError):
        CacheKeyConfig(ttl_s=0)


# ---- over the wire: gRPC and HTTP --------------------------------------------------------------

@pytest.fixture(scope="module")
def fleet():
    with fake_fleet(http_port=0, tokenizer="byte") as (gw, _, workers, _, caller):
        base = f"http://127.0.0.1:{gw.http_port}"
        wait_until(lambda: httpx.get(base + "/health").status_code == 200, what="HTTP health")
        yield gw, workers, caller, base


def _hinted(key: str = "", retention: str = "", start: int = 90) -> pb.GenerateRequest:
    req = request(prompt(start))
    req.prompt_cache_key, req.prompt_cache_retention = key, retention
    return req


def test_grpc_refuses_a_bad_hint_naming_the_field(fleet):
    _, _, caller, _ = fleet
    for req, field in ((_hinted(key="k" * 257), "prompt_cache_key"),
                       (_hinted(key="é" * 129), "prompt_cache_key"),
                       (_hinted(retention="1h"), "prompt_cache_retention")):
        for call in (lambda: list(caller.compute.Generate(req, metadata=caller.meta())),
                     lambda: caller.gateway.RoutePreview(gpb.RoutePreviewRequest(request=req),
                                                         metadata=caller.meta())):
            err = rpc_error(call)
            assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert err.details().startswith(field + ":"), err.details()


def test_grpc_routes_a_key_together_and_previews_it(fleet):
    _, _, caller, _ = fleet
    served = set()
    for i in range(6):
        out = list(caller.compute.Generate(_hinted(key="conv-7", retention="in_memory",
                                                   start=100 + i), metadata=caller.meta()))
        served.add(out[-1].stats.worker)
    assert len(served) == 1
    preview = caller.gateway.RoutePreview(
        gpb.RoutePreviewRequest(request=_hinted(key="conv-7", start=120)), metadata=caller.meta())
    assert preview.worker in served and preview.reason.split("; ", 1)[1].startswith("cache-key:")


BAD_HTTP_HINTS = (({"prompt_cache_key": "k" * 257}, "prompt_cache_key"),
                  ({"prompt_cache_key": "é" * 200}, "prompt_cache_key"),  # 400 bytes
                  ({"prompt_cache_key": ""}, "prompt_cache_key"),
                  ({"prompt_cache_key": 7}, "prompt_cache_key"),
                  ({"prompt_cache_retention": "1h"}, "prompt_cache_retention"))


def test_http_completions_take_the_hints_and_name_a_bad_one(fleet):
    _, _, _, base = fleet
    body = {"prompt": prompt(140), "max_tokens": 2}
    reasons, served = [], set()
    for i in range(3):
        r = post(base, "/v1/completions", {**body, "prompt": prompt(140 + i),
                                           "prompt_cache_key": "k", "prompt_cache_retention": "24h"})
        assert r.status_code == 200, r.text
        served.add(r.json()["usage"]["prefixcache"]["worker"])
        reasons.append(r.json()["usage"]["prefixcache"]["route_reason"])
    assert len(served) == 1 and reasons[-1].startswith("cache-key:"), reasons
    # The retention goes on to the worker (its cache service protects the prefix); the key
    # stays in the gateway.
    _, workers, _, _ = fleet
    seen = workers[served.pop()].seen[-1].request
    assert (seen.prompt_cache_retention, seen.prompt_cache_key) == ("24h", "")
    for bad, param in BAD_HTTP_HINTS:
        r = post(base, "/v1/completions", {**body, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_chat_declares_the_hints_with_the_same_bounds():
    # The fake fleet has no chat template; the chat schema is the completions' (_Sampling), and
    # the byte bound is checked where both endpoints build their worker requests (respond.py).
    messages = [{"role": "user", "content": "hi"}]
    ok = ChatCompletionRequest.model_validate(
        {"messages": messages, "prompt_cache_key": "conv", "prompt_cache_retention": "in_memory"})
    assert ok.unsupported() == [] and ok.prompt_cache_key == "conv"
    for bad, param in BAD_HTTP_HINTS:
        if param == "prompt_cache_key" and isinstance(bad[param], str) and len(bad[param]) == 200:
            continue  # a byte bound, not a schema one
        with pytest.raises(ValidationError) as err:
            ChatCompletionRequest.model_validate({"messages": messages, **bad})
        assert err.value.errors()[0]["loc"][0] == param
