"""LoRA adapters in the engine (design.md §2 namespaces, design.md lessons 4 and 5).

For a transformer and a hybrid, with 4-token pages:
- the output under an adapter equals the merged-weights model's greedy output (PagedDriver over
  `merged_model`), cold and from cache;
- the same prompt under the base model and two adapters never shares a page: the same adapter
  hits, another adapter (or the base) does not, and the cache service's events carry the adapter
  name and page hashes that are disjoint across namespaces (the namespace is inside the hash);
- `max_loras` holds for every forward of mixed traffic over more adapters than that, and every
  request still gets its own adapter's output;
- unloading an adapter while a request uses it is safe: the request completes correctly, new
  requests naming it fail, its namespace is evicted (BlockRemoved), the pages the request pinned
  are freed once it ends, and no slot (adapter or Mamba) leaks.
"""
from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.engine.request import FinishReason
from compute_service.lora import (AdapterRegistry, LoraAdapter, NoFreeSlotError, merged_model,
                                  write_random_adapter)
from compute_service.model import ByteTokenizer, build_preset
from prefixcache.v1 import cache_service_pb2 as cpb, common_pb2
from prefixcache_client.hash import prompt_hashes
from tests.compute_service.paged_driver import PagedDriver

# Tiny models on two shared cores: more intra-op threads only add contention.
pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILIES = ["tiny-transformer", "tiny-hybrid"]
PAGE = 4
NEW = 6
DEVICE = common_pb2.MEDIUM_DEVICE
# name -> write_random_adapter arguments: ranks 4..16, all projections or a subset (with rsLoRA),
# strong enough that an adapter changes greedy tokens.
SPECS: dict[str, dict] = {
    "a": dict(rank=8, seed=1, strength=0.5),
    "b": dict(rank=4, seed=2, strength=0.5, use_rslora=True,
              targets=("q_proj", "v_proj", "down_proj", "in_proj")),
    "c": dict(rank=16, seed=3, strength=0.5),
    "d": dict(rank=8, seed=4, strength=0.5, targets=("o_proj", "up_proj", "out_proj")),
    "e": dict(rank=12, seed=5, strength=0.5),
    "f": dict(rank=8, seed=6, strength=0.5, targets=("k_proj", "gate_proj", "in_proj")),
}


@functools.cache
def model(name: str):
    torch.manual_seed(0)
    return build_preset(name, seed=3)


class Adapters:
    """The SPECS adapters of one preset, written once in PEFT format: (path, adapter)."""

    def __init__(self, root: Path):
        self.root = root

    @functools.cache
    def get(self, preset: str, name: str) -> tuple[str, LoraAdapter]:
        path = self.root / preset / name
        return str(path), write_random_adapter(path, preset, **SPECS[name])

    @functools.cache
    def merged(self, preset: str, name: str):
        """The base model ("" ) or a copy with adapter `name` merged into its weights."""
        return merged_model(model(preset), self.get(preset, name)[1]) if name else model(preset)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory) -> Adapters:
    return Adapters(tmp_path_factory.mktemp("adapters"))


def reference(adapters: Adapters, preset: str, adapter_name: str, prompt: list[int],
              new: int = NEW) -> list[int]:
    """Greedy tokens of the base model, or of the model with the adapter merged in."""
    return _greedy(adapters.merged(preset, adapter_name), tuple(prompt), new)


@functools.cache
def _greedy(ref, prompt: tuple[int, ...], new: int) -> list[int]:
    return PagedDriver(ref, num_pages=64, page_size=PAGE, num_slots=2).generate_greedy(
        list(prompt), new)


def engine(preset: str, adapters: Adapters, load: tuple[str, ...] = (), cache=None,
           **cfg) -> Engine:
    settings = dict(page_size=PAGE, device_pages=256, token_budget=24, max_running=16,
                    checkpoint_slots=64, model_id=preset, max_loaded_adapters=6,
                    max_lora_rank=16, max_loras=4)
    settings.update(cfg)
    eng = Engine(model(preset), ByteTokenizer(), cache or CacheCore(), EngineConfig(**settings))
    for name in load:
        info = eng.load_adapter(name, adapters.get(preset, name)[0])
        assert info.rank == SPECS[name]["rank"]
    return eng


