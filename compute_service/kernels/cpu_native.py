"""The C kernels of `csrc/` (the fp32 CPU GEMM, paged decode attention, the LoRA update), built
on first use with the system C compiler for this machine's CPU, loaded through ctypes.

Why C: on CPU a decode step is a few rows through every weight and every cached key, so its
speed is how close those streams get to the memory bandwidth, and how little runs between them;
`gemm.c` and `decode_attention.c` say how. What the kernels are worth to a decode, measured with
`PREFIXCACHE_CPU_NATIVE` on and off: docs/results/README.md.

Build (service_shell/native_build.py, the project's one build path for C): `cc -O3
-march=native -fopenmp -shared -fPIC csrc/*.c -lm`, into the kernel cache (`configure(kernel_cache=)`:
the service's --kernel-cache / PREFIXCACHE_KERNEL_CACHE; default `~/.cache/prefixcache/kernels`)
under a name that hashes the sources, the compiler's version and the CPU's model and flags, so a
shared home on other CPUs builds its own copy; concurrent first builds are safe (each writes a
temporary file and renames it). OpenMP in the library is the libgomp torch already loaded (same soname), so its
threads are torch's. `configure(mode)` (the service's --cpu-native / PREFIXCACHE_CPU_NATIVE),
auto|on|off: auto (the default) uses the kernels
when they build, off never does (then oneDNN and the PyTorch path serve), on fails loudly when
they cannot be built. Without a compiler, auto says why once in the log.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch  # noqa: F401  (loaded first: its libgomp is the one the library binds to)

from service_shell.native_build import NativeLibrary

__all__ = ["enabled", "library"]

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


KERNELS = NativeLibrary(
    "CPU C kernels", ("--cpu-native", "PREFIXCACHE_CPU_NATIVE"), "oneDNN and the PyTorch path",
    lambda: {"name": "prefixcache_kernels", "sources": sources(), "flags": CFLAGS,
             "libs": ["-lm"], "depends_on": _cpu_identity()},
    SIGNATURES)


def configure(mode: str = "auto", kernel_cache: str | Path | None = None) -> None:
    """The service's settings (--cpu-native, --kernel-cache): `mode` auto (the kernels when they
    build), on (refuse without them) or off (oneDNN and PyTorch), and the build directory. Before
    the first kernel call; the defaults hold until a service (or a benchmark) calls this."""
    KERNELS.configure(mode, kernel_cache)


def build() -> Path:
    """The compiled library's path, building it now unless this machine's copy exists."""
    return KERNELS.path()


def library() -> ctypes.CDLL | None:
    """The compiled kernels (built now if needed), or None when they are off or cannot be built."""
    return KERNELS.library()


def enabled() -> bool:
    return library() is not None
