"""The HTTP port's slow-client bounds, without the HTTP stack's dependencies: `python -m gateway`
takes its flags' defaults from here whether or not the `gateway` extra is installed, and
gateway/http/server.py enforces them."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_s: float = 5.0
    max_connections: int = 4096
    max_head_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        if not (self.header_timeout_s > 0 and self.body_timeout_s > 0 and self.keep_alive_s > 0):
            raise ValueError("header_timeout_s, body_timeout_s and keep_alive_s must be > 0")
        if self.max_connections < 1 or self.max_head_bytes < 1024:
            raise ValueError("max_connections must be >= 1 and max_head_bytes >= 1024")
