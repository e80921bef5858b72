"""The PREFIXCACHE_* variables the docs list are the ones the services' parsers declare
(service_shell.config.declared_variables), both ways: each documented variable is read by exactly
the services its "read by" column names, and every variable the docs mention is read by some
service."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from cache_service.__main__ import build_parser as cache_parser
from compute_service.flags import build_parser as compute_parser
from gateway.__main__ import build_parser as gateway_parser
from service_shell.config import RENAMED, declared_variables

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("gateway", "compute", "cache")
VARIABLE = re.compile(r"PREFIXCACHE_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_])")  # not a `PREFIX_*` family


@pytest.fixture(scope="module")
def declared() -> dict[str, set[str]]:
    """Variable -> the services whose parser reads it."""
    out: dict[str, set[str]] = {}
    for service, build in (("gateway", gateway_parser), ("compute", compute_parser),
                           ("cache", cache_parser)):
        for name in declared_variables(build()):
            out.setdefault(name, set()).add(service)
    return out


def documented_table() -> dict[str, set[str]]:
    """deploy/README.md's table of variables: variable -> the services of its "read by"."""
    rows: dict[str, set[str]] = {}
    for line in (ROOT / "deploy/README.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`PREFIXCACHE_"):
            continue
        readers = ({*SERVICES} if cells[1] == "all"
                   else {s.strip() for s in cells[1].split(",")})
        assert readers <= set(SERVICES), f"read by {cells[1]!r} in: {line}"
        for name in VARIABLE.findall(cells[0]):
            assert name not in rows, f"{name} twice in deploy/README.md's table"
            rows[name] = readers
    return rows


def mentioned(path: str) -> set[str]:
    return set(VARIABLE.findall((ROOT / path).read_text()))


def test_the_table_parses() -> None:
    table = documented_table()
    assert len(table) > 40 and "PREFIXCACHE_PAGE_SIZE" in table


def test_each_documented_variable_is_read_by_exactly_the_services_named(declared) -> None:
    wrong = {name: (sorted(readers), sorted(declared.get(name, ())))
             for name, readers in documented_table().items()
             if declared.get(name, set()) != readers}
    assert not wrong, "documented read-by vs the parsers' declarations: " + repr(wrong)


@pytest.mark.parametrize("path", ["README.md", "deploy/README.md"])
def test_every_variable_the_docs_mention_is_read_by_a_service(declared, path) -> None:
    # A former name is documented as refused (and check_renamed refuses it).
    assert not mentioned(path) - set(declared) - set(RENAMED), (
        f"{path} names variables no parser reads")


def test_renamed_variables_are_refused(monkeypatch) -> None:
    monkeypatch.setenv("PREFIXCACHE_L3_KEY_PREFIX", "mine")
    with pytest.raises(SystemExit):
        compute_parser()


def test_each_flag_has_one_variable_and_names_it(declared) -> None:
    for build in (gateway_parser, compute_parser, cache_parser):
        parser = build()
        help_text = parser.format_help()
        for name, flag in declared_variables(parser).items():
            assert name in help_text and flag in help_text


# Reads of a PREFIXCACHE_* variable: os.environ.get("PREFIXCACHE_..."), os.getenv(f"PREFIXCACHE_...").
ENV_READ = re.compile(r"""(environ\.get|getenv|environ\[)\(?\s*f?["']PREFIXCACHE_""")
READERS = {"service_shell/config.py"}


def test_only_service_shell_config_reads_the_variables() -> None:
    found = {str(path.relative_to(ROOT))
             for package in ("cache_service", "compute_service", "gateway", "pagestore",
                             "prefixcache_client", "service_shell", "stack")
             for path in (ROOT / package).rglob("*.py") if ENV_READ.search(path.read_text())}
    assert found <= READERS, f"PREFIXCACHE_* read outside service_shell/config.py: {found - READERS}"
