"""Gateway pieces without servers: no torch, tokenizers, discovery, the tenants file."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from gateway.discovery import DnsWorkers, WorkerAddress, parse_static
from gateway.tenants import Tenant, TenantDirectory
from gateway.tokenize import ByteTokenizer, JsonTokenizer
from tests.cache_service.grpc_harness import REPO


# ---- torch-free, and tokenizers that agree with the workers' --------------------------------

def test_gateway_never_imports_torch():
    code = ("import sys, gateway.server, gateway.__main__, gateway.replay; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


def test_tokenizers_produce_the_workers_ids(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from compute_service.model.tokenizer import ByteTokenizer as WorkerBytes
    from compute_service.model.tokenizer import HFTokenizer

    text = "héllo wörld, ünïcode ✓ and more"
    assert ([ByteTokenizer.bos_token_id] + ByteTokenizer().encode(text)
            == WorkerBytes().encode(text, add_bos=WorkerBytes().bos_token_id is not None))
    assert ByteTokenizer.vocab_size == WorkerBytes().vocab_size
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>", *text.replace(",", " ,").split()])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    ours, theirs = JsonTokenizer(tmp_path), HFTokenizer(tmp_path, 1, (2,))
    assert ours.bos_token_id == 1 and ours.vocab_size == theirs.vocab_size
    assert [1] + ours.encode(text + " unknown") == theirs.encode(text + " unknown", add_bos=True)


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
