"""The inference-extension component: an InferencePool of the workers whose Endpoint Picker is the
gateway's ext_proc port, an HTTPRoute to it, and only the flows the data plane needs."""
from __future__ import annotations

import base64

import pytest

from tests.deploy.manifests import (NAMESPACE, VARIANTS, by_kind, container, generated, one,
                                    pod_labels, pod_spec, selects, workloads)
from tests.deploy.netpol import Peer, Policies

WITH = sorted(v for v, (_, comps) in VARIANTS.items() if "inference-extension" in comps)
# A data-plane proxy (Envoy) of the Gateway, in the namespace the component admits.
PROXY = Peer("envoy", "10.244.6.1", "inference-gateway", {"app": "envoy"})
CLIENT = Peer("client", "10.244.9.1", "clients", {"app": "some-client"})


@pytest.mark.parametrize("variant", WITH)
def test_the_pool_is_the_workers_engine_port_and_its_picker_the_gateway(renders, variant):
    docs = renders[variant]
    pool = one(docs, "InferencePool", "prefixcache-workers")["spec"]
    compute = one(docs, "Deployment", "compute")
    assert selects({"matchLabels": pool["selector"]["matchLabels"]}, pod_labels(compute))
    assert not [w for w in workloads(docs) if w is not compute
                and selects({"matchLabels": pool["selector"]["matchLabels"]}, pod_labels(w))]
    # The endpoints the picker names are the addresses the gateway discovers workers at.
    engine = next(p["containerPort"] for c in pod_spec(compute)["containers"]
                  for p in c.get("ports", []) if p["containerPort"] == 50052)
    assert [p["number"] for p in pool["targetPorts"]] == [engine]
    gateway = container(docs, "gateway", "gateway")
    assert gateway.env_value("PREFIXCACHE_WORKERS_DNS").endswith(f":{engine}")
    assert pool["appProtocol"] == "kubernetes.io/h2c"  # gRPC in cleartext HTTP/2
    ref = pool["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"
    service = one(docs, "Service", ref["name"])
    assert selects({"matchLabels": service["spec"]["selector"]},
                   pod_labels(one(docs, "Deployment", "gateway")))
    port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    epp_port = int(gateway.env_value("PREFIXCACHE_EPP_PORT"))
    named = {p["name"]: p["containerPort"] for p in gateway.spec["ports"]}
    assert named[port["targetPort"]] == epp_port


@pytest.mark.parametrize("variant", WITH)
def test_the_route_sends_the_workers_grpc_api_to_the_pool(renders, variant):
    docs = renders[variant]
    (route,) = by_kind(docs, "HTTPRoute")
    grpc_rule, http_rule = route["spec"]["rules"]
    assert [m["path"] for m in grpc_rule["matches"]] == [
        {"type": "PathPrefix", "value": "/prefixcache.v1.ComputeService/"}]
    assert grpc_rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                         "kind": "InferencePool", "name": "prefixcache-workers"}]
    # The OpenAI API: the gateway's own HTTP port (the workers have none).
    assert [m["path"] for m in http_rule["matches"]] == [{"type": "PathPrefix", "value": "/v1/"}]
    (backend,) = http_rule["backendRefs"]
    service = one(docs, "Service", backend["name"])
    port = next(p for p in service["spec"]["ports"] if p["port"] == backend["port"])
    assert container(docs, "gateway", "gateway").env_value("PREFIXCACHE_HTTP_PORT") == str(
        next(p["containerPort"] for p in container(docs, "gateway", "gateway").spec["ports"]
             if p["name"] == port["targetPort"]))
    # Generate streams outlive Envoy's 15 s default route timeout.
    for rule in (grpc_rule, http_rule):
        assert rule["timeouts"]["request"] == "600s"


@pytest.mark.parametrize("variant", WITH)
def test_only_the_data_plane_reaches_the_picker_and_the_workers(renders, variant):
    docs = renders[variant]
    pods = {w["metadata"]["name"]: Peer(w["metadata"]["name"], f"10.244.1.{i + 1}", NAMESPACE,
                                        pod_labels(w)) for i, w in enumerate(workloads(docs))}
    policies = Policies(docs, NAMESPACE)
    gateway, compute, redis = pods["gateway"], pods["compute"], pods["redis"]
    assert policies.allows(PROXY, gateway, 9002)
    assert policies.allows(PROXY, compute, 50052)
    for src, dst, port in [(CLIENT, gateway, 9002), (CLIENT, compute, 50052),
                           (PROXY, compute, 50051), (PROXY, redis, 6379),
                           (PROXY, compute, 9092), (compute, gateway, 9002)]:
        assert not policies.allows(src, dst, port), f"{src.name} -> {dst.name}:{port} is open"


def test_without_the_component_there_is_no_picker(renders):
    for name, docs in renders.items():
        if "inference-extension" in VARIANTS[name][1]:
            continue
        assert not container(docs, "gateway", "gateway").env_value("PREFIXCACHE_EPP_PORT")
        assert not by_kind(docs, "HTTPRoute"), name


@pytest.mark.parametrize("variant", WITH)
def test_the_data_plane_has_an_identity_of_its_own_and_the_picker_checks_it(renders, variant,
                                                                            tmp_path):
    """Issue 25 finding 1: the EPP authenticates its caller against the mounted identities
    (role dataplane), the data plane's token is a Secret of its own whose identity the workers
    know as `dataplane` (Generate and Abort only), and the gateway pod does not hold it."""
    from service_shell.auth import DATAPLANE
    from tests.deploy.test_k8s_service_auth import IDENTITIES_ENV, identities, mounted_secret

    docs = renders[variant]
    gateway = container(docs, "gateway", "gateway")
    token = base64.b64decode(generated(docs, "Secret", "dataplane-service-token")["data"]
                             ["token"]).decode().strip()
    assert token.startswith("EXAMPLE-ONLY-")
    meta = [("x-prefixcache-service-token", token)]
    assert identities(docs, gateway, tmp_path).authenticate(meta).role == DATAPLANE
    for name in ("compute", "cache"):
        assert identities(docs, container(docs, "compute", name), tmp_path).authenticate(
            meta).role == DATAPLANE
    gateway_token = mounted_secret(docs, gateway, "PREFIXCACHE_SERVICE_TOKEN_FILE")
    assert gateway_token.decode().strip() != token
    mounted = {gateway.volume(m["name"]).get("secret", {}).get("secretName", "")
               for m in gateway.mounts().values()}
    assert not any(s.startswith("dataplane-service-token") for s in mounted)
    assert gateway.env_value(IDENTITIES_ENV)
