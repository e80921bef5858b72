"""Import rules between the packages, checked in a fresh interpreter and statically.

The gateway image holds neither torch nor the services' packages: every gateway module imports
only `prefixcache` (generated), `prefixcache_client`, `service_shell`, the gateway itself and
third-party libraries other than torch. `prefixcache_client` is the torch-free client of the gRPC
contract, importable by anyone without the services. The runtime packages hold runtime code only:
none of them imports the benchmark tree (`prefixcache_bench`, which sits above them) or `tests`,
not even inside a function; and no runtime module depends on itself through others (no import
cycle, lazy imports inside functions included). The compute service imports no `cache_service`
module but `cache_service.embedded`, and `pagestore` neither service nor torch (static scans, at
the end)."""
from __future__ import annotations

import ast
import json
import os
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


def import_all(roots: list[str], forbidden: set[str], path: Path | None = None) -> dict:
    """Imports every module of `roots` in a fresh interpreter started in the repository root
    (`path`: a folder searched before it, for planted packages)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(str(p) for p in (path, REPO) if p))
    done = subprocess.run([sys.executable, "-c", _PROBE, ",".join(roots), ",".join(sorted(forbidden))],
                          cwd=REPO, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert not report["already"], f"loaded at interpreter start: {report['already']}"
    return report


# ---- static rules: every import statement of the runtime packages, parsed with ast -----------

# What serves; everything that measures lives in prefixcache_bench, above them.
RUNTIME = ["cache_service", "compute_service", "gateway", "pagestore", "prefixcache_client",
           "service_shell", "stack"]
NEVER_IMPORTED_AT_RUN_TIME = {"prefixcache_bench", "tests"}


def module_files(root: Path, packages: list[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of those of `packages` that exist."""
    found = {}
    for package in packages:
        if (root / package / "__init__.py").is_file():
            for path in sorted((root / package).rglob("*.py")):
                parts = path.relative_to(root).with_suffix("").parts
                found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports_in(name: str, path: Path) -> list[tuple[str, tuple[str, ...], int]]:
    """(module, imported names, line) of every import statement in the file, at module level or
    inside functions, relative imports resolved; not those under `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    type_only = {id(n) for node in ast.walk(tree)
                 if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                 for stmt in node.body for n in ast.walk(stmt)}
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            found += [(alias.name, (), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            found.append((base, tuple(alias.name for alias in node.names), node.lineno))
    return found


def forbidden_imports(root: Path, packages: list[str], forbidden: set[str]) -> list[str]:
    """'file:line imports X' for every import of a `forbidden` top-level package."""
    return [f"{path.relative_to(root)}:{line} imports {module}"
            for name, path in module_files(root, packages).items()
            for module, _, line in imports_in(name, path)
            if module.partition(".")[0] in forbidden]


def import_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports (`from a import b` is an edge to a.b when
    that is a module, else to a's __init__)."""
    files = module_files(root, packages)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        for module, names, _ in imports_in(name, path):
            targets = {f"{module}.{n}" for n in names if f"{module}.{n}" in files}
            if module in files and len(targets) < max(len(names), 1):
                targets.add(module)
            graph[name] |= targets - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = stack[stack.index(node):]
                del stack[stack.index(node):]
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_runtime_packages_never_import_the_bench_or_the_tests():
    assert len(module_files(REPO, RUNTIME)) > 100
    bad = forbidden_imports(REPO, RUNTIME, NEVER_IMPORTED_AT_RUN_TIME)
    assert not bad, "runtime code importing the benchmark tree or the tests:\n" + "\n".join(bad)


def test_no_import_cycle_among_runtime_modules():
    found = cycles(import_graph(REPO, RUNTIME))
    assert not found, "import cycles (each line: modules that import each other, lazy imports " \
                      "included):\n" + "\n".join(", ".join(c) for c in found)


def plant(root: Path, files: dict[str, str]) -> Path:
    """Writes a throwaway package tree under `root` (paths -> source)."""
    for rel, source in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(source))
    return root


