"""The security suite's closing table: after a run, every attack test (test_attack_*) with the
probes it tried and how they were refused, so the counts in a report come from the run itself:

    .venv/bin/python -m pytest tests/security     # also with -n (pytest-xdist)

A probe is one call of `harness.refused`, which fails the test unless the call is refused with
the expected code; an attack test passes only when every probe was refused and the victim's
state was intact afterwards."""
from __future__ import annotations

import collections

import pytest

from tests.security import harness


@pytest.fixture(autouse=True)
def _name_the_probes(request):
    harness.CURRENT_TEST[0] = request.node.nodeid
    yield
    harness.CURRENT_TEST[0] = ""
    # On the teardown report, which pytest-xdist carries from its workers to the summary.
    request.node.user_properties.append(("probes", harness.PROBES.get(request.node.nodeid, [])))


def pytest_terminal_summary(terminalreporter):
    stats = terminalreporter.stats
    reports = [r for key in ("passed", "failed", "error", "") for r in stats.get(key, [])
               if hasattr(r, "nodeid") and "::test_attack_" in r.nodeid]
    passed = {r.nodeid for r in reports if r.when == "call" and r.passed}
    attacks = sorted({r.nodeid for r in reports if r.when == "call"})
    probes = {r.nodeid: dict(r.user_properties).get("probes", []) for r in reports
              if r.when == "teardown"}
    if not attacks:
        return
    write = terminalreporter.write_line
    terminalreporter.section("attacks tried / refused")
    total = 0
    for nodeid in attacks:
        codes = collections.Counter(probes.get(nodeid, []))
        total += sum(codes.values())
        verdict = "refused" if nodeid in passed else "NOT REFUSED"
        detail = ", ".join(f"{n} {c}" for c, n in sorted(codes.items()))
        write(f"{verdict:11} {sum(codes.values()):3} probes ({detail})  {nodeid.split('::')[-1]}")
    refused = sum(1 for a in attacks if a in passed)
    write(f"attacks: {len(attacks)} tried, {refused} refused; probes: {total} refused")