def run(eng: Engine, requests: dict[str, tuple[list[int], str]], new: int = NEW) -> dict:
    """Submits every (prompt, adapter) at once and steps until idle: key -> (tokens, stats)."""
    got: dict[str, list] = {k: [] for k in requests}
    for key, (prompt, adapter) in requests.items():
        eng.submit(prompt, SamplingParams(max_tokens=new, ignore_eos=True), got[key].append,
                   request_id=key, adapter=adapter)
    eng.run_until_idle()
    return {k: ([t for o in outs for t in o.token_ids], outs[-1].stats) for k, outs in got.items()}


def prompt_of(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 255) for _ in range(n)]


BASE = prompt_of(1, 45)  # 11.25 pages: several chunks at a 24-token budget


def stored_and_removed(core: CacheCore, pool_id: str):
    """Every BlockStored event (adapter, model_id, hashes) and every removed hash, in order."""
    stored, removed = [], []
    for batch in core._pools[pool_id].log.since(-1):
        for ev in batch.events:
            if ev.HasField("stored"):
                stored.append((ev.stored.adapter, ev.stored.model_id, list(ev.stored.block_hashes)))
            elif ev.HasField("removed"):
                removed += ev.removed.block_hashes
    return stored, removed


def live_hashes(core: CacheCore, pool_id: str) -> dict[str, set[bytes]]:
    """The page set the event stream describes, per adapter (replayed from an empty index)."""
    live: dict[bytes, str] = {}
    for batch in core._pools[pool_id].log.since(-1):
        for ev in batch.events:
            if ev.HasField("stored") and ev.stored.medium == DEVICE:
                live |= {h: ev.stored.adapter for h in ev.stored.block_hashes}
            elif ev.HasField("removed") and ev.removed.medium == DEVICE:
                for h in ev.removed.block_hashes:
                    live.pop(h, None)
            elif ev.HasField("cleared"):
                live.clear()
    out: dict[str, set[bytes]] = {}
    for h, adapter in live.items():
        out.setdefault(adapter, set()).add(h)
    return out


def device_stats(core: CacheCore, pool_id: str) -> cpb.MediumStats:
    pool = core.get_stats(cpb.GetStatsRequest(pool_id=pool_id)).pools[0]
    return next(m for m in pool.media if m.medium == DEVICE)


# ---- output equals the merged-weights model ---------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_adapter_output_equals_merged_model_cold_and_cached(name, adapters):
    eng = engine(name, adapters, load=("a", "b"))
    refs = {a: reference(adapters, name, a, BASE) for a in ("", "a", "b")}
    # The test means something only if an adapter changes the greedy tokens.
    assert refs["a"] != refs[""] or refs["b"] != refs[""]
    for adapter in ("a", "b"):
        cold = run(eng, {"cold": (BASE, adapter)})["cold"]
        assert cold[0] == refs[adapter], adapter
        assert cold[1].cached_tokens_device == 0
        assert cold[1].computed_prompt_tokens == len(BASE)
        again = run(eng, {"again": (BASE, adapter)})["again"]
        assert again[0] == refs[adapter], adapter
        assert again[1].cached_tokens_device > 0  # hybrid: up to the deepest checkpoint
        # A partial hit: 5 shared whole pages, then tokens of its own.
        mid = BASE[:22] + prompt_of(2, 13)
        out = run(eng, {"mid": (mid, adapter)})["mid"]
        assert out[0] == reference(adapters, name, adapter, mid), adapter
        assert 0 < out[1].cached_tokens_device <= 20


