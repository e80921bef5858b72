"""The shared index's Redis as components/shared-index runs it (design.md, "Many gateway
replicas"), on a real redis-server: the rendered arguments with a test password and port, and the
gateway's own shared-index client (lease, apply script, worker table, lookups) logging in as the
manifests' `gateway-index` user with the URL and password file the gateway container is given.
That user can do what the shared index needs and nothing else; the `default` user is off; the
L3 user does not exist there. And the gateway container's settings, which include the base's
service token, are a gateway the flags accept."""
from __future__ import annotations

import pytest
import redis

from gateway.__main__ import config_from_args, parse_args
from gateway.core.feed_streams import token_metadata
from gateway.core.shared_index import SharedIndexConfig, SharedIndexStore, SharedIndexView
from gateway.core.shared_indexer import StreamWriter
from prefixcache.v1 import common_pb2, events_pb2
from prefixcache_bench.local_redis import start_redis
from service_shell.auth import GATEWAY
from tests.deploy.manifests import container, one
from tests.deploy.test_k8s_redis import LOOPBACK, PASSWORD, _answers, local_args
from tests.deploy.test_k8s_service_auth import TOKEN_ENV, identities, mounted_secret

PAGES = [bytes([i]) * 16 for i in range(8)]


def _gateway_store(docs, tmp, port: int) -> SharedIndexStore:
    """The gateway container's shared-index settings, pointed at 127.0.0.1:port."""
    c = container(docs, "gateway", "gateway")
    assert c.env_value("PREFIXCACHE_INDEX_BACKEND") == "redis"
    url = c.env_value("PREFIXCACHE_INDEX_REDIS_URL")
    assert url == "redis://gateway-index@index-redis:6379/0"
    secret_file = c.env_value("PREFIXCACHE_INDEX_REDIS_PASSWORD_FILE")
    mount, _, key = secret_file.rpartition("/")
    volume = c.volume(c.mounts()[mount]["name"])
    assert volume["secret"]["secretName"].startswith("index-redis-auth") and key == "password"
    password_file = tmp / "password"
    password_file.write_text(PASSWORD + "\n")
    return SharedIndexStore(SharedIndexConfig(
        url.replace("@index-redis:6379", f"@127.0.0.1:{port}"), "fleet",
        password_file=str(password_file)))


def _batch(seq: int) -> events_pb2.EventBatch:
    ev = events_pb2.KvEvent(stored=events_pb2.BlockStored(block_hashes=PAGES,
                                                          medium=common_pb2.MEDIUM_DEVICE))
    return events_pb2.EventBatch(pool_id="w0", epoch=1, seq=seq, events=[ev])


@pytest.mark.parametrize("variant", ["dev-cpu+shared-index", "gpu+monitoring+shared-index"])
def test_the_gateway_replicas_share_the_index_as_a_restricted_acl_user(renders, tmp_path, variant):
    docs = renders[variant]
    redis_container = container(docs, "index-redis", "redis")
    password_ref = redis_container.env()["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert password_ref["name"].startswith("index-redis-auth")
    assert one(docs, "Service", "index-redis")
    args = redis_container.spec["args"]
    proc, port = start_redis(lambda p: [*local_args(args, p, tmp_path), *LOOPBACK],
                             lambda p: _answers(p, "gateway-index", PASSWORD))
    try:
        store = _gateway_store(docs, tmp_path, port)
        assert store.try_lease("w0", "replica-a") and not store.try_lease("w0", "replica-b")
        writer = StreamWriter(store, "w0", "replica-a")
        assert writer.apply(_batch(0)) == len(PAGES)
        found = SharedIndexView(store).lookup(PAGES)
        assert found["w0"].device_pages == len(PAGES)
        assert writer.resume_point() == (1, 0)
        store.release("w0", "replica-a")
        assert store.try_lease("w0", "replica-b")  # the next replica takes over
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()  # the default user is off
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port, username="prefixcache", password=PASSWORD).ping()  # L3's user
        user = redis.Redis(port=port, username="gateway-index", password=PASSWORD)
        for forbidden in (lambda: user.flushall(), lambda: user.config_get("*"),
                          lambda: user.keys("*"), lambda: user.set("pc:l3-page", b"x"),
                          lambda: user.eval("return 1", 0), lambda: user.get("other:key")):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
    finally:
        proc.kill()
        proc.wait()


def test_only_the_gateway_reaches_the_index_redis(renders):
    docs = renders["dev-cpu+shared-index"]
    ingress = one(docs, "NetworkPolicy", "index-redis-ingress")["spec"]
    assert ingress["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "index-redis"}
    assert [f["podSelector"]["matchLabels"] for f in ingress["ingress"][0]["from"]] == \
        [{"app.kubernetes.io/name": "gateway"}]
    egress = one(docs, "NetworkPolicy", "gateway-index-redis-egress")["spec"]["egress"][0]
    assert egress["to"][0]["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "index-redis"}
    assert "index-redis" not in str(renders["dev-cpu"])  # only with the component


def test_the_gateway_takes_the_shared_index_with_the_bases_service_token(renders, tmp_path,
                                                                        monkeypatch):
    """The gateway container's settings, its mounted files written locally, as `python -m
    gateway` reads them: the redis backend together with the base's service token (refused
    until the indexers sent it, issue 31), which the indexers present to the cache sidecars."""
    docs = renders["dev-cpu+shared-index"]
    c = container(docs, "gateway", "gateway")
    for name, entry in c.env().items():
        if not name.startswith("PREFIXCACHE_"):
            continue
        value = entry["value"].replace("$(POD_NAMESPACE)", "prefixcache")
        if name.endswith("_FILE"):  # a mounted Secret's key, written where the test reads it
            local = tmp_path / name.lower()
            local.write_bytes(mounted_secret(docs, c, name))
            value = str(local)
        monkeypatch.setenv(name, value)
    cfg = config_from_args(parse_args([]))
    token = mounted_secret(docs, c, TOKEN_ENV).decode().strip()
    assert (cfg.index_backend, cfg.worker.service_token) == ("redis", token)
    # The base's feed process beside the shared index (as test_shared_index_gateways.py runs
    # them together).
    assert cfg.worker.feed_process
    cache = identities(docs, container(docs, "compute", "cache"), tmp_path)
    assert cache.authenticate(token_metadata(cfg.worker.service_token)).role == GATEWAY
