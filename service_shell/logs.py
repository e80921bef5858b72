"""Structured logs: one `event=... key=value` line per event, the same format in every service, so
one log query works across the cache service, the compute workers and the gateway."""
from __future__ import annotations

import json
import logging
import sys

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_FORMAT = "ts=%(asctime)s level=%(levelname)s logger=%(name)s %(message)s"


def kv(event: str, **fields: object) -> str:
    """One structured log line: event=... key=value ..., quoting values that need it."""
    parts = [f"event={event}"]
    for key, value in fields.items():
        text = f"{value:.6g}" if isinstance(value, float) else str(value)
        if not text or any(c in text for c in ' ="\n\t'):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    return " ".join(parts)


def configure_logging(level: str) -> None:
    """Root logger to stderr in the key=value format (stdout carries the `listening on` lines
    that launchers and tests parse)."""
    logging.basicConfig(level=level, stream=sys.stderr, format=_FORMAT)
