"""LoRA adapters over gRPC: LoadAdapter, UnloadAdapter, GetModelInfo.adapters, Generate with one."""
from __future__ import annotations

import functools

import grpc
import pytest

from compute_service.engine import Engine
from compute_service.lora import merged_model, read_adapter
from compute_service.server import ComputeServer
from prefixcache.v1 import cache_service_pb2 as cpb
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import compute_service_pb2_grpc as pb_grpc
from prefixcache_client.limits import MAX_NAME_BYTES
from tests.compute_service.server_harness import (PAGE, LENGTH, INVALID, model, make_engine,
                                                  running, greedy, prompt, wait_until, sample,
                                                  fails)
from tests.compute_service.paged_driver import PagedDriver

pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ---- LoRA adapters -------------------------------------------------------------------------------

NOT_FOUND, EXISTS = grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS
EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


@functools.cache
def merged_reference(adapter_dir: str, prompt_ids: tuple[int, ...], n: int) -> list[int]:
    """Greedy tokens of tiny-transformer with the adapter at `adapter_dir` merged in."""
    base = model("tiny-transformer")
    ref = merged_model(base, read_adapter(adapter_dir, base.config))
    return PagedDriver(ref, num_pages=80, page_size=PAGE, num_slots=2).generate_greedy(
        list(prompt_ids), n)


def rpc(server: ComputeServer, method: str, req):
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        return getattr(pb_grpc.ComputeServiceStub(ch), method)(req, timeout=10)


def rpc_fails(server: ComputeServer, method: str, req, code: grpc.StatusCode) -> str:
    with pytest.raises(grpc.RpcError) as err:
        rpc(server, method, req)
    assert err.value.code() == code, err.value.details()
    return err.value.details()


def load(server: ComputeServer, name: str, path: str) -> pb.LoadAdapterResponse:
    return rpc(server, "LoadAdapter", pb.LoadAdapterRequest(name=name, path=path))


def lora_engine(**cfg) -> Engine:
    cfg = {"max_loaded_adapters": 2, "max_lora_rank": 8, "max_loras": 2, **cfg}
    return make_engine(pool_id="worker-lora", **cfg)


def test_load_adapter_generate_with_it_then_unload(adapter_dirs):
    with running(lora_engine(), metrics_port=0) as (server, client):
        resp = load(server, "a", adapter_dirs["a"])
        assert resp.rank == 8
        assert list(resp.target_modules) == ["down_proj", "gate_proj", "k_proj", "o_proj",
                                             "q_proj", "up_proj", "v_proj"]
        resp = load(server, "b.v2", adapter_dirs["b"])
        assert (resp.rank, list(resp.target_modules)) == (4, ["q_proj", "v_proj"])
        assert list(client.model_info().adapters) == ["a", "b.v2"]
        assert sample(server, "prefixcache_compute_adapters_loaded") == 2

        p = prompt(40)
        base = client.generate(p, greedy(8)).result()
        first = client.generate(p, greedy(8), adapter="a").result()
        second = client.generate(p, greedy(8), adapter="a").result()
        other = client.generate(p, greedy(8), adapter="b.v2").result()
        # The adapter's output is the merged-weights model's, from cache too.
        assert first.token_ids == second.token_ids == merged_reference(adapter_dirs["a"],
                                                                        tuple(p), 8)
        assert other.token_ids == merged_reference(adapter_dirs["b"], tuple(p), 8)
        assert first.token_ids != base.token_ids
        # Namespaces: only the same adapter hits.
        assert first.stats.cached_tokens_device == 0 and other.stats.cached_tokens_device == 0
        assert second.stats.cached_tokens_device == 20

        resp = rpc(server, "UnloadAdapter", pb.UnloadAdapterRequest(name="a"))
        # Prompt + output pages of "a", published at release, none pinned any more.
        assert resp.removed_pages == (21 + 8) // PAGE and resp.deferred_pages == 0
        assert list(client.model_info().adapters) == ["b.v2"]
        message = fails(client.generate(p, greedy(2), adapter="a"), NOT_FOUND)
        assert message.startswith("adapter:")
        # The freed slot takes another adapter; the name can be loaded again, as new weights.
        load(server, "a", adapter_dirs["c"])
        again = client.generate(p, greedy(8), adapter="a").result()
        assert again.stats.cached_tokens_device == 0  # "a"'s old pages are gone
        assert again.token_ids == merged_reference(adapter_dirs["c"], tuple(p), 8)
        assert sample(server, "prefixcache_compute_rpcs_total", method="LoadAdapter",
                      code="OK") == 3
        assert sample(server, "prefixcache_compute_rpcs_total", method="UnloadAdapter",
                      code="OK") == 1


