"""Gateway pieces without servers: no torch, its tokenizer (the workers' own), discovery, the
tenants file."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from gateway.core.discovery import DnsWorkers, WorkerAddress, parse_static
from gateway.core.metrics import GatewayMetrics
from gateway.core.tenants import Tenant, TenantDirectory
from gateway.core.tokenize import (AUTO, BYTE, GatewayTokenizer, TokenizerUnavailable,
                              prompt_fingerprint, prompt_ids)
from prefixcache.v1 import compute_service_pb2 as pb
from prefixcache_client.tokenizer import NoChatTemplate
from tests.cache_service.grpc_harness import REPO

BPE = Path(__file__).resolve().parents[1] / "data" / "bpe_tokenizer"


# ---- torch-free, and tokenizers that agree with the workers' --------------------------------

def test_gateway_never_imports_torch():
    code = ("import sys, gateway.assembly, gateway.__main__; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_tokenizer_overrides_are_the_workers_tokenizers(tmp_path):
    """--tokenizer byte / PATH build the shared classes the workers use: same ids, same
    fingerprint; a text prompt is refused clearly until some worker shares it."""
    from compute_service.model import ByteTokenizer as WorkerBytes
    from compute_service.model import load_tokenizer, preset_config

    text = "héllo wörld, ünïcode ✓ and more <|im_start|>"
    byte = GatewayTokenizer(BYTE)
    assert byte.fingerprint == WorkerBytes().fingerprint
    assert byte.text_ids(text) == WorkerBytes().text_prompt_ids(text)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BPE / name, tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 3}))
    ours = GatewayTokenizer(str(tmp_path))
    theirs = load_tokenizer(tmp_path, preset_config("tiny-transformer"))
    assert ours.fingerprint == theirs.fingerprint
    request = pb.GenerateRequest(text=text)
    assert prompt_ids(request, ours) == theirs.text_prompt_ids(text)
    assert prompt_fingerprint(request, ours) == ours.fingerprint
    assert prompt_fingerprint(pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1])), ours) == ""
    chat = [{"role": "user", "content": "hello"}]
    assert ours.chat_prompt_ids(chat) == theirs.chat_ids(chat)
    with pytest.raises(NoChatTemplate):
        byte.chat_prompt_ids(chat)
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        GatewayTokenizer(str(tmp_path / "nowhere"))


def test_text_waits_for_a_worker_with_the_same_tokenizer():
    metrics = GatewayMetrics()
    auto = GatewayTokenizer(AUTO, metrics)
    assert auto.current() is None and auto.fingerprint == ""
    auto.worker_joined("w0", pb.GetModelInfoResponse(worker="w0"), client=None)  # no tokenizer
    with pytest.raises(TokenizerUnavailable, match="no worker has a tokenizer") as err:
        auto.text_ids("hi")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    byte = GatewayTokenizer(BYTE, metrics)
    byte.worker_joined("w1", pb.GetModelInfoResponse(worker="w1", tokenizer_fingerprint="f" * 64),
                       client=None)
    with pytest.raises(TokenizerUnavailable, match="w1=ffffffffffffffff") as err:
        byte.text_ids("hi")
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert metrics.registry.get_sample_value(
        "prefixcache_gateway_tokenizer_refusals_total", {"reason": "no_compatible_worker"}) == 1
    assert metrics.registry.get_sample_value(
        "prefixcache_gateway_tokenizer_mismatched_workers") == 1
    byte.worker_joined("w2", pb.GetModelInfoResponse(
        worker="w2", tokenizer_fingerprint=byte.fingerprint), client=None)
    assert byte.text_ids("hi") == [257, 104, 105]
    byte.worker_left("w1")
    assert metrics.registry.get_sample_value(
        "prefixcache_gateway_tokenizer_mismatched_workers") == 0


# ---- discovery and tenants, without servers ---------------------------------------------------

def test_static_and_dns_discovery():
    assert parse_static("10.0.0.1:50052, 10.0.0.2:50052@cache:7000", 50051) == [
        WorkerAddress("10.0.0.1:50052", "10.0.0.1:50051"),
        WorkerAddress("10.0.0.2:50052", "cache:7000")]
    for bad in ("nohost", "a:1,a:1", "a:1@b"):
        with pytest.raises(ValueError, match="--workers"):
            parse_static(bad, 50051)
    answers: list = [["10.0.0.2", "10.0.0.1"], OSError("SERVFAIL"), ["fd00::1"]]

    def resolve(host: str, port: int) -> list[str]:
        assert (host, port) == ("compute-headless", 50052)
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return sorted(answer)

    dns = DnsWorkers("compute-headless:50052", 50051, resolve)
    first = dns()
    assert first == [WorkerAddress("10.0.0.1:50052", "10.0.0.1:50051"),
                     WorkerAddress("10.0.0.2:50052", "10.0.0.2:50051")]
    assert dns() == first  # a failed lookup keeps the last answer
    assert dns() == [WorkerAddress("[fd00::1]:50052", "[fd00::1]:50051")]


def test_tenants_file(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tokens": {"t1": {"tenant": "a", "salt": "s"}}}))
    tenants = TenantDirectory.from_file(path)
    assert tenants.authenticate([("authorization", "Bearer t1")]) == Tenant("a", "s")
    anonymous = TenantDirectory.from_file(path, allow_anonymous=True)
    assert anonymous.authenticate([]) == Tenant("anonymous", "")
    path.write_text(json.dumps({"tokens": {"t1": {"salt": "s"}}}))
    with pytest.raises(ValueError, match="tokens entry 0"):
        TenantDirectory.from_file(path)
