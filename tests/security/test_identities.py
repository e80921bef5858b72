"""The service-identities file, the token file and the command lines that take them: bad files
fail the start naming the entry and field (never the token); without a file the server says
loudly that auth is off; with one, `python -m cache_service` refuses an anonymous caller."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import grpc
import pytest

from prefixcache.v1 import cache_service_pb2 as pb
from prefixcache.v1 import cache_service_pb2_grpc as pb_grpc
from service_shell.auth import AuthError, ServiceIdentities
from service_shell.service_token import read_token, with_service_token
from tests.cache_service.grpc_harness import REPO, running_server, server_process
from tests.security.harness import TOKENS, UNAUTHENTICATED, refused, write_identities

SECRET = "a-secret-token-that-must-not-leak"


@pytest.mark.parametrize("entry, error", [
    ({"role": "worker", "token": SECRET}, "identities[0].name: must be a non-empty string"),
    ({"name": "x", "role": "admin", "token": SECRET}, "identities[0].role: must be one of"),
    ({"name": "x", "role": "worker", "token": "short"}, "at least 16 characters"),
    ({"name": "x", "role": "worker", "token_sha256": "abc"}, "token_sha256: must be 64 hex"),
    ({"name": "x", "role": "worker"}, "needs token_sha256, token or certificate_names"),
    ({"name": "x", "role": "worker", "token": SECRET, "pools": "w1"}, "pools: must be a list"),
])
def test_a_bad_identities_file_names_the_entry_and_field(tmp_path, entry, error):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps({"identities": [entry]}))
    with pytest.raises(ValueError) as err:
        ServiceIdentities.from_file(path)
    assert error in str(err.value) and "--service-identities-file" in str(err.value)
    assert SECRET not in str(err.value)


def test_a_token_given_twice_is_refused(tmp_path):
    path = tmp_path / "ids.json"
    path.write_text(json.dumps({"identities": [
        {"name": "a", "role": "worker", "token": SECRET},
        {"name": "b", "role": "operator", "token": SECRET}]}))
    with pytest.raises(ValueError, match=r"identities\[1\]: its token is also another"):
        ServiceIdentities.from_file(path)


def test_token_files(tmp_path):
    (tmp_path / "t").write_text(f"  {SECRET}\n")
    assert read_token(tmp_path / "t") == SECRET
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="--service-token-file .* the file is empty"):
        read_token(tmp_path / "empty")
    with pytest.raises(ValueError, match="--service-token-file .*missing"):
        read_token(tmp_path / "missing")


def test_without_identities_the_server_warns_that_auth_is_off(caplog):
    with caplog.at_level(logging.WARNING, logger="service_shell.auth"):
        with running_server() as server:
            with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                pb_grpc.CacheServiceStub(channel).ListPools(pb.ListPoolsRequest(), timeout=5)
    assert any("event=auth_disabled" in r.getMessage() for r in caplog.records)


def test_the_cache_service_cli_takes_the_file_from_the_environment(tmp_path):
    ids = write_identities(tmp_path)
    env = {"PREFIXCACHE_SERVICE_IDENTITIES_FILE": str(ids)}
    with server_process(0, env=env) as proc:
        with grpc.insecure_channel(proc.target) as channel:
            anonymous = pb_grpc.CacheServiceStub(channel)
            refused(lambda: anonymous.ListPools(pb.ListPoolsRequest(), timeout=10),
                    UNAUTHENTICATED)
            known = pb_grpc.CacheServiceStub(with_service_token(channel, TOKENS["subscriber"]))
            assert known.ListPools(pb.ListPoolsRequest(), timeout=10).pools == []
        proc.terminate()
        assert proc.exit_code() == 0
        assert "event=auth_enabled" in proc.log()


def test_the_cache_service_cli_refuses_a_bad_file(tmp_path):
    bad = tmp_path / "ids.json"
    bad.write_text(json.dumps({"identities": [{"name": "x", "role": "root", "token": SECRET}]}))
    with pytest.raises(RuntimeError) as err:
        with server_process(0, "--service-identities-file", str(bad)):
            pass
    assert "identities[0].role: must be one of" in str(err.value)
    assert SECRET not in str(err.value)


@pytest.mark.parametrize("argv", [
    ["gateway", "--workers", "127.0.0.1:1", "--allow-anonymous"],
    ["compute_service", "--model", "tiny-transformer"],
])
def test_a_missing_token_file_fails_the_start_naming_the_flag(tmp_path, argv):
    res = subprocess.run([sys.executable, "-m", *argv, "--service-token-file",
                          str(tmp_path / "missing")], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 2, res.stderr
    assert "--service-token-file (PREFIXCACHE_SERVICE_TOKEN_FILE)" in res.stderr
    assert "No such file or directory" in res.stderr


def test_authenticate_by_token_or_certificate_name(tmp_path):
    ids = ServiceIdentities.from_file(write_identities(tmp_path, [
        {"name": "ops-cert", "role": "operator", "certificate_names": ["ops.example.com"]}]))
    key = "x-prefixcache-service-token"
    assert ids.authenticate([(key, TOKENS["gateway"])]).role == "gateway"  # given as a digest
    assert ids.authenticate([(key, TOKENS["worker-1"].encode())]).name == "worker-1"
    san = {"x509_common_name": [b"ops"], "x509_subject_alternative_name": [b"ops.example.com"]}
    assert ids.authenticate([], san).name == "ops-cert"
    assert ids.authenticate([], lambda: san).name == "ops-cert"  # read only when needed
    for metadata, context, reason in (
            ([(key, TOKENS["gateway"]), (key, TOKENS["gateway"])], None, "duplicate_token"),
            ([(key, SECRET)], san, "unknown_token"),  # a bad token is not rescued by a cert
            ([], {"x509_common_name": [b"intruder"]}, "unknown_certificate"),
            ([("authorization", f"Bearer {TOKENS['operator']}")], None, "missing_credentials")):
        with pytest.raises(AuthError) as err:
            ids.authenticate(metadata, context)
        assert err.value.reason == reason and err.value.code == UNAUTHENTICATED
        assert SECRET not in err.value.message
