"""The affinity policy's pick in C (csrc/affinity_pick.c) equals its numpy reference
(gateway/core/policies/affinity_arrays.py) to the last bit, on fleets of up to 1,200 candidates
whose loads, reports, decays and holders come from a few values each, so that near-ties,
the rotation, equal prefills and holders kept against load are common."""
from __future__ import annotations

import random
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.core import index_native
from gateway.core.index_native import CSRC
from gateway.core.policies import load as load_module
from gateway.core.policies.affinity_arrays import (Buffers, Weights, pick_in_c, pick_on_arrays,
                                                   prefill_of)
from gateway.core.policies.load import LoadTracker
from prefixcache.v1 import common_pb2
from tests.gateway.helpers import FakeClock


@pytest.fixture(scope="module", autouse=True)
def c_library():
    before = index_native.TABLE.mode, index_native.TABLE.cache_dir
    index_native.configure("on", index_native.TABLE.cache_dir)
    try:
        index_native.kernel()
    except RuntimeError as exc:  # said in the test report, not silently passed
        pytest.skip(f"the gateway's C library cannot be built here: {exc}")
    yield
    index_native.configure(*before)


def _fleet(rng: random.Random, n: int) -> tuple[LoadTracker, list[str], float]:
    clock = FakeClock()
    load = LoadTracker(clock, report_ttl_s=rng.choice([5.0, 1e9]))
    workers = [f"w{i:04d}" for i in range(n)]
    tokens = [0, 0, 512, 512, 4096, rng.randrange(1, 30000)]
    for r in range(rng.randrange(n * 2 + 1)):
        w = rng.choice(workers)
        load.on_route(w, f"r{r}", rng.choice(tokens))
        if rng.random() < 0.3:
            load.on_first_token(f"r{r}")
        if rng.random() < 0.1:
            load.on_finish(f"r{r}")
        if rng.random() < 0.1:
            load.report(w, common_pb2.LoadReport(queued_prefill_tokens=rng.choice(tokens),
                                                 running_requests=rng.randrange(3)))
        clock.now += rng.choice([0.0, 0.0, 1.0, rng.random() * 100])
    return load, workers, clock.now


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 2**32), st.sampled_from([1, 2, 7, 64, 300, 1200]))
def test_the_c_pick_equals_numpy_s(seed, n):
    rng = random.Random(seed)
    load, workers, now = _fleet(rng, n)
    candidates = (tuple(workers) if rng.random() < 0.7
                  else rng.sample(workers, rng.randrange(1, n + 1)))
    k = rng.randrange(min(len(candidates), 40) + 1)
    at = np.array(rng.sample(range(-1, len(candidates)), min(k, len(candidates) + 1)), np.intp)
    total = float(rng.choice([64, 1000, rng.randrange(1, 20000)]))
    saved = np.array([rng.choice([0.0, total / 2, total, total * 2, rng.random() * total])
                      for _ in at])
    w = Weights(total, rng.choice([1.0, 0.7]), rng.choice([0.0, 4.0]), rng.choice([0.0, 0.02]),
                0.05, rng.choice([0.0, 50.0]), rng.choice([16.0, 200.0, 5000.0]),
                rng.choice([0.0, 16384.0]), rng.randrange(-5, 2 * n))
    columns, address, decay = load.rows(candidates, now)
    in_c = pick_in_c(w, columns, address, decay, now, load.report_ttl_s, at, saved, Buffers())
    reference = pick_on_arrays(w, *load.columns(candidates, now),
                               prefill_of(total, len(candidates), at, saved))
    assert in_c == reference


def test_the_c_pick_reads_load_s_columns():
    """affinity_pick.c's column numbers are LoadTracker's."""
    defines = dict(re.findall(r"^#define (\w+) (\d+)$", (CSRC / "affinity_pick.c").read_text(),
                              re.M))
    for name in ("PENDING", "INFLIGHT", "REPORT_WHEN", "REPORT_QUEUED", "REPORT_REQUESTS",
                 "RECENT"):
        assert int(defines[name]) == getattr(load_module, f"_{name}"), name
    assert int(defines["COLUMNS"]) == len(load_module._EMPTY_ROW)
