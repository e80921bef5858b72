"""The C kernels of `csrc/` (the fp32 CPU GEMM, paged decode attention, the LoRA update), built
on first use with the system C compiler for this machine's CPU, loaded through ctypes.

Why C: on CPU a decode step is a few rows through every weight and every cached key, so its
speed is how close those streams get to the memory bandwidth, and how little runs between them;
`gemm.c` and `decode_attention.c` say how. What the kernels are worth to a decode, measured with
`PREFIXCACHE_CPU_NATIVE` on and off: docs/results/README.md.

Build: `cc -O3 -march=native -fopenmp -shared -fPIC csrc/*.c -lm`, into the kernel cache
(`configure(kernel_cache=)`: the service's --kernel-cache / PREFIXCACHE_KERNEL_CACHE; default `~/.cache/prefixcache/kernels`) under a name that hashes
the sources, the compiler's version and the CPU's model and flags, so a shared home on other
CPUs builds its own copy; concurrent first builds are safe (each writes a temporary file and
renames it). OpenMP in the library is the libgomp torch already loaded (same soname), so its
threads are torch's. `configure(mode)` (the service's --cpu-native / PREFIXCACHE_CPU_NATIVE),
auto|on|off: auto (the default) uses the kernels
when they build, off never does (then oneDNN and the PyTorch path serve), on fails loudly when
they cannot be built. Without a compiler, auto says why once in the log.
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
from pathlib import Path

import torch  # noqa: F401  (loaded first: its libgomp is the one the library binds to)

__all__ = ["enabled", "library"]

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

_c_void_p, _c_long, _c_int, _c_float = ctypes.c_void_p, ctypes.c_long, ctypes.c_int, ctypes.c_float
SIGNATURES = {  # C function -> (restype, argtypes)
    "cpu_gemm": (None, [_c_void_p, _c_long, _c_int, _c_int, _c_void_p, _c_void_p, _c_int,
                        _c_void_p, _c_long, _c_int]),
    "paged_decode_attention": (_c_int, [_c_void_p, _c_void_p, _c_void_p, _c_void_p, _c_long,
                                        _c_void_p, _c_int, _c_int, _c_int, _c_int, _c_int,
                                        _c_float, _c_int, _c_void_p, _c_int]),
    "lora_apply": (_c_int, [_c_void_p, _c_long, _c_void_p, _c_long, _c_int, _c_int, _c_int,
                            _c_void_p, _c_void_p, _c_void_p, _c_void_p, _c_int, _c_int, _c_int]),
}

_lock = threading.Lock()
_state: dict[str, object] = {}  # "lib": the loaded library, or None once a build failed
_settings: dict[str, object] = {"mode": "auto", "kernel_cache": None}  # configure()


def configure(mode: str = "auto", kernel_cache: str | Path | None = None) -> None:
    """The service's settings (--cpu-native, --kernel-cache): `mode` auto (the kernels when they
    build), on (refuse without them) or off (oneDNN and PyTorch), and the build directory. Before
    the first kernel call; the defaults hold until a service (or a benchmark) calls this."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"CPU kernels mode {mode!r}: expected auto, on or off")
    with _lock:
        _settings.update(mode=mode, kernel_cache=kernel_cache)
        _state.pop("lib", None)


def cache_dir() -> Path:
    if _settings["kernel_cache"]:
        return Path(_settings["kernel_cache"])  # type: ignore[arg-type]
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "prefixcache" / "kernels"


def _cpu_identity() -> str:
    """The first CPU's model and flags: what -march=native compiles for."""
    try:
        first = Path("/proc/cpuinfo").read_text().split("\n\n", 1)[0]
    except OSError:
        import platform

        return platform.machine() + platform.processor()
    keep = ("model name", "flags", "Features", "CPU part")
    return "\n".join(line for line in first.splitlines() if line.split(":")[0].strip() in keep)


def sources() -> list[Path]:
    return sorted([*CSRC.glob("*.c"), *CSRC.glob("*.h")])


def build() -> Path:
    """The compiled library's path, building it now unless this machine's copy exists."""
    compiler = os.environ.get("CC", "cc")
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler!r} not found; set CC)")
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    parts = [p.read_bytes() for p in sources()]
    parts += [version.encode(), " ".join(CFLAGS).encode(), _cpu_identity().encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    out_dir = cache_dir()
    target = out_dir / f"prefixcache_kernels-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".prefixcache_kernels-", suffix=".so")
    os.close(fd)
    try:
        c_files = [str(p) for p in sources() if p.suffix == ".c"]
        done = subprocess.run(
            [compiler, *CFLAGS, *c_files, "-o", tmp, "-lm"],
            capture_output=True, text=True, timeout=300,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed: {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> ctypes.CDLL | None:
    mode = _settings["mode"]
    if mode == "off":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        if mode == "on":
            raise RuntimeError(f"--cpu-native on (PREFIXCACHE_CPU_NATIVE), but the kernels cannot "
                               f"be built: {exc}")
        log.warning("CPU C kernels unavailable (oneDNN and the PyTorch path serve): %s", exc)
        return None
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built now if needed), or None when they are off or cannot be built."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                _state["lib"] = _load()
    return _state["lib"]  # type: ignore[return-value]


def enabled() -> bool:
    return library() is not None