@pytest.mark.parametrize("name, path, code, field", [
    pytest.param("", "a", INVALID, "name", id="empty-name"),
    pytest.param("has space", "a", INVALID, "name", id="name-with-space"),
    pytest.param("x" * 257, "a", INVALID, "name", id="name-too-long"),
    pytest.param("caf\u00e9", "a", INVALID, "name", id="name-not-ascii"),
    pytest.param("new", "", INVALID, "path", id="empty-path"),
    pytest.param("new", "missing", INVALID, "path", id="no-such-directory"),
    pytest.param("new", "corrupt", INVALID, "path", id="corrupt-weights"),
    pytest.param("new", "r16", INVALID, "r", id="rank-over-max"),
    pytest.param("new", "dora", INVALID, "use_dora", id="dora"),
    pytest.param("a", "c", EXISTS, "name", id="name-loaded"),
    pytest.param("x" * 256, "c", EXHAUSTED, "name", id="slots-full"),
])
def test_load_adapter_errors_name_the_field_and_change_nothing(adapter_dirs, name, path, code,
                                                              field):
    with running(lora_engine()) as (server, client):
        load(server, "a", adapter_dirs["a"])
        if code == EXHAUSTED:
            load(server, "b", adapter_dirs["b"])
        before = list(client.model_info().adapters)
        message = rpc_fails(server, "LoadAdapter",
                            pb.LoadAdapterRequest(name=name, path=adapter_dirs.get(path, path)),
                            code)
        assert message.startswith(f"{field}:"), message
        assert list(client.model_info().adapters) == before
        if code != EXISTS:  # nothing was loaded under the name
            # A name over the limit is not even looked up (prefixcache_client.limits).
            fails(client.generate([1, 2], greedy(1), adapter=name or "x"),
                  INVALID if len(name) > MAX_NAME_BYTES else NOT_FOUND)
        # The adapter already loaded is untouched.
        out = client.generate(prompt(41), greedy(4), adapter="a").result()
        assert out.token_ids == merged_reference(adapter_dirs["a"], tuple(prompt(41)), 4)


def test_unload_adapter_errors():
    with running(lora_engine()) as (server, _):
        message = rpc_fails(server, "UnloadAdapter", pb.UnloadAdapterRequest(name="nope"),
                            NOT_FOUND)
        assert message.startswith("name:") and "nope" in message
        message = rpc_fails(server, "UnloadAdapter", pb.UnloadAdapterRequest(name="a b"), INVALID)
        assert message.startswith("name:")
        message = rpc_fails(server, "UnloadAdapter", pb.UnloadAdapterRequest(), INVALID)
        assert message.startswith("name:")


def test_worker_without_adapter_slots(adapter_dirs):
    with running(lora_engine(max_loaded_adapters=0)) as (server, client):
        message = rpc_fails(server, "LoadAdapter",
                            pb.LoadAdapterRequest(name="a", path=adapter_dirs["a"]), EXHAUSTED)
        assert message.startswith("name:") and "max_loaded_adapters=0" in message
        rpc_fails(server, "LoadAdapter", pb.LoadAdapterRequest(name="a b", path="x"), INVALID)
        assert list(client.model_info().adapters) == []


def test_unload_while_a_request_runs_with_the_adapter(adapter_dirs):
    with running(lora_engine()) as (server, client):
        load(server, "a", adapter_dirs["a"])
        p = prompt(42)
        stream = client.generate(p, greedy(200), adapter="a", request_id="long")
        # Two tokens: the first is sampled in one engine step and the prompt's pages are only
        # published by the next step's cache call, which precedes the second token.
        head = [next(stream), next(stream)]  # running: its prompt pages are published and pinned
        resp = rpc(server, "UnloadAdapter", pb.UnloadAdapterRequest(name="a"))
        assert resp.deferred_pages >= len(p) // PAGE
        assert fails(client.generate(p, greedy(2), adapter="a"), NOT_FOUND).startswith("adapter")
        out = stream.result()
        assert out.stats.finish_reason == LENGTH and out.stats.output_tokens == 200
        tokens = [t for msg in head for t in msg.token_ids] + list(out.token_ids)
        assert tokens == merged_reference(adapter_dirs["a"], tuple(p), 200)
        # Once it ended, its deferred pages are freed and its slot is free.
        cache = server.engine.cache

        def released() -> bool:
            pool = cache.get_stats(cpb.GetStatsRequest()).pools[0]
            return pool.active_leases == 0 and all(m.pinned_pages == 0 for m in pool.media)
        wait_until(released)
        pool = cache.get_stats(cpb.GetStatsRequest()).pools[0]
        assert pool.media[0].cached_pages == 0 and pool.media[0].used_pages == 0
        load(server, "b", adapter_dirs["b"])
        load(server, "c", adapter_dirs["c"])  # both slots free again: nothing leaked
