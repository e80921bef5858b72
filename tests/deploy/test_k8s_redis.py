"""Redis as the manifests run it (design.md §4, "Redis AUTH, ACL and TLS"), on a real
redis-server: the rendered arguments (ACL users, TLS files, cluster settings) with test files
and ports put in, and the services' L3 client logging in as the manifests' `prefixcache` user.
That user can do what L3 needs and nothing else; the `default` user is off; TLS is mutual; the
redis-cluster component's nodes serve a cluster the client uses."""
from __future__ import annotations

import pytest
import redis

from pagestore.client import L3Client, L3Config
from pagestore.settings import RedisSettings
from prefixcache_bench.local_redis import RedisClusterServers, start_redis
from tests.deploy.manifests import by_kind, container
from tests.service_shell.certs import make_pki

PASSWORD, ADMIN_PASSWORD = "test-password-0123", "test-admin-password-0123"
PAGES = [bytes([i]) * 16 for i in range(12)]
LOOPBACK = ["--bind", "127.0.0.1"]


def local_args(args: list[str], port: int, tmp, files: dict[str, str] | None = None) -> list[str]:
    """The rendered redis-server arguments runnable here: secrets, port, directory and
    mounted files replaced."""
    out = []
    for a in args:
        a = a.replace("$(REDIS_PASSWORD)", PASSWORD).replace("$(REDIS_ADMIN_PASSWORD)",
                                                              ADMIN_PASSWORD)
        a = a.replace("$(REDIS_MAXMEMORY)", "64mb")
        a = {"6379": str(port), "/data": str(tmp)}.get(a, a)
        out.append((files or {}).get(a, a))
    return out


def worker_settings(docs, tmp, port: int, **files: str) -> RedisSettings:
    """What the compute container's settings say, pointed at 127.0.0.1:port."""
    c = container(docs, "compute", "compute")
    url = c.env_value("PREFIXCACHE_REDIS_URL").replace("@redis:6379", f"@127.0.0.1:{port}")
    password_file = tmp / "password"
    password_file.write_text(PASSWORD + "\n")
    assert c.env_value("PREFIXCACHE_REDIS_PASSWORD_FILE")
    return RedisSettings(url, password_file=str(password_file), **files)


def exercise(settings: RedisSettings) -> None:
    """Everything the L3 client does, as the restricted user."""
    l3 = L3Client(L3Config(settings.url, redis=settings, timeout_s=1.0))
    assert l3.check(2.0), l3.down_cause
    assert l3.set_many("m", [(h, b"page") for h in PAGES]) == len(PAGES)
    assert l3.probe("m", PAGES) == len(PAGES)
    assert l3.get_many("m", PAGES[:3]) == [b"page"] * 3
    l3.delete("m", PAGES[0])
    assert l3.probe("m", PAGES) == 0
    assert l3.counters.calls["errors"] == 0


