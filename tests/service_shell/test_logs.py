"""Structured log lines: kv(), and every formatted line parses as strict logfmt."""
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from service_shell import kv
from service_shell.logs import LogfmtFormatter
from tests.service_shell.logfmt import parse


def test_structured_log_lines_quote_what_needs_it():
    assert kv("rpc_rejected", method="Step", message="epoch: bad one", n=1.5) == (
        'event=rpc_rejected method=Step message="epoch: bad one" n=1.5')


def test_empty_values_are_quoted():
    assert kv("x", reason="") == 'event=x reason=""'


# ----- every line is logfmt (service_shell.logs.LogfmtFormatter) ------------------------------

TS = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


def _line(message: str, *args, exc: BaseException | None = None) -> str:
    record = logging.LogRecord("cache_service.server", logging.WARNING, __file__, 1, message,
                               args, (type(exc), exc, exc.__traceback__) if exc else None)
    return LogfmtFormatter().format(record)


def test_a_line_starts_with_an_iso_timestamp_level_and_logger():
    fields = parse(_line(kv("server_started", address="127.0.0.1:1", tls="off")))
    assert TS.fullmatch(fields["ts"]), fields
    assert fields == {"ts": fields["ts"], "level": "WARNING", "logger": "cache_service.server",
                      "event": "server_started", "address": "127.0.0.1:1", "tls": "off"}


@pytest.mark.parametrize("value", ["two words", 'a "quote"', "back\\slash", "new\nline",
                                   "cr\rnul\x00", "tab\tdel\x7f", "é ü 漢字", "\u2028", "=",
                                   "", "k=v"])
def test_kv_values_of_any_content_round_trip(value):
    assert parse(_line(kv("e", value=value)))["value"] == value


def test_a_foreign_message_becomes_msg():
    """Libraries (uvicorn, grpc) log plain sentences, some with %-arguments."""
    fields = parse(_line("Started server process [%d] at %s", 42, "x=y z"))
    assert fields["msg"] == "Started server process [42] at x=y z"


def test_a_traceback_stays_on_its_line():
    try:
        raise ValueError("bad\nthing")
    except ValueError as exc:
        line = _line(kv("rpc_failed", method="Step"), exc=exc)
    assert "\n" not in line
    fields = parse(line)
    assert fields["event"] == "rpc_failed"
    assert fields["exc"].startswith("Traceback") and "ValueError: bad\nthing" in fields["exc"]


@pytest.mark.parametrize("line", ["ts=2026-11-24 08:00:00,123 level=INFO",  # the old format
                                  "a=1  b=2", 'a="open', "a=b=c", "word", "a=1 ", "a=\x01"])
def test_the_parser_is_strict(line):
    with pytest.raises(ValueError):
        parse(line)


def test_an_uncaught_exception_is_a_logfmt_line_too():
    """configure_logging routes what Python would print raw (a crash of the main thread or of
    another thread) through the formatter."""
    code = ("import threading\n"
            "from service_shell import configure_logging\n"
            "configure_logging('INFO')\n"
            "t = threading.Thread(target=lambda: 1 / 0, name='worker-1'); t.start(); t.join()\n"
            "import warnings; warnings.warn('careful\\nnow')\n"
            "raise ValueError('two\\nlines')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd=Path(__file__).parents[2])
    assert done.returncode == 1
    lines = [parse(line) for line in done.stderr.splitlines()]
    assert [(f.get("event"), f.get("thread")) for f in lines] == [
        ("uncaught_exception", "worker-1"), (None, None), ("uncaught_exception", "MainThread")]
    assert lines[0]["exc"].endswith("ZeroDivisionError: division by zero")
    assert lines[1]["logger"] == "py.warnings" and "UserWarning: careful\nnow" in lines[1]["msg"]
    assert lines[2]["exc"].endswith("ValueError: two\nlines")
