"""The decode CUDA graphs' bookkeeping (compute_service.engine.cuda_graphs), on CPU: the graph
calls are emulated (recording keeps the forward, a replay runs it again over the static
buffers), so what is checked is what a real graph depends on: every input of a replayed step
reaches the static buffers (ids, positions, slots, prefix lengths, block tables of any width),
the captured batch sizes, and the fall-back to eager forwards."""
from __future__ import annotations

import random

import pytest

from cache_service.core import CacheCore
from compute_service.engine import Engine, EngineConfig, SamplingParams
from compute_service.engine.cuda_graphs import DecodeGraphs
from compute_service.model import ByteTokenizer
from tests.compute_service.engine.references import PAGE, model, reference


class EmulatedGraphs(DecodeGraphs):
    def _eager(self, forward):
        return forward().clone()

    def _record(self, forward):
        return forward, forward().clone()

    def _replay(self, g):
        g.logits.copy_(g.graph())


def engine(name: str, graphs: bool, prefix_cache: bool = True, **cfg) -> Engine:
    settings = dict(page_size=PAGE, device_pages=256, token_budget=64, max_running=16,
                    checkpoint_slots=64, model_id=name, max_context=128,
                    prefix_cache=prefix_cache)
    settings.update(cfg)
    eng = Engine(model(name), ByteTokenizer(), CacheCore() if prefix_cache else None,
                 EngineConfig(**settings))
    assert eng.runner.graphs is None  # CPU: never real graphs
    if graphs:
        eng.runner.graphs = EmulatedGraphs(eng.runner.model, eng.runner.kv, PAGE, 128, 16)
    return eng


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, 255) for _ in range(n)] for n in lengths]


def run(eng: Engine, ps: list[list[int]], new: list[int]) -> list[list[int]]:
    got: list[list] = [[] for _ in ps]
    for i, (p, n) in enumerate(zip(ps, new, strict=True)):
        eng.submit(p, SamplingParams(max_tokens=n, ignore_eos=True), got[i].append,
                   request_id=f"r{i}")
    eng.run_until_idle()
    return [[t for o in outs for t in o.token_ids] for outs in got]


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_replayed_decode_matches_the_reference(prefix_cache):
    # Different prompt lengths and output lengths: the batch shrinks as requests finish (new
    # sizes captured), block tables grow across pages, several batch sizes replay.
    ps = prompts(3, [5, 9, 14, 3, 21])
    new = [20, 7, 20, 9, 14]
    eng = engine("tiny-transformer", True, prefix_cache)
    out = run(eng, ps, new)
    g = eng.runner.graphs
    assert g.enabled and g.replays >= 10 and len(g.graphs) >= 2
    for p, n, o in zip(ps, new, out, strict=True):
        assert o == reference("tiny-transformer", tuple(p), n)
    eng.close()


def test_a_differing_graph_turns_graphs_off():
    class Broken(EmulatedGraphs):
        def _replay(self, g):
            g.logits.copy_(g.graph() + 1.0)

    ps = prompts(4, [6, 11])
    eng = engine("tiny-transformer", False)
    eng.runner.graphs = Broken(eng.runner.model, eng.runner.kv, PAGE, 128, 16)
    out = run(eng, ps, [8, 8])
    assert not eng.runner.graphs.enabled and eng.runner.graphs.captures == 1
    assert out == [reference("tiny-transformer", tuple(p), 8) for p in ps]
    eng.close()
