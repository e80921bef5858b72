"""service_shell.retry: the one retry policy and what its users get from it."""
from __future__ import annotations

import pytest

from gateway.core.workers import WorkerSettings
from prefixcache_client.cache import _SERVICE_CONFIG as CACHE_SERVICE_CONFIG
from service_shell import channel_options
from service_shell.retry import (STEP_RETRY, TRANSPORT_RETRY, WORKER_RETRY, RetryPolicy)


def test_delay_grows_to_the_cap_within_the_jitter() -> None:
    policy = RetryPolicy(initial_s=0.1, max_s=1.0, multiplier=2.0, jitter=0.2)
    for failures, base in ((1, 0.1), (2, 0.2), (3, 0.4), (4, 0.8), (5, 1.0), (50, 1.0)):
        for _ in range(20):
            assert base * 0.8 <= policy.delay(failures) <= base * 1.2


def test_no_jitter_is_exact_and_the_deadline_ends_retrying() -> None:
    # The engine's former inline backoff, min(0.05 * 2 ** failures, 2.0), unchanged.
    assert [STEP_RETRY.delay(f + 1) for f in range(7)] == [min(0.05 * 2 ** f, 2.0)
                                                          for f in range(7)]
    assert not RetryPolicy().expired(1e9)
    policy = RetryPolicy(deadline_s=2.0)
    assert not policy.expired(1.9) and policy.expired(2.0)


@pytest.mark.parametrize("kwargs", [dict(initial_s=0), dict(initial_s=2, max_s=1),
                                    dict(multiplier=0.5), dict(jitter=1.0),
                                    dict(deadline_s=-1), dict(max_s=float("inf"))])
def test_bad_policies_are_refused(kwargs) -> None:
    with pytest.raises(ValueError, match="retry"):
        RetryPolicy(**kwargs)


def test_the_transport_layer_is_built_from_policies() -> None:
    retry = CACHE_SERVICE_CONFIG["methodConfig"][0]["retryPolicy"]
    assert retry == {"maxAttempts": 3, "initialBackoff": "0.05s", "maxBackoff": "0.5s",
                     "backoffMultiplier": 2.0, "retryableStatusCodes": ["UNAVAILABLE"]}
    assert retry == TRANSPORT_RETRY.grpc_retry_policy(3)
    options = dict(channel_options(4))
    assert (options["grpc.initial_reconnect_backoff_ms"],
            options["grpc.max_reconnect_backoff_ms"]) == (100, 5000)


def test_the_gateway_builds_its_worker_policy_once() -> None:
    assert WorkerSettings().backoff is WORKER_RETRY is WorkerSettings().backoff
