"""The metric names and label matchers a PromQL expression reads, from a real PromQL parser
(`promql-parser`: GreptimeTeam's Rust port of Prometheus's grammar, Python bindings; dev extra),
and the checks of the dashboard's and the alert rules' queries against what services export."""
from __future__ import annotations

import re

import promql_parser

# Grafana's template variables, as Grafana substitutes them before the query reaches Prometheus.
GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__interval": "1m", "$model": ".*"}
# Series Prometheus makes itself (scrape health), not any service.
SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


def grafana_to_promql(expr: str) -> str:
    for name, value in GRAFANA_VARIABLES.items():
        expr = expr.replace(name, value)
    assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
    return expr


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names its matchers test) of every vector selector in `expr`; the
    parser raises ValueError on anything Prometheus would not parse."""
    found: list[tuple[str, set[str]]] = []

    def visit(node) -> bool:
        if isinstance(node, promql_parser.VectorSelector):
            name = node.name
            labels = {m.name for m in node.matchers.matchers}
            if name is None:  # {__name__="..."}
                names = [m.value for m in node.matchers.matchers if m.name == "__name__"]
                name = names[0] if names else ""
            found.append((name, labels - {"__name__"}))
        return True

    promql_parser.walk(promql_parser.parse(expr), visit, None)
    return found


def problems(expr: str, exported: dict[str, set[str]]) -> list[str]:
    """What in `expr` no service exports: unknown metric names, or matchers on labels the
    metric does not carry (a typo there selects nothing and the panel stays silently empty)."""
    out = []
    for name, labels in selectors(expr):
        if name in SYNTHETIC:
            continue
        if name not in exported:
            close = sorted(n for n in exported if n.split("_")[:3] == name.split("_")[:3])[:3]
            out.append(f"{name}: not exported (close: {close})")
        elif labels - exported[name]:
            out.append(f"{name}: no label {sorted(labels - exported[name])} "
                       f"(has {sorted(exported[name])})")
    return out


DURATION = re.compile(r"^(\d+(ms|s|m|h|d|w|y))+$")
