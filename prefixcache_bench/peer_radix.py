#!/usr/bin/env python3
"""Side-by-side benchmark of prefixcache's cache_service index against the peers its users would
otherwise pick: SGLang's RadixCache (required) and vLLM v1's hash-chained BlockPool (optional),
run in one process on the same workloads, page/block size 16.

Longer than 400 lines: this is the peer harness the project was measured with, copied whole so
that its figures stay comparable; only the project driver (`load_project`, the trace's block
tokens and default path) follows the project's modules. How to fetch the peers:
prefixcache_bench/README.md.

    PROJECT/.venv/bin/python peer_radix.py PROJECT SGLANG_SRC [--vllm VLLM_SRC] [--deps DIR]...

PROJECT      a prefixcache checkout whose scripts/setup.sh has run (its .venv has torch, numpy,
             protobuf, and the generated prefixcache/ code).
SGLANG_SRC   a directory holding the sglang/ package (an unpacked wheel, or the repository's
             python/ folder), or a .whl file (`pip download --no-deps sglang==X`). Only
             sglang/srt/mem_cache/radix_cache.py and the few modules it needs are loaded, from the
             files, without running any package __init__; imports that are irrelevant to the tree
             (allocators, metrics, kernels, server args) are replaced by stubs. Tested: 0.5.23.
--vllm       the same for vLLM (vllm/v1/core/{kv_cache_utils,block_pool}.py,
             vllm/utils/hashing.py, vllm/distributed/kv_events.py). Needs cbor2, msgspec, pyzmq and
             urllib3 importable (e.g. `pip install --target DIR ...` and --deps DIR). Tested: 0.33.0.

Implementations (all embedded, no network):
  project-pool  cache_service.pool.Pool: match, allocate, publish, release, take_events (the
                events are built, as the core does every call); `last_match` is reset before each
                match, as CacheCore.step does (one match per step).
  project-core  cache_service.core.CacheCore.step: three Steps per request (match with packed
                tokens and omit_page_hashes, as the engine sends it; allocate; publish+release).
  sglang        RadixCache (LRU, events off: its default) driven the way the scheduler drives it:
                match_prefix(RadixKey(tokens, limit=n-1)), inc_lock_ref, path_device_indices,
                allocate (evict(...) first when short), insert(page-aligned key, value copy), free
                the duplicate and unaligned-tail slots, dec_lock_ref. The token-to-KV allocator is a
                stand-in (free page list, int64 slot tensors), not SGLang's.
  vllm          BlockPool + the request block hasher (sha256 over pickle, vLLM's default), driven
                the way KVCacheManager drives it: hash the request, look up the longest run of
                cached blocks (at most (n-1)//16), touch, get_new_blocks, cache_full_blocks,
                free_blocks(reversed). `vllm+events` is the same with enable_kv_cache_events.

Metrics: match+release of a fully cached 4,096-token prompt (255 pages; 63 siblings share its first
1,024 tokens), the request lifecycle of a 4,096-token prompt sharing 1,024 tokens with a cached one
(insert = publish / insert / cache_full_blocks), replay of the Mooncake conversation trace at a
fixed capacity (ops/s over the timed cache calls, wall and thread CPU time; hit ratio), and index
memory per cached page (tracemalloc, each implementation in its own child process).

Fairness: in each repetition the implementations run one after the other (order rotated), each
on a fresh heap, with the modules' own objects frozen out of the garbage collector (each service
would have its own process); only the cache calls are timed, never building the prompt or
converting it to an implementation's input. Each part runs --reps times; medians are reported,
and the ratios project/peer are medians of the per-repetition ratios. On a shared machine prefer
the CPU-time figures (cpu_*, --phase-clock cpu).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import itertools
import json
import logging
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import types
import zipfile
from itertools import islice
from pathlib import Path
from types import SimpleNamespace
from unittest import mock

PAGE = 16
SEED = 20240611
VOCAB = 128_000
perf = time.perf_counter
clock = time.perf_counter  # the per-phase clock (--phase-clock cpu: time.thread_time)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- loading one module of a big package from its files --------------------------------------

class _StubModule(types.ModuleType):
    """Any attribute is a MagicMock: for imports that the code under test never really uses."""

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        value = mock.MagicMock(name=f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _ShellLoader(importlib.abc.Loader):
    def __init__(self, stub: bool, attrs: dict | None):
        self.stub, self.attrs = stub, attrs or {}

    def create_module(self, spec):
        module = _StubModule(spec.name) if self.stub else types.ModuleType(spec.name)
        module.__dict__.update(self.attrs)
        return module

    def exec_module(self, module):
        pass


class IsoFinder(importlib.abc.MetaPathFinder):
    """Imports `top.*` file by file from `root`: packages are empty shells (no __init__ runs),
    names in `stubs` or under `prefixes` are stub modules (with the given attributes)."""

    def __init__(self, root: str, top: str, stubs: dict, prefixes: tuple):
        self.root, self.top, self.stubs, self.prefixes = root, top, stubs, prefixes

    def find_spec(self, name, path, target=None):
        if name in self.stubs or (self.prefixes and name.startswith(self.prefixes)):
            return importlib.machinery.ModuleSpec(
                name, _ShellLoader(True, self.stubs.get(name)), is_package=True)
        if name != self.top and not name.startswith(self.top + "."):
            return None
        base = os.path.join(self.root, *name.split("."))
        if os.path.isdir(base):
            spec = importlib.machinery.ModuleSpec(name, _ShellLoader(False, None), is_package=True)
            spec.submodule_search_locations = [base]
            return spec
        if os.path.isfile(base + ".py"):
            return importlib.util.spec_from_file_location(name, base + ".py")
        return None


def load_isolated(root: str, top: str, modules: list[str], stubs: dict, prefixes: list[str],
                  real: set[str], tries: int = 40) -> tuple[list, dict, list]:
    """Imports `modules`; each import error names a module, which is stubbed and the import
    retried (never one of `real`). Returns the modules and the stubs that were needed."""
    stubs, prefixes = dict(stubs), list(prefixes)
    for _ in range(tries):
        finder = IsoFinder(root, top, stubs, tuple(prefixes))
        sys.meta_path.insert(0, finder)
        try:
            return [importlib.import_module(m) for m in modules], stubs, prefixes
        except ImportError as exc:
            sys.meta_path.remove(finder)
            for name in [n for n in sys.modules if n == top or n.startswith(top + ".")]:
                del sys.modules[name]
            missing = exc.name
            if not missing or missing in real:
                raise
            head = missing.split(".")[0]
            if head != top:  # a third-party package that is not installed
                stubs[head] = {}
                prefixes.append(head + ".")
            else:
                stubs[missing] = stubs.get(missing) or {}
            log(f"  stub {missing} ({exc})")
    raise RuntimeError(f"could not import {modules} from {root}")


def source_root(path: str, package: str, members: tuple[str, ...] = ()) -> str:
    """A directory holding `package/`: `path` itself, or a wheel unpacked to a temp dir."""
    p = Path(path)
    if p.is_file() and p.suffix == ".whl":
        out = Path(tempfile.mkdtemp(prefix=f"peer-{package}-"))
        with zipfile.ZipFile(p) as whl:
            names = [n for n in whl.namelist() if n.startswith(package + "/")
                     and n.endswith(".py") and (not members or n.startswith(members))]
            whl.extractall(out, names)
        return str(out)
    if (p / package).is_dir():
        return str(p)
    if (p / "python" / package).is_dir():
        return str(p / "python")
    raise SystemExit(f"{path}: no {package}/ package here (nor under python/), and not a .whl")


def package_version(root: str, package: str) -> str:
    for meta in Path(root).glob(f"{package}-*.dist-info/METADATA"):
        for line in meta.read_text(errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.split(":", 1)[1].strip()
    for rel in ("_version.py", "version.py"):
        f = Path(root, package, rel)
        if f.is_file():
            scope: dict = {"__name__": f"{package}.{rel[:-3]}"}
            with contextlib.suppress(Exception):
                exec(compile(f.read_text(), str(f), "exec"), scope)  # noqa: S102 (version file)
                for key in ("__version__", "version"):
                    if isinstance(scope.get(key), str):
                        return scope[key]
    return "unknown"


SGLANG_STUBS = {
    "sglang.srt.mem_cache.allocator": {},
    "sglang.srt.mem_cache.memory_pool": {},
    "sglang.srt.utils": {},
    "sglang.srt.utils.common": {"ceil_align": lambda x, a: -(-x // a) * a},
    "sglang.srt.runtime_context": {},
    "sglang.srt.observability.metrics_collector": {},
}
SGLANG_REAL = {"sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.base_prefix_cache",
               "sglang.srt.mem_cache.cache_init_params", "sglang.srt.mem_cache.evict_policy",
               "sglang.srt.mem_cache.utils", "sglang.srt.mem_cache.events"}
VLLM_STUBS = {
    "vllm.logger": {"init_logger": logging.getLogger},
    "vllm.config": {},
    "vllm.multimodal.utils": {},
    "vllm.v1.request": {},
    "vllm.v1.kv_cache_interface": {},
    "vllm.v1.kv_cache_spec_registry": {},
    "vllm.v1.utils": {},
    "vllm.v1.metrics.stats": {},
}
VLLM_REAL = {"vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool", "vllm.utils.hashing",
             "vllm.distributed.kv_events"}


def load_sglang(src: str) -> SimpleNamespace:
    import torch
    torch.set_num_threads(1)  # tree values are tiny CPU tensors here: no intra-op threads
    root = source_root(src, "sglang", ("sglang/srt/", "sglang/version.py", "sglang/_version.py"))
    (rc, bpc, cip), stubs, prefixes = load_isolated(
        root, "sglang", ["sglang.srt.mem_cache.radix_cache", "sglang.srt.mem_cache.base_prefix_cache",
                         "sglang.srt.mem_cache.cache_init_params"],
        SGLANG_STUBS, ["sglang.kernels."], SGLANG_REAL)
    if not hasattr(bpc, "MatchPrefixParams"):
        raise SystemExit("this harness drives the 0.5.x RadixCache API (MatchPrefixParams, "
                         "InsertParams, CacheInitParams); older versions are not supported")
    return SimpleNamespace(rc=rc, bpc=bpc, cip=cip, version=package_version(root, "sglang"),
                           stubs=sorted(stubs) + prefixes)


def load_vllm(src: str) -> SimpleNamespace:
    root = source_root(src, "vllm")
    (ku, bp, hashing, kve), stubs, prefixes = load_isolated(
        root, "vllm", ["vllm.v1.core.kv_cache_utils", "vllm.v1.core.block_pool",
                       "vllm.utils.hashing", "vllm.distributed.kv_events"],
        VLLM_STUBS, [], VLLM_REAL)
    return SimpleNamespace(ku=ku, bp=bp, hashing=hashing, kve=kve,
                           version=package_version(root, "vllm"), stubs=sorted(stubs) + prefixes)


# ---- the implementations ------------------------------------------------------------------------
#
# prep(np.uint32 tokens) -> the implementation's native input (not timed)
# serve(native, n, t) -> hit pages; adds per-phase seconds to dict t (match, alloc, insert,
#                        release, and hash/events where they exist); None when allocation failed
# match_release(native, n, with_hash) -> matched pages (the match metric)
# cached_pages()

def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class ProjectPool:
    name = "project-pool"

    def __init__(self, proj: SimpleNamespace, capacity_pages: int):
        self.pool = proj.Pool(proj.PoolConfig("peer", 1, PAGE, capacity_pages, 0, 0, "peer-model",
                                              600.0), 1, time.monotonic)
        self.ids = 0

    def prep(self, tokens):
        return tokens.astype("<u4").tobytes()

    def serve(self, data, n, t):
        pool = self.pool
        self.ids += 1
        lid = f"l{self.ids}"
        t0 = clock()
        pool.last_match = None  # CacheCore.step resets it: one match per step
        hit = len(pool.match("r", lid, "", "", data, 600.0, False, False).device_pages)
        lease = pool.leases[lid]
        t1 = clock()
        need = ceil_div(n, PAGE) - hit
        ok = need <= 0 or pool.allocate(lease, need).ok
        t2 = clock()
        if ok:
            pool.publish(lease, b"", n // PAGE)
        t3 = clock()
        pool.release(lease)
        t4 = clock()
        pool.take_events()
        t5 = clock()
        t["match"] += t1 - t0
        t["alloc"] += t2 - t1
        t["insert"] += t3 - t2
        t["release"] += t4 - t3
        t["events"] += t5 - t4
        return hit if ok else None

    def match_release(self, data, n, with_hash=False):
        self.ids += 1
        lid = f"l{self.ids}"
        self.pool.last_match = None
        hit = len(self.pool.match("r", lid, "", "", data, 600.0, False, False).device_pages)
        self.pool.release(self.pool.leases[lid])
        return hit

    def cached_pages(self):
        return sum(self.pool.cached.values())


class ProjectCore:
    name = "project-core"

    def __init__(self, proj: SimpleNamespace, capacity_pages: int):
        self.pb = proj.pb
        self.core = proj.CacheCore()
        self.core.register_pool(self.pb.RegisterPoolRequest(
            pool_id="peer", epoch=1, page_size=PAGE, device_pages=capacity_pages, host_pages=0,
            model_id="peer-model", lease_ttl_s=600))

    def prep(self, tokens):
        pb = self.pb
        return pb.StepRequest(pool_id="peer", epoch=1, matches=[pb.MatchOp(
            request_id="r", packed_token_ids=tokens.astype("<u4").tobytes(), omit_page_hashes=True)])

    def serve(self, req, n, t):
        pb, step = self.pb, self.core.step
        t0 = clock()
        m = step(req).matches[0]
        hit = len(m.device_pages)
        t1 = clock()
        need = ceil_div(n, PAGE) - hit
        ok = need <= 0 or step(pb.StepRequest(pool_id="peer", epoch=1, allocations=[pb.AllocateOp(
            lease_id=m.lease_id, num_pages=need)])).allocations[0].ok
        t2 = clock()
        step(pb.StepRequest(pool_id="peer", epoch=1,
                            publishes=[pb.PublishOp(lease_id=m.lease_id, computed_pages=n // PAGE)]
                            if ok else [], releases=[pb.ReleaseOp(lease_id=m.lease_id)]))
        t3 = clock()
        t["match"] += t1 - t0
        t["alloc"] += t2 - t1
        t["insert"] += t3 - t2  # publish + release + events: one Step
        return hit if ok else None

    def match_release(self, req, n, with_hash=False):
        m = self.core.step(req).matches[0]
        self._pending_release = m.lease_id
        return len(m.device_pages)

    def after_match(self):
        """The release of the last match_release, outside the timed region (as the bench)."""
        pb = self.pb
        self.core.step(pb.StepRequest(pool_id="peer", epoch=1,
                                      releases=[pb.ReleaseOp(lease_id=self._pending_release)]))

    def cached_pages(self):
        pool = self.core._pools["peer"]  # noqa: SLF001 (measuring)
        return sum(pool.cached.values())


class FakePagedAllocator:
    """Stands in for SGLang's paged token-to-KV allocator: a free list of pages; KV indices are
    token slots page * P + offset, as int64 tensors (SGLang keeps them on the device)."""

    device = "cpu"

    def __init__(self, pages: int, page_size: int):
        import torch
        self.torch, self.page_size = torch, page_size
        self.free_pages = list(range(pages, 0, -1))  # page 0 is padding, as in SGLang
        self.offsets = torch.arange(page_size, dtype=torch.int64)

    def available_pages(self) -> int:
        return len(self.free_pages)

    def alloc(self, n_tokens: int):
        n = ceil_div(n_tokens, self.page_size)
        if n > len(self.free_pages):
            return None
        free = self.free_pages
        pages = free[-n:]  # a slice, as SGLang slices its free-page tensor
        del free[-n:]
        slots = self.torch.tensor(pages, dtype=self.torch.int64)[:, None] * self.page_size
        return (slots + self.offsets).reshape(-1)[:n_tokens]

    def free_segment(self, indices, start_pos: int = 0) -> None:
        # Every segment freed here starts on a page boundary (tree values, duplicates and the
        # unaligned tail are page-aligned), so one slot per page names the pages: cheaper than
        # SGLang's torch.unique, which on CPU tensors would dominate the whole request.
        if len(indices):
            self.free_pages.extend((indices[::self.page_size] // self.page_size).tolist())

    free = free_segment


class SGLang:
    name = "sglang"

    def __init__(self, sg: SimpleNamespace, capacity_pages: int):
        import torch
        self.torch, self.sg = torch, sg
        self.alloc = FakePagedAllocator(capacity_pages, PAGE)
        params = sg.cip.CacheInitParams(disable=False, req_to_token_pool=None,
                                        token_to_kv_pool_allocator=self.alloc, page_size=PAGE)
        self.tree = sg.rc.RadixCache(params)
        self.RadixKey, self.MatchPrefixParams = sg.rc.RadixKey, sg.bpc.MatchPrefixParams
        self.InsertParams, self.EvictParams = sg.bpc.InsertParams, sg.bpc.EvictParams

    def prep(self, tokens):
        import array
        return array.array("q", tokens.tolist())  # Req.origin_input_ids is array("q")

    def serve(self, arr, n, t):
        tree, alloc, torch = self.tree, self.alloc, self.torch
        t0 = clock()
        m = tree.match_prefix(self.MatchPrefixParams(key=self.RadixKey(arr, None, limit=n - 1)))
        hit, node = m.device_prefix_len, m.last_device_node
        tree.inc_lock_ref(node)
        prefix = tree.path_device_indices(node)
        t1 = clock()
        new = alloc.alloc(n - hit)
        if new is None:
            short = ceil_div(n - hit, PAGE) - alloc.available_pages()
            tree.evict(self.EvictParams(num_tokens=short * PAGE))
            new = alloc.alloc(n - hit)
        if new is None:
            tree.dec_lock_ref(node)
            t["alloc"] += clock() - t1
            return None
        kv = torch.cat([prefix, new])
        t2 = clock()
        full = n // PAGE * PAGE
        res = tree.insert(self.InsertParams(key=self.RadixKey(arr, None, limit=full),
                                            value=kv[:full].clone()))
        alloc.free_segment(kv[hit:res.prefix_len])  # pages the tree already had
        t3 = clock()
        tree.dec_lock_ref(node)
        alloc.free_segment(kv[full:])  # the unaligned tail's page
        t4 = clock()
        t["match"] += t1 - t0
        t["alloc"] += t2 - t1
        t["insert"] += t3 - t2
        t["release"] += t4 - t3
        return hit // PAGE

    def match_release(self, arr, n, with_hash=False):
        tree = self.tree
        m = tree.match_prefix(self.MatchPrefixParams(key=self.RadixKey(arr, None, limit=n - 1)))
        tree.inc_lock_ref(m.last_device_node)
        tree.path_device_indices(m.last_device_node)
        tree.dec_lock_ref(m.last_device_node)
        return m.device_prefix_len // PAGE

    def cached_pages(self):
        return (self.tree.evictable_size() + self.tree.protected_size()) // PAGE


class VLLM:
    name = "vllm"

    def __init__(self, vl: SimpleNamespace, capacity_pages: int, events: bool = False):
        if events:
            self.name = "vllm+events"
        ku = vl.ku
        ku.init_none_hash(vl.hashing.sha256)
        self.hasher = ku.get_request_block_hasher(PAGE, vl.hashing.sha256)
        # +1: block 0 is vLLM's null block
        self.pool = vl.bp.BlockPool(capacity_pages + 1, True, PAGE, enable_kv_cache_events=events)

    def prep(self, tokens):
        return tokens.tolist()  # Request.all_token_ids

    def _request(self, toks, n):
        return SimpleNamespace(block_hashes=[], num_tokens=n, mm_features=[], all_token_ids=toks,
                               lora_request=None, cache_salt=None, prompt_embeds=None,
                               session_id=None)

    def _lookup(self, hashes, n):
        get = self.pool.get_cached_block
        computed = []
        for h in islice(hashes, (n - 1) // PAGE):
            blocks = get(h, [0])
            if not blocks:
                break
            computed.append(blocks[0])
        return computed

    def serve(self, toks, n, t):
        pool = self.pool
        t0 = clock()
        req = self._request(toks, n)
        req.block_hashes.extend(self.hasher(req))
        t1 = clock()
        computed = self._lookup(req.block_hashes, n)
        t2 = clock()
        need = ceil_div(n, PAGE) - len(computed)
        if need > pool.get_num_free_blocks() - sum(1 for b in computed if b.ref_cnt == 0):
            t["alloc"] += clock() - t2
            return None
        pool.touch(computed)
        blocks = computed + pool.get_new_blocks(need)
        t3 = clock()
        pool.cache_full_blocks(req, blocks, len(computed), n // PAGE, PAGE, 0)
        t4 = clock()
        pool.free_blocks(reversed(blocks))
        t5 = clock()
        pool.take_events()
        t6 = clock()
        t["hash"] += t1 - t0
        t["match"] += t2 - t1
        t["alloc"] += t3 - t2
        t["insert"] += t4 - t3
        t["release"] += t5 - t4
        t["events"] += t6 - t5
        return len(computed)

    def match_release(self, toks, n, with_hash=False):
        if with_hash:
            req = self._request(toks, n)
            req.block_hashes.extend(self.hasher(req))
            hashes = req.block_hashes
        else:
            hashes = self._hashes_cache
        computed = self._lookup(hashes, n)
        self.pool.touch(computed)
        self.pool.free_blocks(reversed(computed))
        return len(computed)

    def precompute(self, toks, n):
        req = self._request(toks, n)
        req.block_hashes.extend(self.hasher(req))
        self._hashes_cache = req.block_hashes

    def cached_pages(self):
        return len(self.pool.cached_block_hash_to_block)


# ---- the project ----------------------------------------------------------------------------------

def load_project(path: str) -> SimpleNamespace:
    root = str(Path(path).resolve())
    sys.path.insert(0, root)
    from prefixcache_bench.cache import workloads
    from cache_service.core import CacheCore
    from cache_service.pool import Pool, PoolConfig
    from prefixcache.v1 import cache_service_pb2 as pb
    commit = subprocess.run(["git", "-C", root, "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip()
    return SimpleNamespace(root=root, bench=workloads, CacheCore=CacheCore, Pool=Pool,
                           PoolConfig=PoolConfig, pb=pb, commit=commit)


def make(kind: str, ctx: SimpleNamespace, capacity_pages: int):
    if kind == "project-pool":
        return ProjectPool(ctx.proj, capacity_pages)
    if kind == "project-core":
        return ProjectCore(ctx.proj, capacity_pages)
    if kind == "sglang":
        return SGLang(ctx.sg, capacity_pages)
    if kind == "vllm":
        return VLLM(ctx.vl, capacity_pages)
    if kind == "vllm+events":
        return VLLM(ctx.vl, capacity_pages, events=True)
    raise ValueError(kind)


def new_phases() -> dict:
    return dict.fromkeys(("hash", "match", "alloc", "insert", "release", "events"), 0.0)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


# ---- workloads -------------------------------------------------------------------------------------

def rotated(kinds: list[str], rep: int) -> list[str]:
    k = rep % len(kinds)
    return kinds[k:] + kinds[:k]


def fresh() -> None:
    """Between implementations: drop the last one's objects, so that the garbage collector of
    the next one scans only its own heap (as in its own process)."""
    gc.collect()


def bench_match(ctx, kinds, iters: int, warmup: int, rep: int) -> dict:
    """Per implementation: p50/p99 µs of match+release of a fully cached 4,096-token prompt.
    Implementations run one after the other (order rotated per rep), each on a fresh heap."""
    import numpy as np
    rng = np.random.default_rng(SEED + rep)
    prompt = rng.integers(0, VOCAB, 4096, dtype=np.uint32)
    siblings = [np.concatenate([prompt[:1024], rng.integers(0, VOCAB, 3072, dtype=np.uint32)])
                for _ in range(63)]
    out = {}
    for kind in rotated(kinds, rep):
        impl = make(kind, ctx, 257 * 66)
        for s in [prompt, *siblings]:
            if impl.serve(impl.prep(s), len(s), new_phases()) is None:
                raise RuntimeError(f"{kind}: fill failed")
        native = impl.prep(prompt)
        variants = [(kind, False)]
        if isinstance(impl, VLLM):
            impl.precompute(native, 4096)
            variants.append((kind + " (+hash)", True))
        fresh()
        for name, with_hash in variants:
            samples, cpu = [], []
            for i in range(warmup + iters):
                t0, c0 = perf(), time.thread_time()
                pages = impl.match_release(native, 4096, with_hash)
                dt, dc = perf() - t0, time.thread_time() - c0
                if isinstance(impl, ProjectCore):
                    impl.after_match()
                if pages != 255:
                    raise RuntimeError(f"{name}: matched {pages} pages, expected 255")
                if i >= warmup:
                    samples.append(dt)
                    cpu.append(dc)
            out[name] = {"p50_us": pct(samples, 0.5) * 1e6, "p99_us": pct(samples, 0.99) * 1e6,
                         "cpu_p50_us": pct(cpu, 0.5) * 1e6, "cpu_p99_us": pct(cpu, 0.99) * 1e6}
        del impl, native
        fresh()
    return out


def bench_insert(ctx, kinds, iters: int, warmup: int, rep: int) -> dict:
    """Per implementation: a 4,096-token prompt whose first 1,024 tokens are cached (64 pages hit,
    192 inserted), a new one each time, no eviction: p50/p99 µs of the insert call alone, of the
    insert with the hashing and event building it implies, and of the whole request."""
    import numpy as np
    rng = np.random.default_rng(SEED + 100 + rep)
    base = rng.integers(0, VOCAB, 4096, dtype=np.uint32)
    prompts = [np.concatenate([base[:1024], rng.integers(0, VOCAB, 3072, dtype=np.uint32)])
               for _ in range(warmup + iters)]
    out = {}
    for kind in rotated(kinds, rep):
        impl = make(kind, ctx, 257 * (len(prompts) + 4))
        impl.serve(impl.prep(base), 4096, new_phases())
        natives = [impl.prep(p) for p in prompts]
        fresh()
        r = {"insert": [], "insert+hash+events": [], "total": [], "total_cpu": []}
        for i, native in enumerate(natives):
            t = new_phases()
            c0 = time.thread_time()
            hit = impl.serve(native, 4096, t)
            dc = time.thread_time() - c0
            if hit != 64:
                raise RuntimeError(f"{impl.name}: hit {hit} pages, expected 64")
            if i >= warmup:
                r["insert"].append(t["insert"])
                r["insert+hash+events"].append(t["insert"] + t["hash"] + t["events"])
                r["total"].append(sum(t.values()))
                r["total_cpu"].append(dc)
        out[impl.name] = {f"{k}_{q}_us": pct(v, p) * 1e6 for k, v in r.items()
                          for q, p in (("p50", 0.5), ("p99", 0.99))}
        del impl, natives
        fresh()
    return out


def bench_trace(ctx, kinds, trace, capacity_tokens: int, rep: int) -> dict:
    """Replays the trace through each implementation in turn (order rotated per rep, fresh heap
    each), `capacity_tokens` of device pages each. Times only the cache calls (building the
    prompt and converting it to the implementation's input are not timed)."""
    import numpy as np
    bench = ctx.proj.bench
    pages = capacity_tokens // PAGE
    blocks = bench.BlockCache(VOCAB)
    prompt_tokens = sum(n for n, _ in trace)
    out = {}
    for kind in rotated(kinds, rep):
        impl = make(kind, ctx, pages)
        fresh()
        wall = cpu = 0.0
        hits = failed = 0
        phases = new_phases()
        started = perf()
        for n, ids in trace:
            native = impl.prep(np.concatenate([blocks(h) for h in ids])[:n])
            w0, c0 = perf(), time.thread_time()
            hit = impl.serve(native, n, phases)
            wall += perf() - w0
            cpu += time.thread_time() - c0
            if hit is None:
                failed += 1
            else:
                hits += hit * PAGE
        log(f"    {kind}: {perf() - started:.0f} s")
        out[kind] = {
            "ops_per_s": len(trace) / wall, "cpu_ops_per_s": len(trace) / cpu,
            "hit_ratio": hits / prompt_tokens, "failed": failed,
            "cached_pages_end": impl.cached_pages(),
            "phase_ms_per_request": {k: v / len(trace) * 1e3 for k, v in phases.items() if v},
        }
        del impl
        fresh()
    return out


def chat_prompts(seed: int):
    """Multi-turn chats over 32 Zipf-picked system prompts (the project's memory workload)."""
    import numpy as np
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, int(rng.integers(256, 2049)), dtype=np.uint32) for _ in range(32)]
    w = np.array([1 / (i + 1) for i in range(32)])
    w /= w.sum()
    while True:
        history = systems[int(rng.choice(32, p=w))]
        for _ in range(int(rng.integers(1, 7))):
            prompt = np.concatenate([history, rng.integers(0, VOCAB, int(rng.integers(64, 1025)),
                                                           dtype=np.uint32)])
            yield prompt
            history = np.concatenate([prompt, rng.integers(0, VOCAB, int(rng.integers(64, 513)),
                                                           dtype=np.uint32)])


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_child(ctx, kind: str, target_pages: int) -> dict:
    """Index bytes per cached page: tracemalloc growth while filling with chats (no eviction),
    over the pages cached; plus the empty structure per capacity page, and RSS growth."""
    capacity = target_pages + 65_536
    prompts = chat_prompts(SEED + 4)
    first = next(prompts)  # the workload's own arrays exist before the baseline
    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    impl = make(kind, ctx, capacity)
    gc.collect()
    base = tracemalloc.get_traced_memory()[0]
    rss1 = rss_bytes()
    requests = 0
    for prompt in itertools.chain([first], prompts):
        native = impl.prep(prompt)
        impl.serve(native, len(prompt), new_phases())
        del native
        requests += 1
        if requests % 64 == 0 and impl.cached_pages() >= target_pages:
            break
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    rss2 = rss_bytes()
    cached = impl.cached_pages()
    out = {"cached_pages": cached, "requests": requests,
           "bytes_per_page": (after - base) / cached,
           "empty_bytes_per_capacity_page": (base - before) / capacity,
           "rss_growth_per_page": (rss2 - rss1) / cached, "rss_empty": rss1 - rss0}
    if isinstance(impl, SGLang):
        # Node values are torch tensors: their storage is not seen by tracemalloc (on a GPU
        # server it is device memory). Counted here as nbytes, before any allocator rounding.
        stack, storage, nodes = [impl.tree.root_node], 0, 0
        while stack:
            node = stack.pop()
            nodes += 1
            if node is not impl.tree.root_node and node.value is not None:
                storage += node.value.untyped_storage().nbytes()
            stack.extend(node.children.values())
        out["tensor_storage_bytes_per_page"] = storage / cached
        out["tree_nodes"] = nodes - 1
    return out


