"""`--gc-freeze-after-warmup`: the gateway freezes its heap out of the garbage collector's walks
once, when every worker that is up has delivered its snapshot (gateway/core/gc_tuning.py)."""
from __future__ import annotations

import gc

import pytest

from gateway.__main__ import config_from_args, parse_args
from gateway.core.gc_tuning import FreezeAfterWarmup
from gateway.core.metrics import GatewayMetrics
from gateway.core.policies import AffinityPolicy
from gateway.core.router import Router, Worker
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from tests.gateway.helpers import FakeClock, batch


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the rest of the test session collects as before


def _router() -> Router:
    router = Router(AffinityPolicy(), GatewayMetrics(), clock=FakeClock())
    for name in ("a", "b"):
        router.add(Worker(name, name, name, None, pb.GetModelInfoResponse(worker=name)))  # type: ignore[arg-type]
    return router


def _sync(router: Router, name: str) -> None:
    router.on_stream_item(name, cpb.SubscribeResponse(batch=batch(name, 0)))


def test_the_heap_is_frozen_once_every_worker_up_is_synced(unfrozen):
    router = _router()
    freeze = FreezeAfterWarmup(True, router.warm)
    assert not freeze.poll()  # no snapshot in yet
    _sync(router, "a")
    assert not freeze.poll() and gc.get_freeze_count() == 0  # b is up and not synced
    router.set_up("b", False)
    assert freeze.poll() and gc.get_freeze_count() > 0
    assert not freeze.poll()  # once


def test_disabled_it_never_freezes(unfrozen):
    router = _router()
    _sync(router, "a")
    _sync(router, "b")
    assert router.warm()
    assert not FreezeAfterWarmup(False, router.warm).poll()
    assert gc.get_freeze_count() == 0


def test_the_flag_is_on_by_default_and_can_be_turned_off():
    on = config_from_args(parse_args(["--workers", "localhost:1", "--allow-anonymous"]))
    off = config_from_args(parse_args(["--workers", "localhost:1", "--allow-anonymous",
                                       "--no-gc-freeze-after-warmup"]))
    assert on.gc_freeze_after_warmup and not off.gc_freeze_after_warmup
