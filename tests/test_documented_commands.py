"""Every `python -m MODULE` the documentation names still runs: README.md, docs/**/*.md,
deploy/README.md, the READMEs inside the packages and the examples' docstrings. Each module of this
repository named there gets `--help` in a fresh interpreter (two at a time) and must exit 0, so a
moved or renamed module cannot leave a dead command behind."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
COMMAND = re.compile(r"python3? -m ([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*)")


def documents() -> list[Path]:
    found = [REPO / "README.md", REPO / "deploy" / "README.md", *sorted((REPO / "docs").rglob("*.md")),
             *sorted(REPO.glob("*/**/README.md")), *sorted((REPO / "examples").glob("*.py"))]
    def shown(path: Path) -> bool:  # not under tests/, runs/ or a hidden folder (.venv, caches)
        parts = path.relative_to(REPO).parts
        return path.is_file() and not ({"tests", "runs"} & set(parts) or any(p[0] == "." for p in parts))
    return sorted({p for p in found if shown(p)})


def documented_modules() -> dict[str, str]:
    """Module -> the first document naming it; only modules of this repository (placeholders such
    as `python -m prefixcache_bench.sim.TOOL` and third-party modules are left out)."""
    modules: dict[str, str] = {}
    for doc in documents():
        for name in COMMAND.findall(doc.read_text(encoding="utf-8")):
            top, last = name.split(".")[0], name.split(".")[-1]
            if (REPO / top / "__init__.py").is_file() and not last.isupper():
                modules.setdefault(name, str(doc.relative_to(REPO)))
    return modules


def run_help(module: str) -> tuple[str, int, str]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    try:
        done = subprocess.run([sys.executable, "-m", module, "--help"], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return module, -1, "timed out after 120 s"
    return module, done.returncode, (done.stderr or done.stdout)[-2000:]


def test_the_collection_finds_the_documented_tools():
    modules = documented_modules()
    for name in ("cache_service", "compute_service", "gateway", "stack", "prefixcache_bench.pages",
                 "prefixcache_bench.cache", "prefixcache_bench.sim.simulate", "prefixcache_client.hash"):
        assert name in modules, sorted(modules)
    assert "prefixcache_bench.sim.TOOL" not in modules and "pytest" not in modules


def test_every_documented_module_runs_with_help():
    modules = documented_modules()
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(run_help, sorted(modules)))
    failed = [f"python -m {name} --help (named in {modules[name]}): exit {rc}\n{tail}"
              for name, rc, tail in results if rc != 0]
    assert not failed, "\n\n".join(failed)