# ---- namespaces -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_base_and_two_adapters_never_share_a_page(name, adapters):
    core = CacheCore()
    eng = engine(name, adapters, load=("a", "b"), cache=core)
    pool_id = eng.cfg.pool_id
    # Sequentially: only the same namespace hits.
    hits = {}
    for step, adapter in enumerate(("", "a", "b", "a", "", "b")):
        out = run(eng, {f"s{step}": (BASE, adapter)})[f"s{step}"]
        assert out[0] == reference(adapters, name, adapter, BASE), (step, adapter)
        hits[step] = out[1].cached_tokens_device + out[1].cached_tokens_host
    assert hits[0] == hits[1] == hits[2] == 0, hits
    assert hits[3] > 0 and hits[4] > 0 and hits[5] > 0, hits

    # Concurrently, with a shared prefix: siblings in another namespace are not waited for.
    other = BASE[:32] + prompt_of(3, 9)
    got = run(eng, {"base": (other, ""), "a": (other, "a"), "b": (other, "b")})
    for adapter, key in (("", "base"), ("a", "a"), ("b", "b")):
        tokens, stats = got[key]
        assert tokens == reference(adapters, name, adapter, other), key
        # Only this namespace's own BASE pages (32 tokens in common) can hit.
        assert stats.cached_tokens_device <= 32, key
    got = run(eng, {"a2": (other, "a"), "b2": (other, "b")})
    assert all(stats.cached_tokens_device >= 32 for _, stats in got.values())

    stored, _ = stored_and_removed(core, pool_id)
    by_adapter: dict[str, set[bytes]] = {}
    for adapter, model_id, hashes in stored:
        assert model_id == name and adapter in ("", "a", "b")
        by_adapter.setdefault(adapter, set()).update(hashes)
    assert set(by_adapter) == {"", "a", "b"}
    assert not by_adapter[""] & by_adapter["a"]
    assert not by_adapter[""] & by_adapter["b"]
    assert not by_adapter["a"] & by_adapter["b"]
    for adapter, hashes in by_adapter.items():  # the namespace is inside the hash (design.md lesson 4)
        assert set(prompt_hashes(BASE, PAGE, name, adapter)) <= hashes, adapter


# ---- max_loras --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_max_loras_cap_holds_with_mixed_traffic(name, adapters):
    names = tuple(SPECS)  # 6 adapters
    eng = engine(name, adapters, load=names, max_loaded_adapters=6, max_loras=2, max_running=16,
                 token_budget=64)
    seen: list[tuple[set[int], bool]] = []
    lora_batch = eng.adapters.lora_batch

    def recording(seq_slots, num_tokens):
        seen.append(({s for s in seq_slots if s >= 0}, -1 in seq_slots))
        return lora_batch(seq_slots, num_tokens)

    eng.adapters.lora_batch = recording
    requests = {}
    for i in range(12):  # two per adapter; the second shares the first's prefix
        adapter = names[i % 6]
        requests[f"r{i}"] = (prompt_of(50 + i % 6, 14) + prompt_of(70 + i, 3 + i % 5), adapter)
    for i in range(3):
        requests[f"base{i}"] = (prompt_of(90 + i, 11), "")
    got = run(eng, requests)

    assert seen and all(len(slots) <= 2 for slots, _ in seen), [s for s, _ in seen]
    assert max(len(slots) for slots, _ in seen) == 2  # the cap was reached, not just respected
    assert any(slots and base for slots, base in seen)  # base and adapters in one forward
    for key, (prompt, adapter) in requests.items():
        tokens, stats = got[key]
        assert stats.finish_reason is FinishReason.LENGTH, key
        assert tokens == reference(adapters, name, adapter, prompt), (key, adapter)
    assert len(eng.free_slots) == eng.cfg.max_running and not eng.has_work()


# ---- unload while running ---------------------------------------------------------------------