def test_the_acl_lets_the_services_do_l3_and_nothing_else(renders, tmp_path):
    docs = renders["dev-cpu"]
    args = container(docs, "redis", "redis").spec["args"]
    proc, port = start_redis(lambda p: [*local_args(args, p, tmp_path), *LOOPBACK],
                             lambda p: _answers(p, "prefixcache", PASSWORD))
    try:
        exercise(worker_settings(docs, tmp_path, port))
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()  # the default user is off
        user = redis.Redis(port=port, username="prefixcache", password=PASSWORD)
        for forbidden in (lambda: user.flushall(), lambda: user.config_get("*"),
                          lambda: user.keys("*"), lambda: user.set("other:key", b"x"),
                          lambda: user.eval("return 1", 0)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                forbidden()
    finally:
        proc.kill()
        proc.wait()


def test_redis_tls_is_mutual_and_the_workers_verify_it(renders, tmp_path):
    docs = renders["dev-cpu+mtls+redis-tls"]
    c = container(docs, "redis", "redis")
    cert = next(d for d in by_kind(docs, "Certificate") if d["metadata"]["name"] == "redis-tls")
    assert cert["spec"]["issuerRef"]["name"] == "prefixcache-ca" and "redis" in \
        cert["spec"]["dnsNames"]
    mount = next(m for m in c.spec["volumeMounts"] if m["name"] == "redis-tls")["mountPath"]
    assert c.volume("redis-tls")["secret"]["secretName"] == cert["spec"]["secretName"]
    pki = make_pki(tmp_path)
    files = {f"{mount}/tls.crt": pki.server.cert, f"{mount}/tls.key": pki.server.key,
             f"{mount}/ca.crt": pki.ca}
    assert c.spec["args"][c.spec["args"].index("--port") + 1] == "0"  # no plaintext port
    proc, port = start_redis(lambda p: [*local_args(c.spec["args"], p, tmp_path, files),
                                        *LOOPBACK],
                             lambda p: _tls_answers(p, pki))
    try:
        w = container(docs, "compute", "compute")
        assert w.env_value("PREFIXCACHE_REDIS_URL").startswith("rediss://")
        for env in ("PREFIXCACHE_REDIS_TLS_CA", "PREFIXCACHE_REDIS_TLS_CERT",
                    "PREFIXCACHE_REDIS_TLS_KEY"):
            assert w.env_value(env).rpartition("/")[0] in w.mounts(), env
        settings = worker_settings(docs, tmp_path, port, tls_ca=pki.ca, tls_cert=pki.client.cert,
                                   tls_key=pki.client.key)
        exercise(settings)
        # Without a client certificate, or with one of another CA: refused, a cause logged.
        no_cert = RedisSettings(settings.url, password_file=settings.password_file,
                                tls_ca=pki.ca)
        assert no_cert.check(1.0) is not None
        stranger = RedisSettings(settings.url, password_file=settings.password_file,
                                 tls_ca=pki.ca, tls_cert=pki.stranger.cert,
                                 tls_key=pki.stranger.key)
        assert stranger.check(1.0) is not None
    finally:
        proc.kill()
        proc.wait()


def test_the_cluster_component_serves_l3_with_the_same_acl(renders, tmp_path):
    docs = renders["dev-cpu+redis-cluster"]
    sts = next(d for d in by_kind(docs, "StatefulSet") if d["metadata"]["name"] == "redis")
    assert sts["spec"]["replicas"] == 3
    args = container(docs, "redis", "redis").spec["args"]
    flags = {args[i]: args[i + 1] for i, a in enumerate(args[:-1]) if a.startswith("--")}
    assert flags["--cluster-enabled"] == "yes" and flags["--cluster-require-full-coverage"] == "no"
    assert flags["--cluster-config-file"].startswith("/data/")
    assert {v["metadata"]["name"] for v in sts["spec"]["volumeClaimTemplates"]} == {"data"}
    # The ACL users, as the test cluster's nodes run them (it supplies ports and cluster flags).
    users = local_args(_users(args), 0, tmp_path)
    with RedisClusterServers(tmp_path, extra_args=tuple(users),
                             admin=("admin", ADMIN_PASSWORD)) as cluster:
        w = container(docs, "compute", "compute")
        assert w.env_value("PREFIXCACHE_REDIS_URL").startswith("redis+cluster://prefixcache@")
        port = cluster.ports[0]
        settings = worker_settings(docs, tmp_path, port)
        assert settings.cluster
        exercise(settings)
    job = next(d for d in by_kind(docs, "Job") if d["metadata"]["name"] == "redis-cluster-create")
    script = job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "--cluster create" in script and "--cluster-replicas 0" in script


def _users(args: list[str]) -> list[str]:
    """The `--user ...` arguments of a redis-server argument list."""
    out, inside = [], False
    for a in args:
        if a.startswith("--"):
            inside = a == "--user"
        if inside:
            out.append(a)
    return out


def _answers(port: int, user: str, password: str) -> bool:
    try:
        return redis.Redis(port=port, username=user, password=password,
                           socket_timeout=0.2).ping()
    except redis.RedisError:
        return False


def _tls_answers(port: int, pki) -> bool:
    try:
        return redis.Redis(port=port, username="prefixcache", password=PASSWORD, ssl=True,
                           ssl_ca_certs=pki.ca, ssl_certfile=pki.client.cert,
                           ssl_keyfile=pki.client.key, socket_timeout=0.2).ping()
    except redis.RedisError:
        return False