# ---- the run -----------------------------------------------------------------------------------------

def median(xs):
    return statistics.median(xs) if xs else float("nan")


def summarize(reps: list[dict], metric: str, proj: str, peers: list[str]) -> dict:
    """Median per implementation of `metric`, and median of per-rep ratios project/peer."""
    names = list(reps[0])
    out = {"median": {n: median([r[n][metric] for r in reps]) for n in names}, "ratio": {}}
    for peer in peers:
        if peer in names and proj in names:
            ratios = [r[proj][metric] / r[peer][metric] for r in reps]
            out["ratio"][f"{proj}/{peer}"] = median(ratios)
    return out


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("project", help="prefixcache checkout (setup done)")
    ap.add_argument("sglang", help="sglang source dir (holding sglang/) or .whl")
    ap.add_argument("--vllm", help="vllm source dir (holding vllm/) or .whl")
    ap.add_argument("--deps", action="append", default=[],
                    help="extra sys.path entry (vLLM needs cbor2, msgspec, pyzmq, urllib3)")
    ap.add_argument("--trace", help="default: PROJECT/prefixcache_bench/traces/conversation_trace.jsonl")
    ap.add_argument("--trace-requests", type=int, help="first N requests (default all)")
    ap.add_argument("--capacity-tokens", type=int, default=1_000_000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--trace-reps", type=int)
    ap.add_argument("--trace-kinds", help="implementations replaying the trace (default: all)")
    ap.add_argument("--match-iters", type=int, default=2000)
    ap.add_argument("--insert-iters", type=int, default=400)
    ap.add_argument("--mem-pages", type=int, default=50_000)
    ap.add_argument("--only", default="match,insert,trace,memory")
    ap.add_argument("--phase-clock", choices=("wall", "cpu"), default="wall",
                    help="clock of the per-phase times (insert metrics, trace breakdown)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--mem-child", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def load_implementations(args: argparse.Namespace) -> tuple[SimpleNamespace, list[str]]:
    """The project and the peers, loaded from their files; the implementation kinds to run."""
    for d in args.deps:
        sys.path.insert(0, str(Path(d).resolve()))
    global clock
    clock = time.thread_time if args.phase_clock == "cpu" else time.perf_counter
    ctx = SimpleNamespace(proj=load_project(args.project))
    ctx.sg = load_sglang(args.sglang)
    kinds = ["project-pool", "project-core", "sglang"]
    if args.vllm:
        ctx.vl = load_vllm(args.vllm)
        kinds += ["vllm", "vllm+events"]
    return ctx, kinds


def run_info(ctx, args: argparse.Namespace) -> dict:
    """The machine, the versions and stubs of every implementation, and the parameters."""
    return {"machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                        "load_start": os.getloadavg()},
            "versions": {"project": ctx.proj.commit, "sglang": ctx.sg.version,
                         **({"vllm": ctx.vl.version} if args.vllm else {})},
            "stubs": {"sglang": ctx.sg.stubs, **({"vllm": ctx.vl.stubs} if args.vllm else {})},
            "params": vars(args)}


def summarize_both(reps: list[dict], metrics, peers: list[str]) -> dict:
    """summarize() of each metric against project-pool, with project-core's ratios added."""
    out = {}
    for metric in metrics:
        out[metric] = summarize(reps, metric, "project-pool", peers)
        out[metric]["ratio"].update(summarize(reps, metric, "project-core", peers)["ratio"])
    return out


def run_match(ctx, kinds: list[str], peers: list[str], args: argparse.Namespace) -> dict:
    log("[match] fully cached 4,096-token prompt, match + release")
    reps = [bench_match(ctx, kinds, args.match_iters, 200, r) for r in range(args.reps)]
    return {"reps": reps, **summarize_both(reps, ("p50_us", "p99_us", "cpu_p50_us", "cpu_p99_us"),
                                           peers + ["vllm (+hash)"])}


def run_insert(ctx, kinds: list[str], peers: list[str], args: argparse.Namespace) -> dict:
    log("[insert] 4,096-token prompt sharing 1,024 cached tokens")
    reps = [bench_insert(ctx, kinds, args.insert_iters, 50, r) for r in range(args.reps)]
    return {"reps": reps, **summarize_both(reps, ("insert_p50_us", "insert_p99_us", "insert+hash+events_p50_us",
                                                  "insert+hash+events_p99_us", "total_p50_us", "total_p99_us",
                                                  "total_cpu_p50_us", "total_cpu_p99_us"), peers)}


def run_trace(ctx, kinds: list[str], peers: list[str], args: argparse.Namespace) -> dict:
    path = args.trace or str(Path(ctx.proj.root) / "prefixcache_bench" / "traces"
                             / "conversation_trace.jsonl")
    trace = ctx.proj.bench.load_trace(path, args.trace_requests)
    log(f"[trace] {len(trace):,} requests, capacity {args.capacity_tokens:,} tokens")
    reps = []
    for r in range(args.trace_reps or args.reps):
        log(f"  rep {r + 1}")
        reps.append(bench_trace(ctx, args.trace_kinds.split(",") if args.trace_kinds else kinds,
                                trace, args.capacity_tokens, r))
    return {"requests": len(trace), "reps": reps,
            "ideal_hit_ratio": ctx.proj.bench.ideal_hit_tokens(trace, PAGE) / sum(n for n, _ in trace),
            **summarize_both(reps, ("ops_per_s", "cpu_ops_per_s", "hit_ratio"), peers)}


def run_memory(kinds: list[str], args: argparse.Namespace) -> dict:
    """Each implementation in a child process of its own, so that no heap is shared."""
    log(f"[memory] {args.mem_pages:,} cached pages, one child process per implementation")
    mem = {}
    for kind in kinds:
        cmd = [sys.executable, os.path.abspath(__file__), args.project, args.sglang,
               "--mem-child", kind, "--mem-pages", str(args.mem_pages)]
        if args.vllm:
            cmd += ["--vllm", args.vllm]
        for d in args.deps:
            cmd += ["--deps", d]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if done.returncode:
            raise RuntimeError(f"memory child {kind} failed:\n{done.stderr[-3000:]}")
        mem[kind] = json.loads(done.stdout.strip().splitlines()[-1])
    return mem


def main(argv=None) -> int:
    args = parse_args(argv)
    ctx, kinds = load_implementations(args)
    # Module objects (torch, numpy, protobuf...) are common to every implementation here but each
    # service would have its own: keep them out of every later garbage collection.
    gc.collect()
    gc.freeze()
    if args.mem_child:
        print(json.dumps(memory_child(ctx, args.mem_child, args.mem_pages)))
        return 0

    parts = set(args.only.split(","))
    info = run_info(ctx, args)
    log(f"versions {info['versions']}")
    results: dict = {"info": info}
    peers = [k for k in kinds if not k.startswith("project")]
    if "match" in parts:
        results["match"] = run_match(ctx, kinds, peers, args)
    if "insert" in parts:
        results["insert"] = run_insert(ctx, kinds, peers, args)
    if "trace" in parts:
        results["trace"] = run_trace(ctx, kinds, peers, args)
    if "memory" in parts:
        results["memory"] = run_memory(kinds, args)
    info["machine"]["load_end"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str) + "\n")
    print(render(results))
    return 0


def render(results: dict) -> str:
    lines = []
    for part, metrics in (("match", ("p50_us", "p99_us", "cpu_p50_us", "cpu_p99_us")),
                          ("insert", ("insert_p50_us", "insert_p99_us", "insert+hash+events_p50_us",
                                      "insert+hash+events_p99_us", "total_p50_us", "total_p99_us",
                                      "total_cpu_p50_us", "total_cpu_p99_us")),
                          ("trace", ("ops_per_s", "cpu_ops_per_s", "hit_ratio"))):
        if part not in results:
            continue
        for metric in metrics:
            s = results[part][metric]
            vals = "  ".join(f"{k}={v:,.4g}" for k, v in s["median"].items())
            rat = "  ".join(f"{k}={v:.3g}" for k, v in s["ratio"].items())
            lines.append(f"{part}.{metric}: {vals}\n    ratios: {rat}")
    if "trace" in results:
        lines.append(f"trace.ideal_hit_ratio (unbounded cache): "
                     f"{results['trace']['ideal_hit_ratio']:.4f}")
    if "memory" in results:
        for kind, m in results["memory"].items():
            lines.append(f"memory.{kind}: " + "  ".join(
                f"{k}={v:,.1f}" if isinstance(v, float) else f"{k}={v:,}" for k, v in m.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
