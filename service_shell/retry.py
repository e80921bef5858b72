"""The one retry policy of the project: exponential backoff with jitter, and optionally a
deadline, between attempts of something that failed (a resubscription, a reconnection, a failed
engine step). Every retry loop takes one `RetryPolicy`:

- prefixcache_client.cache: `Subscription` resubscribing (`SUBSCRIBE_RETRY`, or the caller's);
- gateway/core/workers.py: each worker thread's identify, health-watch and event-feed loops
  (`WORKER_RETRY`, built once, or `WorkerSettings.backoff`);
- compute_service/engine/engine.py: the engine loop after a failed step (`STEP_RETRY`, no jitter:
  one engine per process, nobody to spread from).

Below them is the transport layer, gRPC's own, configured from the same dataclass in
service_shell/options.py: the channels' reconnect backoff (`RECONNECT_RETRY`) and the retries of
idempotent unary calls in the clients' service configs (`TRANSPORT_RETRY.grpc_retry_policy`;
gRPC adds its own jitter, and the call's deadline bounds them).
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """`delay(failures)`: `initial_s * multiplier ** (failures - 1)`, at most `max_s`, spread by
    ±`jitter` (a fraction); `expired(elapsed_s)`: past `deadline_s` (None: retry until the caller
    stops)."""
    initial_s: float = 0.05
    max_s: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.2
    deadline_s: float | None = None

    def __post_init__(self) -> None:
        if not (math.isfinite(self.initial_s) and 0 < self.initial_s <= self.max_s
                and math.isfinite(self.max_s)):
            raise ValueError(f"retry: need 0 < initial_s <= max_s, finite; got "
                             f"{self.initial_s}, {self.max_s}")
        if not (math.isfinite(self.multiplier) and self.multiplier >= 1):
            raise ValueError(f"retry: multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"retry: jitter must be in [0, 1), got {self.jitter}")
        if self.deadline_s is not None and not (math.isfinite(self.deadline_s)
                                                and self.deadline_s >= 0):
            raise ValueError(f"retry: deadline_s must be a finite number >= 0, got "
                             f"{self.deadline_s}")

    def delay(self, failures: int) -> float:
        """Seconds to wait after the `failures`-th failure in a row (1 = the first)."""
        base = min(self.max_s, self.initial_s * self.multiplier ** max(0, failures - 1))
        if not self.jitter:
            return base
        return base * random.uniform(1 - self.jitter, 1 + self.jitter)

    def expired(self, elapsed_s: float) -> bool:
        """Whether a loop that started retrying `elapsed_s` ago should give up."""
        return self.deadline_s is not None and elapsed_s >= self.deadline_s

    def grpc_retry_policy(self, max_attempts: int,
                          codes: tuple[str, ...] = ("UNAVAILABLE",)) -> dict:
        """The same backoff as a gRPC service config's `retryPolicy` (gRPC jitters by itself;
        the call's deadline, not `deadline_s`, bounds the attempts)."""
        return {"maxAttempts": max_attempts, "initialBackoff": f"{self.initial_s:g}s",
                "maxBackoff": f"{self.max_s:g}s", "backoffMultiplier": self.multiplier,
                "retryableStatusCodes": list(codes)}


# Resubscribing to a cache service's event stream (prefixcache_client.cache.Subscription).
SUBSCRIBE_RETRY = RetryPolicy(initial_s=0.05, max_s=5.0)
# Reconnecting: gRPC channels (service_shell/options.py's reconnect backoff, jitter gRPC's own)
# and a gateway's loops around one worker (identify it, watch its health, follow its events).
RECONNECT_RETRY = RetryPolicy(initial_s=0.1, max_s=5.0)
WORKER_RETRY = RECONNECT_RETRY
# The engine after a failed step (it asks delay(failures + 1)): 0.1, 0.2, ... 2 s, until
# MAX_STEP_FAILURES aborts everything.
STEP_RETRY = RetryPolicy(initial_s=0.05, max_s=2.0, jitter=0.0)
# gRPC's own retries of idempotent unary calls (the clients' service configs): 3 attempts.
TRANSPORT_RETRY = RetryPolicy(initial_s=0.05, max_s=0.5, jitter=0.0)
