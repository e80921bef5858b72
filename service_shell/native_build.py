"""Builds a C library with the system compiler on first use, into the kernel cache, and loads it
through ctypes: the one build path of the project's C code (compute_service/kernels/cpu_native.py,
the gateway's page table gateway/core/index_native.py). Torch-free: the gateway imports it.

A library is named `{name}-{code}-{compiler}.so` in the cache directory: `code` hashes the
sources, the flags and anything else the caller says the result depends on (the CPU's model for
-march=native), `compiler` the compiler's `--version`. Concurrent first builds are safe (each
writes a temporary file and renames it). Without a compiler, a library of the same `code` built
earlier by any compiler is loaded: an image builds its libraries at build time (deploy/docker)
and runs without a compiler.

Each library has a mode, auto|on|off (the services' --cpu-native, the gateway's --index-native):
auto loads it when it builds and otherwise logs why once and returns None (the caller's Python
path serves), off never loads it, on raises when it cannot be loaded.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

MODES = ("auto", "on", "off")


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "prefixcache" / "kernels"


def _compiler_version(compiler: str) -> str | None:
    """The compiler's `--version`, or None when there is none."""
    if shutil.which(compiler) is None:
        return None
    return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60,
                          check=True).stdout


def build(name: str, sources: Sequence[Path], flags: Sequence[str], *, libs: Sequence[str] = (),
          depends_on: str = "", cache_dir: Path | None = None) -> Path:
    """The compiled library's path, building it now unless a copy for this code and compiler
    (or, without a compiler, for this code) is in the cache."""
    out_dir = cache_dir or default_cache_dir()
    parts = [p.read_bytes() for p in sources] + [" ".join(flags).encode(), depends_on.encode()]
    code = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    compiler = os.environ.get("CC", "cc")
    version = _compiler_version(compiler)
    if version is None:
        built = sorted(out_dir.glob(f"{name}-{code}-*.so"))
        if built:
            return built[0]
        raise RuntimeError(f"no C compiler ({compiler!r} not found; set CC) and no library "
                           f"{name}-{code}-*.so built earlier in {out_dir}")
    target = out_dir / f"{name}-{code}-{hashlib.sha256(version.encode()).hexdigest()[:8]}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}-", suffix=".so")
    os.close(fd)
    try:
        c_files = [str(p) for p in sources if p.suffix == ".c"]
        done = subprocess.run([compiler, *flags, *c_files, "-o", tmp, *libs],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class NativeLibrary:
    """One C library, its mode and its cache directory; `library()` builds and loads it once.

    `build_args` returns build()'s arguments but the cache directory (called at load time, so
    that a caller may import what its flags need first, e.g. torch before an OpenMP library);
    `signatures` maps each C function to (restype, argtypes); `what` names the library and
    `flag` its mode's flag and variable in messages, `fallback` what serves without it.
    `loader` is ctypes.CDLL (each call releases the GIL: long kernels) or ctypes.PyDLL (calls keep
    it: short ones, which would otherwise wait for the GIL back behind other threads)."""

    def __init__(self, what: str, flag: tuple[str, str], fallback: str,
                 build_args: Callable[[], dict], signatures: dict[str, tuple],
                 loader: type[ctypes.CDLL] = ctypes.CDLL) -> None:
        self.what, self.flag, self.fallback, self._loader = what, flag, fallback, loader
        self._build_args, self._signatures = build_args, signatures
        self._lock = threading.Lock()
        self._state: dict[str, ctypes.CDLL | None] = {}
        self.mode, self.cache_dir = "auto", None
        self.reason = ""  # why it is not loaded (empty when it is, or before the first load)

    def configure(self, mode: str = "auto", cache_dir: str | Path | None = None) -> None:
        """The service's settings; before the first use (the defaults hold until then)."""
        if mode not in MODES:
            raise ValueError(f"{self.what} mode {mode!r}: expected auto, on or off")
        with self._lock:
            self.mode, self.cache_dir = mode, Path(cache_dir) if cache_dir else None
            self._state.pop("lib", None)

    def path(self) -> Path:
        """Builds (unless built) and returns the library's path, whatever the mode."""
        return build(**self._build_args(), cache_dir=self.cache_dir)

    def _load(self) -> ctypes.CDLL | None:
        if self.mode == "off":
            self.reason = f"{self.flag[0]} off"
            return None
        try:
            lib = self._loader(str(self.path()))
            for fn_name, (restype, argtypes) in self._signatures.items():
                fn = getattr(lib, fn_name)
                fn.restype, fn.argtypes = restype, argtypes
        except (OSError, RuntimeError, AttributeError, subprocess.SubprocessError) as exc:
            if self.mode == "on":
                raise RuntimeError(f"{self.flag[0]} on ({self.flag[1]}), but the {self.what} "
                                   f"cannot be built: {exc}") from exc
            self.reason = str(exc)
            log.warning("%s unavailable (%s instead): %s", self.what, self.fallback, exc)
            return None
        self.reason = ""
        return lib

    def library(self) -> ctypes.CDLL | None:
        """The loaded library (built now if needed), or None when off or it cannot be built."""
        if "lib" not in self._state:
            with self._lock:
                if "lib" not in self._state:
                    self._state["lib"] = self._load()
        return self._state["lib"]
