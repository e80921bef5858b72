"""Structured logs: one logfmt line per event, the same format in every service, so one log query
works across the cache service, the compute workers and the gateway:

    ts=2026-11-24T08:00:00.123Z level=INFO logger=cache_service.server event=server_started ...

Every line parses as logfmt (key=value pairs, values quoted with JSON escapes when they need it):
the timestamp is ISO-8601 UTC without spaces; our own messages are `kv(...)` pairs and pass
through as they are; any other message (a library's) becomes `msg="..."`, and a traceback
`exc="..."` on the same line (newlines escaped), so a multi-line exception never splits an
event into lines a parser cannot read.
"""
from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
# Characters that force a value into quotes: logfmt's separators, quotes, escapes, and every
# control character (a raw CR or NUL would break the line for a reader).
_NEEDS_QUOTES = re.compile(r'[\s="\\\x00-\x1f\x7f]')
_PAIR = r'[^\s="]+=(?:"(?:[^"\\\x00-\x1f]|\\.)*"|[^\s="\\\x00-\x1f\x7f]+)'
_LOGFMT = re.compile(rf"{_PAIR}(?: {_PAIR})*")


def _value(value: object) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    if not text or _NEEDS_QUOTES.search(text):
        return json.dumps(text)
    return text


def kv(event: str, **fields: object) -> str:
    """One structured log line: event=... key=value ..., quoting values that need it."""
    return " ".join([f"event={_value(event)}",
                     *(f"{key}={_value(value)}" for key, value in fields.items())])


class LogfmtFormatter(logging.Formatter):
    """`ts=<ISO-8601 UTC, ms> level=... logger=...` then the message's pairs (see above)."""

    def format(self, record: logging.LogRecord) -> str:
        seconds = int(record.created)
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
        ms = int((record.created - seconds) * 1000)
        message = record.getMessage()
        line = f"ts={ts}.{ms:03d}Z level={record.levelname} logger={_value(record.name)} "
        line += message if _LOGFMT.fullmatch(message) else f"msg={_value(message)}"
        if record.exc_info:
            record.exc_text = record.exc_text or self.formatException(record.exc_info)
        if record.exc_text:
            line += f" exc={_value(record.exc_text)}"
        if record.stack_info:
            line += f" stack={_value(self.formatStack(record.stack_info))}"
        return line


def configure_logging(level: str) -> None:
    """Root logger to stderr in logfmt (stdout carries the `listening on` lines that launchers
    and tests parse). An exception nothing caught, in the main thread or another, is logged
    too (event=uncaught_exception, its traceback in `exc`) instead of printed raw by Python,
    and so is a Python warning. (What C libraries write to the file descriptor themselves, such
    as gRPC core with GRPC_VERBOSITY set, is not Python's to format.)"""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(LogfmtFormatter())
    logging.basicConfig(level=level, handlers=[handler])
    logging.captureWarnings(True)  # warnings.warn (torch's, e.g.) as py.warnings msg= lines
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda args: _log_uncaught(
        args.exc_type, args.exc_value, args.exc_traceback,
        args.thread.name if args.thread is not None else "")


def _log_uncaught(kind, value, traceback, thread: str = "MainThread") -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, traceback)
        return
    logging.getLogger("uncaught").critical(kv("uncaught_exception", thread=thread),
                                           exc_info=(kind, value, traceback))
