"""Structured log lines."""
from service_shell import kv


def test_structured_log_lines_quote_what_needs_it():
    assert kv("rpc_rejected", method="Step", message="epoch: bad one", n=1.5) == (
        'event=rpc_rejected method=Step message="epoch: bad one" n=1.5')


def test_empty_values_are_quoted():
    assert kv("x", reason="") == 'event=x reason=""'
