"""Service authentication is on in every rendering (design.md §8, "Service identities"): the
cache sidecar and the engine read a mounted identities file, the gateway and the engine present
mounted tokens, and those tokens are the identities the roles need (the example secrets are
marked as examples and hold only digests)."""
from __future__ import annotations

import base64
import json

from service_shell.auth import GATEWAY, WORKER, ServiceIdentities, token_digest
from tests.deploy.manifests import container, generated, one

IDENTITIES_ENV, TOKEN_ENV = "PREFIXCACHE_SERVICE_IDENTITIES_FILE", "PREFIXCACHE_SERVICE_TOKEN_FILE"


def mounted_secret(docs, c, env: str) -> bytes:
    """The bytes of the Secret key that container `c` reads at $env, checking the mount."""
    path = c.env_value(env)
    assert path, f"{c.name}: {env} is not set"
    mount_path, _, key = path.rpartition("/")
    mount = c.mounts()[mount_path]
    assert mount["readOnly"] is True, (c.name, mount)
    secret = c.volume(mount["name"])["secret"]["secretName"]
    return base64.b64decode(one(docs, "Secret", secret)["data"][key])


def identities(docs, c, tmp_path) -> ServiceIdentities:
    path = tmp_path / f"{c.name}-identities.json"
    path.write_bytes(mounted_secret(docs, c, IDENTITIES_ENV))
    return ServiceIdentities.from_file(path)


def test_the_compute_and_cache_services_require_known_identities(docs, tmp_path):
    for name in ("cache", "compute"):
        assert len(identities(docs, container(docs, "compute", name), tmp_path)) >= 3, name


def test_the_gateway_and_the_engine_present_tokens_of_their_roles(docs, tmp_path):
    cache = identities(docs, container(docs, "compute", "cache"), tmp_path)
    engine = container(docs, "compute", "compute")
    gateway_token = mounted_secret(docs, container(docs, "gateway", "gateway"), TOKEN_ENV)
    worker_token = mounted_secret(docs, engine, TOKEN_ENV)
    meta = lambda token: [("x-prefixcache-service-token", token.decode().strip())]  # noqa: E731
    gateway = cache.authenticate(meta(gateway_token))
    worker = cache.authenticate(meta(worker_token))
    assert (gateway.role, worker.role) == (GATEWAY, WORKER)
    # The engine's pool is its pod's name (a Deployment's pods are compute-<hash>-<id>): the
    # worker identity may use exactly such pools.
    assert engine.env_value("PREFIXCACHE_POOL_ID") == "$(POD_NAME)"
    assert worker.may_use_pool("compute-7d9f8b6c5-x2x4z") and not worker.may_use_pool("gateway")


def test_the_example_service_secrets_are_marked_and_hold_only_digests(docs):
    data = generated(docs, "Secret", "service-identities")["data"]["service-identities.json"]
    doc = json.loads(base64.b64decode(data))
    assert "EXAMPLE ONLY" in doc["_comment"]
    assert all("token" not in e and len(e["token_sha256"]) == 64 for e in doc["identities"])
    for name in ("gateway-service-token", "worker-service-token"):
        token = base64.b64decode(generated(docs, "Secret", name)["data"]["token"]).decode().strip()
        assert token.startswith("EXAMPLE-ONLY-"), name
        assert token_digest(token).hex() in {e["token_sha256"] for e in doc["identities"]}


def test_the_pods_serve_beyond_loopback_only_with_identities(docs):
    """Issue 25 finding 9: the services bind loopback by default and refuse a network address
    without identities; the pods set theirs explicitly, with identities, and never the flag that
    would serve the network unauthenticated."""
    for name, variable in (("cache", "PREFIXCACHE_CACHE_HOST"),
                           ("compute", "PREFIXCACHE_COMPUTE_HOST")):
        c = container(docs, "compute", name)
        assert c.env_value(variable) == "[::]", name
        assert c.env_value(IDENTITIES_ENV), name
        assert not c.env_value("PREFIXCACHE_ALLOW_UNAUTHENTICATED_NETWORK"), name
