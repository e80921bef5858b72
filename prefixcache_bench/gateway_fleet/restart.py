"""`--checkpoint`: a gateway restart from an index checkpoint (gateway/core/index_checkpoint.py),
against the cold restart that re-learns every pool from snapshots.

One process plays both gateway lives, on the gateway core: the first warms up from every pool's
snapshot (the cold restart-to-warm), writes a checkpoint (the time `Router.lock` is held for the
copy; the save as a whole, buffers included; the write alone) and stops its feeds, then saves
again with nothing changed (a skipped write: KvIndex.changes has not moved). While it is down
each pool's live batches happen (the load generator, released then, replays them to a resumed
stream; it holds them back from the first life's streams). The
second life is a new Router: it loads the checkpoint, re-admits the pools, and each feed resumes
from the checkpoint's seq: warm once every pool's downtime batches are applied (its last seq is
the last live batch) and no pool asked for a
snapshot."""
from __future__ import annotations

import gc
import os
import tempfile
import time

from gateway.core.feeds import FeedLoop
from gateway.core.index_checkpoint import VERSION, IndexCheckpointer
from gateway.core.router import Router
from prefixcache_bench.gateway_fleet import fleet as F
from prefixcache_bench.gateway_fleet.run import (LoadGenerator, _wait, admit, bench_router,
                                                 load_generator)
from prefixcache_bench.gateway_fleet.sources import SETTINGS, follow

_SPEC = "bench"


def run_checkpoint(pools: int, pages_per_pool: int, live_batches: int,
                   cpus: tuple[int, int] | None = (0, 1)) -> dict:
    with load_generator(pools, pages_per_pool, live_batches, cpus, True) as generator:
        with tempfile.TemporaryDirectory() as tmp:
            return _measure(generator, pools, pages_per_pool, live_batches,
                            os.path.join(tmp, "index.ckpt"))


def _start_feeds(router: Router, names: list[str], address: str) -> tuple[FeedLoop, list[tuple]]:
    """Every pool's feed from where the router's index says (WorkerHandle's rule); the points."""
    feeds, points = FeedLoop(router), []
    for name in names:
        points.append(router.resume_point(name))
        feeds.submit(follow(feeds, address, name, SETTINGS, True, points[-1]))
    return feeds, points


def _measure(generator: LoadGenerator, pools: int, pages_per_pool: int, live_batches: int,
             path: str) -> dict:
    address, names = generator.address, [F.pool_name(i) for i in range(pools)]
    router = bench_router()
    admit(router, names, address)
    t0 = time.perf_counter()
    feeds, _ = _start_feeds(router, names, address)
    t_cold = _wait(router, names, lambda i: i.last_seq >= 0 and not i.in_snapshot) - t0
    saver = IndexCheckpointer(router, path, 3600.0, "default", _SPEC, 60.0)
    t1 = time.perf_counter()
    lock_held = saver.save()
    save_s = time.perf_counter() - t1
    pages, saver_write_s = len(router.index), saver.last_write_s
    feeds.close()  # the first life ends
    generator.go.set()  # the downtime's batches: a resumed stream gets them at once
    t1 = time.perf_counter()
    saver.save()  # the feeds stopped, nothing changed since: skipped
    unchanged_s, skipped = time.perf_counter() - t1, saver.skipped
    del router, feeds, saver
    gc.collect()
    # Second life: load, admit, resume.
    t0 = time.perf_counter()
    router = bench_router()
    restored = IndexCheckpointer(router, path, 3600.0, "default", _SPEC, 60.0).restore()
    t_loaded = time.perf_counter() - t0
    admit(router, names, address)
    feeds, points = _start_feeds(router, names, address)
    t_warm = _wait(router, names, lambda i: i.last_seq == live_batches and not i.in_snapshot) - t0
    feeds.close()
    snap, live = map(sum, zip(*(F.page_events(i, pages_per_pool, live_batches) for i in range(pools))))
    return {
        "pools": pools, "pages_per_pool": pages_per_pool, "live_batches_per_pool": live_batches,
        "indexed_pages": pages, "snapshot_page_events": snap, "downtime_page_events": live,
        "cold_restart_to_warm_s": t_cold, "restart_to_warm_s": t_warm,
        "checkpoint_load_s": t_loaded, "checkpoint_lock_held_s": lock_held,
        "checkpoint_save_s": save_s, "checkpoint_write_s": saver_write_s,
        "checkpoint_unchanged_save_s": unchanged_s, "checkpoint_unchanged_skipped": skipped,
        "checkpoint_bytes": os.path.getsize(path), "checkpoint_version": VERSION,
        "restored_workers": len(restored),
        "resumed_from_seq": sum(1 for _, seq in points if seq >= 0),
        "indexed_pages_after_restart": len(router.index),
    }
