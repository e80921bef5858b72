"""The optional components: Prometheus Operator scraping and cert-manager mTLS."""
from __future__ import annotations

import pytest

from tests.deploy.manifests import (NAMESPACE, VARIANTS, by_kind, container, pod_labels, pod_spec,
                                    selects)
from tests.deploy.test_k8s_workloads import SERVICES

WITH_MONITORING = sorted(v for v, (_, comps) in VARIANTS.items() if "monitoring" in comps)
WITH_MTLS = sorted(v for v, (_, comps) in VARIANTS.items() if "mtls" in comps)
WITHOUT_MTLS = sorted(v for v, (_, comps) in VARIANTS.items() if "mtls" not in comps)
TLS_ENV = ("PREFIXCACHE_TLS_CERT", "PREFIXCACHE_TLS_KEY", "PREFIXCACHE_TLS_CA")


@pytest.mark.parametrize("variant", WITH_MONITORING)
def test_one_service_monitor_per_service_scrapes_its_metrics_port(renders, variant):
    docs = renders[variant]
    monitors = by_kind(docs, "ServiceMonitor")
    services = by_kind(docs, "Service")
    scraped = {}
    for m in monitors:
        matched = [s for s in services
                   if selects(m["spec"]["selector"], s["metadata"].get("labels", {}))]
        assert len(matched) == 1, m["metadata"]["name"]
        svc = matched[0]
        for endpoint in m["spec"]["endpoints"]:
            port = next(p for p in svc["spec"]["ports"] if p["name"] == endpoint["port"])
            target = port["targetPort"]
            if isinstance(target, str):  # a named port of the selected pods' containers
                pods = [w for w in by_kind(docs, "Deployment")
                        if selects(svc["spec"]["selector"], pod_labels(w))]
                target = next(p["containerPort"] for c in pod_spec(pods[0])["containers"]
                              for p in c.get("ports", []) if p["name"] == target)
            scraped[svc["metadata"]["labels"]["prefixcache.io/service"]] = target
    assert scraped == {name: s["metrics"] for name, s in SERVICES.items()}


@pytest.mark.parametrize("variant", WITH_MTLS)
def test_mtls_certificates_are_issued_by_the_namespace_ca(renders, variant):
    docs = renders[variant]
    issuers = {i["metadata"]["name"]: i["spec"] for i in by_kind(docs, "Issuer")}
    certs = {c["metadata"]["name"]: c["spec"] for c in by_kind(docs, "Certificate")}
    ca = certs["prefixcache-ca"]
    assert ca["isCA"] is True and "selfSigned" in issuers[ca["issuerRef"]["name"]]
    for name in ("gateway-tls", "compute-tls"):
        spec = certs[name]
        issuer = issuers[spec["issuerRef"]["name"]]
        assert issuer["ca"]["secretName"] == ca["secretName"], name
        assert {"server auth", "client auth"} <= set(spec["usages"]), name
        for dns in spec["dnsNames"]:
            labels = dns.split(".")
            if "svc" in labels:   # service.namespace.svc[.cluster.local]
                assert labels[labels.index("svc") - 1] == NAMESPACE, (name, dns)
            elif len(labels) == 2:  # service.namespace
                assert labels[1] == NAMESPACE, (name, dns)
    assert "gateway" in certs["gateway-tls"]["dnsNames"]
    assert "localhost" in certs["compute-tls"]["dnsNames"]   # the engine dials its sidecar


@pytest.mark.parametrize("variant", WITH_MTLS)
def test_every_service_container_mounts_its_certificate(renders, variant):
    docs = renders[variant]
    cert_secrets = {c["spec"]["secretName"]: c["spec"] for c in by_kind(docs, "Certificate")}
    for name, svc in SERVICES.items():
        c = container(docs, svc["workload"], name)
        paths = [c.env_value(k) for k in TLS_ENV]
        assert all(paths), (name, paths)
        directory = {p.rpartition("/")[0] for p in paths}
        assert len(directory) == 1, paths
        mount = c.mounts()[directory.pop()]
        assert mount["readOnly"] is True and "subPath" not in mount, "renewals must reach the pod"
        secret = c.volume(mount["name"])["secret"]["secretName"]
        assert secret in cert_secrets, (name, secret)
        assert sorted(p.rpartition("/")[2] for p in paths) == ["ca.crt", "tls.crt", "tls.key"]
        # Kubelet gRPC probes cannot speak TLS: they stay on the plaintext health port.
        assert c.spec["readinessProbe"]["grpc"]["port"] == svc["health"]
    gateway = container(docs, "gateway", "gateway")
    server_name = gateway.env_value("PREFIXCACHE_TLS_SERVER_NAME")
    assert server_name in cert_secrets["compute-tls"]["dnsNames"]


@pytest.mark.parametrize("variant", WITHOUT_MTLS)
def test_without_the_component_nothing_speaks_tls(renders, variant):
    docs = renders[variant]
    for name, svc in SERVICES.items():
        c = container(docs, svc["workload"], name)
        assert not any(c.env_value(k) for k in TLS_ENV), name
