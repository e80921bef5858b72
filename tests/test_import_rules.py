"""Import rules between the packages, checked in a fresh interpreter.

The gateway image holds neither torch nor the services' packages: every gateway module imports
only `prefixcache` (generated), `prefixcache_client`, `prefixcache_bench`, `service_shell`, the
gateway itself and third-party libraries other than torch. `prefixcache_client` is the torch-free
client of the gRPC contract, importable by anyone without the services. The compute service
imports no `cache_service` module but `cache_service.embedded`, and `pagestore` neither service
nor torch (static scans, at the end)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Imports every module of `roots` one by one (pkgutil.walk_packages), watching for an import of a
# forbidden top-level package; prints JSON: {forbidden name: what imported it first}.
_PROBE = textwrap.dedent('''
    import importlib, json, pkgutil, sys, traceback

    roots, forbidden = sys.argv[1].split(","), set(sys.argv[2].split(","))
    culprits, importing = {}, [None]

    class Watch:
        """Sees every import before the real finders do; finds nothing itself."""
        def find_spec(self, name, path=None, target=None):
            top = name.partition(".")[0]
            if top in forbidden and top not in culprits:
                frames = [f for f in traceback.extract_stack()[:-1]
                          if "importlib" not in f.filename and not f.filename.startswith("<")]
                where = f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else "?"
                culprits[top] = f"`import {importing[0]}` imported {name} at {where}"
            return None

    already = sorted(m for m in sys.modules if m.partition(".")[0] in forbidden)
    sys.meta_path.insert(0, Watch())
    modules = []
    for root in roots:
        importing[0] = root
        package = importlib.import_module(root)
        modules.append(root)
        for info in pkgutil.walk_packages(package.__path__, root + "."):
            importing[0] = info.name
            importlib.import_module(info.name)
            modules.append(info.name)
    loaded = sorted(m for m in sys.modules if m.partition(".")[0] in forbidden)
    print(json.dumps({"already": already, "modules": modules, "culprits": culprits,
                      "loaded": loaded}))
''')


def import_all(roots: list[str], forbidden: set[str]) -> dict:
    """Imports every module of `roots` in a fresh interpreter started in the repository root."""
    done = subprocess.run([sys.executable, "-c", _PROBE, ",".join(roots), ",".join(sorted(forbidden))],
                          cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["already"], f"loaded at interpreter start: {report['already']}"
    return report


@pytest.mark.parametrize("roots, forbidden", [
    (["gateway", "prefixcache_client"], {"torch", "compute_service", "cache_service"}),
    (["prefixcache_client"], {"torch", "compute_service", "cache_service", "gateway", "stack"}),
], ids=["gateway", "prefixcache_client"])
def test_imports_nothing_forbidden(roots, forbidden):
    report = import_all(roots, forbidden)
    # The walk reached the packages' modules (not just their __init__).
    for root in roots:
        assert sum(m.startswith(root + ".") for m in report["modules"]) >= 3, report["modules"]
    assert not report["culprits"] and not report["loaded"], (
        "forbidden imports:\n" + "\n".join(report["culprits"].values())
        + f"\nmodules loaded: {report['loaded']}")


# ---- the compute service, the cache service's seam and the page store (issue 24) -------------
# A static scan (ast), so a rule holds for every module, imported at start or not: the compute
# service reaches the cache service only through `cache_service.embedded` (the in-process core of
# --cache-service embedded); what both services share lives outside both (`pagestore`,
# `prefixcache_client`). `pagestore` is a library: it imports neither service nor torch, and
# reads no flag and no environment variable (service_shell.redis_flags builds its settings).

SEAM = "cache_service.embedded"
# Moving to prefixcache_bench (benchmarks may use any internal); not the compute service's code.
MOVING_OUT = ("compute_service/bench", "compute_service/bench_tiers")
PAGESTORE_FORBIDDEN = {"cache_service", "compute_service", "gateway", "torch", "argparse"}


def imports_of(root: Path, skip: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(file:line, dotted name) of every absolute import under `root`, but under `skip` (paths
    relative to root's parent): `import a.b` names a.b, `from a.b import c` names a.b.c (c may be
    a module or an attribute: both are what the file reaches into)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        if any(rel == s or rel.startswith(s + "/") for s in skip):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            if isinstance(node, ast.Import):
                out += [(f"{rel}:{node.lineno}", alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                out += [(f"{rel}:{node.lineno}", f"{node.module}.{alias.name}")
                        for alias in node.names]
    return out


def cache_service_reached_past_the_seam(root: Path) -> list[str]:
    """Imports under `root` (compute_service/) of a cache_service module other than the seam."""
    return [f"{where}: {name}" for where, name in imports_of(root, MOVING_OUT)
            if name.partition(".")[0] == "cache_service"
            and name != SEAM and not name.startswith(SEAM + ".")]


def pagestore_violations(root: Path) -> list[str]:
    """Imports under `root` (pagestore/) of a service, the gateway, torch or argparse, and reads
    of the environment (os.environ, os.getenv, os.putenv)."""
    bad = [f"{where}: {name}" for where, name in imports_of(root)
           if name.partition(".")[0] in PAGESTORE_FORBIDDEN]
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
            named = node.attr if isinstance(node, ast.Attribute) else \
                node.id if isinstance(node, ast.Name) else None
            if named in ("environ", "getenv", "putenv", "environb"):
                bad.append(f"{rel}:{node.lineno}: {named}")
    return bad


def test_the_compute_service_imports_only_the_cache_services_seam():
    assert (REPO / "cache_service" / "embedded.py").is_file()
    reached = cache_service_reached_past_the_seam(REPO / "compute_service")
    assert reached == [], (f"the compute service may import only {SEAM} of the cache service:\n"
                           + "\n".join(reached))
    # The scan saw the seam's one import (it is not vacuous).
    assert any(name.startswith(SEAM + ".") for _, name in imports_of(REPO / "compute_service",
                                                                        MOVING_OUT))


def test_pagestore_imports_neither_service_nor_torch_and_reads_no_environment():
    assert pagestore_violations(REPO / "pagestore") == []
    # And at run time: importing every pagestore module loads none of them.
    report = import_all(["pagestore"], {"torch", "compute_service", "cache_service", "gateway"})
    assert len(report["modules"]) >= 5, report["modules"]
    assert not report["culprits"] and not report["loaded"], report["culprits"]


def test_the_checks_catch_a_planted_violation(tmp_path):
    compute = tmp_path / "compute_service"
    (compute / "engine").mkdir(parents=True)
    (compute / "bench_tiers").mkdir()
    (compute / "__main__.py").write_text("from cache_service.embedded import CacheCore\n"
                                         "from cache_service import embedded\n")
    assert cache_service_reached_past_the_seam(compute) == []
    (compute / "bench_tiers" / "cli.py").write_text("from cache_service.core import CacheCore\n")
    assert cache_service_reached_past_the_seam(compute) == []  # moving out: not scanned
    (compute / "engine" / "scheduler.py").write_text(
        "import os\nfrom cache_service.tree import common_pages\nimport cache_service.core\n"
        "from cache_service import l3\n")
    assert cache_service_reached_past_the_seam(compute) == [
        "compute_service/engine/scheduler.py:2: cache_service.tree.common_pages",
        "compute_service/engine/scheduler.py:3: cache_service.core",
        "compute_service/engine/scheduler.py:4: cache_service.l3"]

    store = tmp_path / "pagestore"
    store.mkdir()
    (store / "client.py").write_text("import redis\nfrom pagestore.keys import page_key\n")
    assert pagestore_violations(store) == []
    (store / "payload.py").write_text("import torch\nfrom compute_service.model import X\n"
                                      "import os\nURL = os.environ.get('PREFIXCACHE_REDIS_URL')\n"
                                      "from cache_service.l3 import L3Client\n")
    assert pagestore_violations(store) == [
        "pagestore/payload.py:1: torch", "pagestore/payload.py:2: compute_service.model.X",
        "pagestore/payload.py:5: cache_service.l3.L3Client", "pagestore/payload.py:4: environ"]
