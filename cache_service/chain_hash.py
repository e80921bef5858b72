"""The page hashes of a run of pages (design.md §3), in one call: `chain(parent, data, stride)`.

Why native: a publish hashes every new page (hashes are set at insert, design.md lesson 3), one
chained SHA-256 per page: through hashlib each page costs several Python calls and objects
around two SHA-256 block compressions, so hashing would dominate a publish. The C loop below
feeds each page's padded message to OpenSSL's block compression (the library hashlib itself
uses, with its CPU-specific code), a whole run per call. It is built on first use with the
system C compiler, linked to the libcrypto this process already loaded, and checked against
hashlib before it is trusted.

`configure(mode, kernel_cache)` (the services' --cache-native / PREFIXCACHE_CACHE_NATIVE and
--kernel-cache / PREFIXCACHE_KERNEL_CACHE): auto (the default) uses it when it builds and passes
the check, and otherwise hashlib (the reason is logged once); off always uses hashlib; on fails
loudly when it cannot be used. Builds go to the kernel cache (default
`~/.cache/prefixcache/kernels`) by service_shell/native_build.py, under a name that hashes the
source (csrc/chain_hash.c), the compiler's version and the library's path; concurrent first
builds are safe (temporary file, then rename).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

from prefixcache_client.hash import HASH_BYTES, chain_hashes
from service_shell.native_build import build, default_cache_dir

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "chain_hash.c"

_lock = threading.Lock()
_state: dict[str, Callable[[bytes, bytes, int], bytes] | None] = {}
_settings: dict[str, object] = {"mode": "auto", "kernel_cache": None}  # configure()


def python_chain(parent: bytes, data: bytes, stride: int) -> bytes:
    """The same result through hashlib (prefixcache_client.hash.chain_hashes)."""
    return b"".join(chain_hashes(parent, bytes(data), stride // 4))


def _libcrypto() -> str | None:
    """The libcrypto hashlib loaded into this process (Linux: /proc/self/maps)."""
    import _hashlib  # noqa: F401  (loads libcrypto)
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        path = parts[5] if len(parts) == 6 else ""
        if os.path.basename(path).startswith("libcrypto.so"):
            return path
    return None


def configure(mode: str = "auto", kernel_cache: str | Path | None = None) -> None:
    """The service's settings (--cache-native, --kernel-cache): `mode` auto (the native chain
    when it builds and agrees with hashlib), on (refuse without it) or off (hashlib), and the
    build directory. Before the first hash; the defaults hold until a service calls this."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"chain hash mode {mode!r}: expected auto, on or off")
    with _lock:
        _settings.update(mode=mode, kernel_cache=kernel_cache)
        _state.pop("chain", None)


def _cache_dir() -> Path:
    return Path(_settings["kernel_cache"]) if _settings["kernel_cache"] else default_cache_dir()


def _build(crypto: str) -> Path:
    """The library, linked to this process's libcrypto (service_shell/native_build.py)."""
    return build("prefixcache_chain_hash", [SOURCE], ("-O2", "-shared", "-fPIC"), libs=[crypto],
                 depends_on=crypto, cache_dir=_cache_dir())


def _native() -> Callable[[bytes, bytes, int], bytes]:
    crypto = _libcrypto()
    if crypto is None:
        raise RuntimeError("no libcrypto mapped into this process")
    fn = ctypes.CDLL(str(_build(crypto))).prefixcache_chain_hash
    fn.restype = None
    fn.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_long, ctypes.c_long, ctypes.c_char_p]
    buffer = ctypes.create_string_buffer

    def native_chain(parent: bytes, data: bytes, stride: int) -> bytes:
        pages = len(data) // stride
        out = buffer(pages * HASH_BYTES)
        fn(parent, data, pages, stride, out)
        return out.raw

    # Trusted only once it agrees with hashlib (page sizes 1, 16 and a long one).
    probe = hashlib.sha256(b"prefixcache-chain-hash-check").digest() * 40
    for stride in (4, 64, 1024):
        data = probe[:len(probe) // stride * stride]
        if native_chain(b"\x01" * HASH_BYTES, data, stride) != python_chain(b"\x01" * HASH_BYTES,
                                                                            data, stride):
            raise RuntimeError("the native chain hash disagrees with hashlib")
    return native_chain


def _load() -> Callable[[bytes, bytes, int], bytes]:
    mode = _settings["mode"]
    if mode == "off":
        return python_chain
    try:
        return _native()
    except (ImportError, OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
        if mode == "on":
            raise RuntimeError(f"--cache-native on (PREFIXCACHE_CACHE_NATIVE), but the native chain hash cannot "
                               f"be used: {exc}") from exc
        log.warning("event=chain_hash_fallback reason=%r (hashing pages through hashlib)", exc)
        return python_chain


def chain_function() -> Callable[[bytes, bytes, int], bytes]:
    """chain(parent, data, stride) -> the concatenated 16-byte hashes of data's full pages."""
    fn = _state.get("chain")
    if fn is None:
        with _lock:
            fn = _state.get("chain")
            if fn is None:
                fn = _state["chain"] = _load()
    return fn


def is_native() -> bool:
    return chain_function() is not python_chain
