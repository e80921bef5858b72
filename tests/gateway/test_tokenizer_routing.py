"""The gateway tokenizes as the workers do, with no shared files: a gateway started without
--tokenizer fetches it from the first worker (a real worker on a checkpoint with a BPE
tokenizer.json) and routes on the very ids the worker computes, for text and chats; a worker
with another tokenizer is logged, counted, and sent token-id prompts only, and text the gateway
cannot tokenize for any worker is refused clearly."""
from __future__ import annotations

import logging

import grpc
import pytest

from gateway.core.discovery import WorkerAddress
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache.v1 import gateway_pb2 as gpb
from prefixcache_client.tokenizer import ByteTokenizer, from_files
from tests.cache_service.grpc_harness import running_server
from tests.compute_service.checkpoints import (BPE_TOKENIZER, PAGE, preset_model, serving,
                                               write_checkpoint)
from tests.compute_service.server_harness import make_engine, running
from tests.gateway.gateway_harness import Caller, request, running_gateway, wait_until
from tests.gateway.server_helpers import list_workers, rpc_error, sample

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "Hello world, the cache page héllo 🙂 and the lazy dog"
CHAT = [{"role": "system", "content": "be brief"},
        {"role": "user", "content": "Which river is the longest?"}]
MODEL = "bpe-ckpt"  # the checkpoint directory's name: its model id


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A cache service, worker `bpe` on a tiny-transformer checkpoint with the BPE tokenizer,
    and a gateway without --tokenizer over it; `addresses` takes more workers later."""
    path = write_checkpoint(tmp_path_factory.mktemp("ckpt") / MODEL,
                            preset_model("tiny-transformer", seed=2), bos=0, eos=3,
                            tokenizer=BPE_TOKENIZER)
    with running_server() as cache, serving(path, "bpe", cache.core) as (worker, client):
        cache_addr = f"127.0.0.1:{cache.port}"
        addresses = [WorkerAddress(f"127.0.0.1:{worker.port}", cache_addr)]
        with running_gateway(lambda: list(addresses), metrics_port=0) as gw:
            caller = Caller(gw.address)
            wait_until(lambda: gw.router.ready() and gw.proxy.tokenizer.current() is not None,
                       what="gateway ready with the worker's tokenizer")
            yield gw, cache, caller, worker, client, addresses
            caller.close()


def _generate(caller: Caller, prompt, token: str = "tok-a") -> pb.GenerateResponse:
    msgs = caller.generate(prompt, token, timeout=60)
    assert msgs[-1].HasField("stats")
    return msgs


def test_the_gateway_learns_the_workers_tokenizer(stack):
    gw, _, caller, worker, client, _ = stack
    info, mine = client.model_info(), worker.engine.tokenizer
    assert gw.proxy.tokenizer.fingerprint == info.tokenizer_fingerprint == mine.fingerprint
    at_gateway = caller.compute.GetTokenizer(pb.GetTokenizerRequest(), timeout=10,
                                             metadata=caller.meta())
    assert from_files({f.name: f.content for f in at_gateway.files}).fingerprint == \
        mine.fingerprint == at_gateway.fingerprint
    gw_info = caller.compute.GetModelInfo(pb.GetModelInfoRequest(), timeout=10,
                                          metadata=caller.meta())
    assert gw_info.tokenizer_fingerprint == mine.fingerprint and gw_info.bos_token_id == 0
    assert gw_info.has_chat_template


def test_text_and_chats_are_routed_on_the_workers_own_ids(stack):
    gw, _, caller, worker, client, _ = stack
    tok = worker.engine.tokenizer
    ids = tok.text_prompt_ids(TEXT)
    assert len(ids) < len(TEXT.encode())  # BPE pieces, not bytes
    preview = caller.gateway.RoutePreview(gpb.RoutePreviewRequest(request=request(TEXT)),
                                          metadata=caller.meta(), timeout=10)
    assert preview.prompt_tokens == len(ids) and preview.worker == "bpe"
    via_gateway = _generate(caller, TEXT)
    alone = client.generate(TEXT, pb.SamplingParams(max_tokens=3, ignore_eos=True)).result()
    assert via_gateway[-1].stats.prompt_tokens == alone.stats.prompt_tokens == len(ids)
    assert [t for m in via_gateway for t in m.token_ids] == alone.token_ids
    # A chat: the gateway's ids are the worker's own chat template's.
    chat_ids = gw.proxy.tokenizer.chat_prompt_ids(CHAT)
    assert chat_ids == tok.chat_ids(CHAT) and chat_ids[:2] == [0, 2]  # <|bos|><|im_start|>
    via_gateway = _generate(caller, chat_ids)
    alone = client.generate(chat_ids, pb.SamplingParams(max_tokens=3, ignore_eos=True)).result()
    assert via_gateway[-1].stats.prompt_tokens == len(chat_ids)
    assert [t for m in via_gateway for t in m.token_ids] == alone.token_ids


def test_a_worker_with_another_tokenizer_gets_token_ids_only(stack, caplog):
    gw, cache, caller, worker, _, addresses = stack
    mine = worker.engine.tokenizer.fingerprint
    byte = ByteTokenizer().fingerprint
    gauge = "prefixcache_gateway_tokenizer_mismatched_workers"
    refusals = "prefixcache_gateway_tokenizer_refusals_total"
    engine = make_engine("tiny-transformer", cache=cache.core, pool_id="byte", model_id=MODEL,
                         page_size=PAGE)
    bpe_address = addresses[0]
    with caplog.at_level(logging.WARNING, logger="gateway.tokenize"), \
            running(engine) as (other, _):
        addresses.append(WorkerAddress(f"127.0.0.1:{other.port}", bpe_address.cache))
        try:
            wait_until(lambda: len(list_workers(caller)) == 2 and sample(gw, gauge) == 1,
                       what="second worker admitted and counted")
            line = next(r.getMessage() for r in caplog.records
                        if "worker_tokenizer_mismatch" in r.getMessage())
            assert "worker=byte" in line and mine in line and byte in line
            # Text goes to the worker that shares the gateway's tokenizer, whatever the load.
            for _ in range(4):
                assert _generate(caller, TEXT)[-1].stats.worker == "bpe"
            # Token ids may go to either: with the bpe worker gone, the byte one serves them.
            addresses.remove(bpe_address)
            wait_until(lambda: list(list_workers(caller)) == ["byte"], what="bpe worker gone")
            assert _generate(caller, [5, 6, 7, 8, 9])[-1].stats.worker == "byte"
            before = sample(gw, refusals, reason="no_compatible_worker")
            err = rpc_error(lambda: caller.generate(TEXT))
            assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "prompt.text: no worker tokenizes as this gateway does" in err.details()
            assert f"byte={byte[:16]}" in err.details() and mine[:16] in err.details()
            assert sample(gw, refusals, reason="no_compatible_worker") == before + 1
        finally:
            addresses[:] = [bpe_address]
            wait_until(lambda: list(list_workers(caller)) == ["bpe"], what="fleet restored")
