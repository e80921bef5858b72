"""The checks that several requests share (design.md §8: bad input is refused naming the field,
and nothing is half-applied): pool ids, names, seconds, token lists. Each Step operation checks
its own part of a Step with these (cache_service/step/). Errors are `CacheError`s whose message
names the field.
"""
from __future__ import annotations

import math
import re

from prefixcache_client.errors import invalid
from prefixcache_client.hash import MAX_NAME_BYTES, token_bytes

POOL_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")
MAX_PAGE_SIZE = 4096
# Seconds fields (design.md §8 "Bad input"): NaN and inf compare false with every bound, so each
# is checked for finiteness first (an inf or NaN lease TTL never expired). A heartbeat faster
# than 20/s floods the subscriber and the server (NaN meant no wait at all), one slower than
# a minute makes a live pool look dead to the gateway. The lease TTL's upper bound is the
# server's --max-lease-ttl-s (cache_service/access.py).
MIN_HEARTBEAT_INTERVAL_S, MAX_HEARTBEAT_INTERVAL_S = 0.05, 60.0


def check_seconds(field: str, value: float, low: float, high: float, zero: str = "") -> None:
    """`value` finite and in [low, high], or 0 when `zero` says what 0 means."""
    if zero and value == 0:
        return
    if not (math.isfinite(value) and low <= value <= high):
        allowed = f"0 ({zero}) or " if zero else ""
        bounds = f">= {low:g}" if high == math.inf else f"in [{low:g}, {high:g}]"
        raise invalid(f"{field}: must be {allowed}a finite number of seconds {bounds}, got "
                      f"{value!r}")


def check_lease_ttl(field: str, value: float) -> None:
    check_seconds(field, value, 0.0, math.inf)


def check_heartbeat_interval(value: float) -> None:
    check_seconds("heartbeat_interval_s", value, MIN_HEARTBEAT_INTERVAL_S,
                  MAX_HEARTBEAT_INTERVAL_S, zero="= 1 s")


def check_pool_id(pool_id: str) -> None:
    if not POOL_ID.match(pool_id):
        raise invalid(f"pool_id: '{pool_id}' must be 1..128 characters of [A-Za-z0-9._:-]")


def check_name(field: str, value: str, allow_empty: bool = True) -> None:
    size = len(value.encode("utf-8"))
    if size > MAX_NAME_BYTES or (not allow_empty and size == 0):
        raise invalid(f"{field}: must be {0 if allow_empty else 1}..{MAX_NAME_BYTES} UTF-8 bytes, "
                      f"got {size}")


def tokens_of(ids, packed: bytes, field: str) -> bytes:
    """The u32-le bytes of a token list given either as int64 ids or already packed."""
    if packed or not ids:
        if ids:
            raise invalid(f"{field}: set either {field.rsplit('.', 1)[-1]} or its packed_ form, "
                          "not both")
        if len(packed) % 4:
            raise invalid(f"{field}: packed length {len(packed)} is not a multiple of 4 bytes")
        return packed
    try:
        return token_bytes(ids, field)
    except ValueError as exc:
        raise invalid(str(exc)) from None
