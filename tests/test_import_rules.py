"""Import rules between the packages, checked in a fresh interpreter.

The gateway image holds neither torch nor the services' packages: every gateway module imports
only `prefixcache` (generated), `prefixcache_client`, `prefixcache_bench`, `service_shell`, the
gateway itself and third-party libraries other than torch. `prefixcache_client` is the torch-free
client of the gRPC contract, importable by anyone without the services."""
from __future__ import annotations

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
