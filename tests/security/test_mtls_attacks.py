"""Issue 16: "with mTLS on, any certificate of the CA may call every RPC, e.g. UnregisterPool".
A certificate of the CA is now only a way in to the TLS handshake: the caller is an identity
only when the identities file names its certificate (common name or SAN), and then only with
its role's RPCs and its own pools."""
from __future__ import annotations

import grpc
import pytest

from prefixcache.v1 import cache_service_pb2 as pb
from service_shell import TlsConfig
from service_shell.auth import ServiceIdentities
from tests.security.harness import (DENIED, TOKENS, UNAUTHENTICATED, VICTIM_POOL, VICTIM_PROMPT,
                                    cache_prompt, refused, register, secure_cache,
                                    write_identities)
from tests.service_shell.certs import _Ca  # the suite's throwaway PKI

WORKER_CERT = "worker-1.prefixcache.internal"
OPS_CERT = "ops.prefixcache.internal"


@pytest.fixture
def pki(tmp_path):
    ca = _Ca("prefixcache-security-ca")
    return {"ca": ca.save(tmp_path / "ca.crt"),
            "server": ca.issue(tmp_path / "server", "server", server=True),
            "worker": ca.issue(tmp_path / "worker", WORKER_CERT, server=False, dns=(WORKER_CERT,),
                               ips=()),
            "ops": ca.issue(tmp_path / "ops", "ops", server=False, dns=(OPS_CERT,), ips=()),
            # Signed by the same CA, named in no identity: what "any certificate" was.
            "intruder": ca.issue(tmp_path / "intruder", "intruder", server=False)}


def credentials(pki, leaf: str) -> grpc.ChannelCredentials:
    read = lambda path: open(path, "rb").read()  # noqa: E731
    return grpc.ssl_channel_credentials(read(pki["ca"]), read(pki[leaf].key),
                                        read(pki[leaf].cert))


def test_attack_any_certificate_of_the_ca_may_call_every_rpc(tmp_path, pki):
    extra = [{"name": "worker-1-cert", "role": "worker", "certificate_names": [WORKER_CERT],
              "pools": [VICTIM_POOL]},
             {"name": "ops-cert", "role": "operator", "certificate_names": [OPS_CERT]}]
    tls = TlsConfig(cert=pki["server"].cert, key=pki["server"].key, ca=pki["ca"])
    auth = ServiceIdentities.from_file(write_identities(tmp_path, extra))
    with secure_cache(tmp_path, tls=tls, auth=auth) as cache:
        with cache.stub(credentials=credentials(pki, "worker")) as worker:
            register(worker)  # the certificate alone is the worker's identity
            cache_prompt(worker, VICTIM_PROMPT)
        before = cache.victim_stats()
        unregister = pb.UnregisterPoolRequest(pool_id=VICTIM_POOL)
        with cache.stub(credentials=credentials(pki, "intruder")) as intruder:
            message = refused(lambda: intruder.UnregisterPool(unregister, timeout=5),
                              UNAUTHENTICATED)
            assert "client certificate 'intruder' is not an identity" in message
            for call in (lambda: register(intruder, epoch=2),
                         lambda: intruder.Subscribe(pb.SubscribeRequest(pool_id=VICTIM_POOL),
                                                    timeout=5),
                         lambda: intruder.GetStats(pb.GetStatsRequest(), timeout=5)):
                refused(call, UNAUTHENTICATED)
        # A known certificate presenting another identity's role: still its own role's calls.
        with cache.stub(TOKENS["worker-2"], credentials=credentials(pki, "intruder")) as other:
            refused(lambda: other.UnregisterPool(unregister, timeout=5), DENIED)
        after = cache.victim_stats()
        assert cache.victim_info().epoch == 1
        assert after.media[0].cached_pages == before.media[0].cached_pages > 0
        assert cache.refusals("UnregisterPool", "unknown_certificate") == 1
        with cache.stub(credentials=credentials(pki, "ops")) as ops:  # the operator's call
            ops.UnregisterPool(unregister, timeout=5)
        assert cache.server.core.list_pools(pb.ListPoolsRequest()).pools == []