@pytest.mark.parametrize("name", FAMILIES)
def test_unload_during_a_running_request(name, adapters):
    core = CacheCore()
    eng = engine(name, adapters, load=("a",), cache=core, max_loaded_adapters=1, max_running=1)
    pool_id = eng.cfg.pool_id
    # Finished earlier: its pages are cached, unpinned, in namespace "a".
    warm = prompt_of(10, 21)
    assert run(eng, {"warm": (warm, "a")})["warm"][0] == reference(adapters, name, "a", warm)
    cached_before = device_stats(core, pool_id).cached_pages
    assert cached_before >= len(warm) // PAGE

    # A long request under "a" that has published its prompt pages and is decoding, and one
    # queued behind it (max_running=1).
    long_prompt, long_new = prompt_of(11, 23), 14
    outs: dict[str, list] = {"long": [], "queued": []}
    sampling = SamplingParams(max_tokens=long_new, ignore_eos=True)
    eng.submit(long_prompt, sampling, outs["long"].append, request_id="long", adapter="a")
    eng.submit(prompt_of(12, 9), sampling, outs["queued"].append, request_id="queued",
               adapter="a")
    while sum(len(o.token_ids) for o in outs["long"]) < 3:
        eng.step()
    assert [r.id for r in eng.running] == ["long"]
    pinned_before = device_stats(core, pool_id).pinned_pages
    assert pinned_before >= len(long_prompt) // PAGE

    removed, deferred = eng.unload_adapter("a")
    assert removed >= len(warm) // PAGE  # the finished request's pages, at once
    assert deferred >= len(long_prompt) // PAGE  # what the running request pins
    assert eng.adapter_names() == []
    _, removed_hashes = stored_and_removed(core, pool_id)
    assert set(prompt_hashes(warm, PAGE, name, "a")) <= set(removed_hashes)  # BlockRemoved
    with pytest.raises(LookupError, match="adapter"):
        eng.submit(warm, SamplingParams(), lambda o: None, adapter="a")
    with pytest.raises(LookupError):
        eng.unload_adapter("a")
    # Its weights stay until the running request ends: the only slot is still taken.
    path_c = adapters.get(name, "c")[0]
    with pytest.raises(NoFreeSlotError):
        eng.load_adapter("c", path_c)

    eng.run_until_idle()
    tokens = [t for o in outs["long"] for t in o.token_ids]
    assert outs["long"][-1].stats.finish_reason is FinishReason.LENGTH
    assert tokens == reference(adapters, name, "a", long_prompt, long_new)
    assert outs["queued"][-1].stats.finish_reason is FinishReason.ABORT
    assert not [t for o in outs["queued"] for t in o.token_ids]

    # The deferred pages were freed when the request ended: nothing of "a" is left, in the tree
    # or in the event stream, and no lease holds anything.
    assert "a" not in live_hashes(core, pool_id)
    dev = device_stats(core, pool_id)
    assert (dev.cached_pages, dev.pinned_pages, dev.used_pages) == (0, 0, 0), dev
    assert core.get_stats(cpb.GetStatsRequest(pool_id=pool_id)).pools[0].active_leases == 0
    # No slot leaked: the Mamba slots are back, and the adapter slot takes a new adapter whose
    # output is its own (nothing of "a" survives in the slot).
    assert len(eng.free_slots) == eng.cfg.max_running
    eng.load_adapter("c", path_c)
    out = run(eng, {"c": (long_prompt, "c")})["c"]
    assert out[0] == reference(adapters, name, "c", long_prompt)
    assert out[1].cached_tokens_device == 0  # "c" is a new namespace


def test_registry_pins_follow_the_requests(adapters):
    """Every acquire is matched by a release, across preemption and abort."""
    name = "tiny-transformer"
    eng = engine(name, adapters, load=("a", "b"), device_pages=30, token_budget=64)
    registry: AdapterRegistry = eng.adapters
    requests = {f"p{i}": (prompt_of(200 + i, 45), "ab"[i % 2]) for i in range(6)}
    got = run(eng, requests)
    assert eng.stats.preemptions > 0  # 30 pages cannot hold them all at once
    for key, (prompt, adapter) in requests.items():
        assert got[key][0] == reference(adapters, name, adapter, prompt), key
    assert all(slot is None or slot.pins == 0 for slot in registry._slots)
    # Abort of a running adapter request releases its pin too.
    outs: list = []
    eng.submit(BASE, SamplingParams(max_tokens=50, ignore_eos=True), outs.append,
               request_id="x", adapter="b")
    while not any(o.token_ids for o in outs):
        eng.step()
    assert eng.abort("x")
    eng.run_until_idle()
    assert outs[-1].stats.finish_reason is FinishReason.ABORT
    assert all(slot is None or slot.pins == 0 for slot in registry._slots)