def test_the_static_checks_catch_planted_violations(tmp_path):
    """A lazy import of the bench, an import of the tests and a cycle closed by a relative
    import inside a function are all found; a TYPE_CHECKING import is not an import."""
    root = plant(tmp_path, {
        "svc/__init__.py": "",
        "svc/a.py": "from svc import b\nfrom typing import TYPE_CHECKING\n"
                    "if TYPE_CHECKING:\n    import prefixcache_bench.harness\n",
        "svc/b.py": "import svc.sub.c\n",
        "svc/sub/__init__.py": "",
        "svc/sub/c.py": "def late():\n    from .. import a\n    from prefixcache_bench import harness\n",
        "svc/d.py": "from tests.conftest import one_torch_thread\nfrom svc import a\n",
    })
    assert forbidden_imports(root, ["svc"], NEVER_IMPORTED_AT_RUN_TIME) == [
        "svc/d.py:1 imports tests.conftest", "svc/sub/c.py:3 imports prefixcache_bench"]
    assert cycles(import_graph(root, ["svc"])) == [["svc.a", "svc.b", "svc.sub.c"]]
    (root / "svc/sub/c.py").write_text("")
    assert cycles(import_graph(root, ["svc"])) == []


def test_the_probe_catches_a_planted_import(tmp_path):
    """The fresh-interpreter probe names the module that imported a forbidden package."""
    plant(tmp_path, {"planted/__init__.py": "", "planted/one.py": "", "planted/two.py": "",
                     "planted/three.py": "import prefixcache_bench.harness\n"})
    report = import_all(["planted"], {"prefixcache_bench"}, path=tmp_path)
    assert "import planted.three" in report["culprits"]["prefixcache_bench"]
    assert "prefixcache_bench.harness" in report["loaded"]


# ---- the fresh-interpreter probe over the real packages ---------------------------------------

@pytest.mark.parametrize("roots, forbidden", [
    (["gateway", "prefixcache_client"],
     {"torch", "compute_service", "cache_service", "prefixcache_bench", "tests"}),
    (["prefixcache_client"],
     {"torch", "compute_service", "cache_service", "gateway", "stack", "prefixcache_bench", "tests"}),
    (["cache_service", "service_shell", "stack"], {"torch", "prefixcache_bench", "tests"}),
], ids=["gateway", "prefixcache_client", "cache_service+service_shell+stack"])
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
    return [f"{where}: {name}" for where, name in imports_of(root)
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
    assert any(name.startswith(SEAM + ".") for _, name in imports_of(REPO / "compute_service"))


def test_pagestore_imports_neither_service_nor_torch_and_reads_no_environment():
    assert pagestore_violations(REPO / "pagestore") == []
    # And at run time: importing every pagestore module loads none of them.
    report = import_all(["pagestore"], {"torch", "compute_service", "cache_service", "gateway"})
    assert len(report["modules"]) >= 5, report["modules"]
    assert not report["culprits"] and not report["loaded"], report["culprits"]


def test_the_checks_catch_a_planted_violation(tmp_path):
    compute = tmp_path / "compute_service"
    (compute / "engine").mkdir(parents=True)
    (compute / "__main__.py").write_text("from cache_service.embedded import CacheCore\n"
                                         "from cache_service import embedded\n")
    assert cache_service_reached_past_the_seam(compute) == []
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


# What the gateway's feed process must not import: the router and what it brings (the index, the
# shared index's redis client). Its start is on a restarted gateway's way to warm: ~0.5 s with
# them, ~0.2 s without (gateway/core/feed_streams.py).
_ROUTERS_MODULES = ("gateway.core.router", "gateway.core.index", "gateway.core.feeds",
                    "gateway.core.shared_index", "redis")


def test_the_feed_process_starts_without_the_routers_modules():
    probe = ("import json, sys; from gateway.core.feed_process import serve; "
             f"print(json.dumps(sorted(set(sys.modules) & set({list(_ROUTERS_MODULES)!r}))))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                          text=True, timeout=120, check=True)
    assert json.loads(done.stdout) == []
