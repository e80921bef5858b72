"""The inference-extension component: InferencePools of the workers (their model servers' OpenAI
HTTP, their engines' gRPC) whose Endpoint Picker is the gateway's ext_proc port, a model server
beside every worker, an HTTPRoute to both pools, and only the flows the data plane needs."""
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
@pytest.mark.parametrize("name, port, protocol", [
    ("prefixcache-workers", 8000, "http"),  # the model servers: OpenAI HTTP, as vLLM pods
    ("prefixcache-workers-grpc", 50052, "kubernetes.io/h2c")])  # the engines' gRPC API
def test_the_pools_are_the_workers_ports_and_their_picker_the_gateway(renders, variant, name,
                                                                      port, protocol):
    docs = renders[variant]
    pool = one(docs, "InferencePool", name)["spec"]
    compute = one(docs, "Deployment", "compute")
    assert selects({"matchLabels": pool["selector"]["matchLabels"]}, pod_labels(compute))
    assert not [w for w in workloads(docs) if w is not compute
                and selects({"matchLabels": pool["selector"]["matchLabels"]}, pod_labels(w))]
    listening = {p["containerPort"] for c in pod_spec(compute)["containers"]
                 for p in c.get("ports", [])}
    assert [p["number"] for p in pool["targetPorts"]] == [port] and port in listening
    assert pool["appProtocol"] == protocol
    gateway = container(docs, "gateway", "gateway")
    # The workers the picker chooses among are the gRPC pool's pods (a watch on the API), the
    # endpoints it names their engine port or the same pod's model server.
    assert gateway.env_value("PREFIXCACHE_WORKERS_INFERENCEPOOL") == "prefixcache-workers-grpc"
    assert gateway.env_value("PREFIXCACHE_WORKERS_DNS") is None
    assert gateway.env_value("PREFIXCACHE_EPP_MODEL_SERVER_PORT") == "8000"
    ref = pool["endpointPickerRef"]
    assert ref["failureMode"] == "FailClose"
    service = one(docs, "Service", ref["name"])
    assert selects({"matchLabels": service["spec"]["selector"]},
                   pod_labels(one(docs, "Deployment", "gateway")))
    svc_port = next(p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"])
    epp_port = int(gateway.env_value("PREFIXCACHE_EPP_PORT"))
    named = {p["name"]: p["containerPort"] for p in gateway.spec["ports"]}
    assert named[svc_port["targetPort"]] == epp_port


@pytest.mark.parametrize("variant", WITH)
def test_every_worker_has_a_model_server_for_the_data_plane_only(renders, variant, tmp_path):
    from service_shell.auth import DATAPLANE, GATEWAY
    from tests.deploy.test_k8s_service_auth import identities, mounted_secret

    docs = renders[variant]
    ms = container(docs, "compute", "model-server")
    assert ms.env_value("PREFIXCACHE_MODEL_SERVER") == "1"
    assert ms.env_value("PREFIXCACHE_WORKERS") == "localhost:50052@localhost:50051"
    assert ms.env_value("PREFIXCACHE_HTTP_PORT") == "8000"
    assert not ms.env_value("PREFIXCACHE_TENANTS_FILE")
    # The gateway's program, at the image the overlay pinned the gateway to.
    assert ms.spec["image"] == container(docs, "gateway", "gateway").spec["image"]
    # It calls its engine and cache sidecar as the gateway does...
    token = mounted_secret(docs, ms, "PREFIXCACHE_SERVICE_TOKEN_FILE").decode().strip()
    for name in ("compute", "cache"):
        assert identities(docs, container(docs, "compute", name), tmp_path).authenticate(
            [("x-prefixcache-service-token", token)]).role == GATEWAY
    # ...and takes calls from the data plane only.
    plane = base64.b64decode(generated(docs, "Secret", "dataplane-service-token")["data"]
                             ["token"]).decode().strip()
    assert identities(docs, ms, tmp_path).authenticate(
        [("x-prefixcache-service-token", plane)]).role == DATAPLANE
    # Its ports do not collide with the engine's and the sidecar's (one network namespace).
    spec = pod_spec(one(docs, "Deployment", "compute"))
    ports = [p["containerPort"] for c in spec.get("initContainers", []) + spec["containers"]
             for p in c.get("ports", [])]
    assert len(ports) == len(set(ports)), ports
    assert ms.env_value("PREFIXCACHE_GATEWAY_PORT") not in {str(p) for p in ports}


@pytest.mark.parametrize("variant", WITH)
def test_the_route_sends_each_api_to_its_pool(renders, variant):
    docs = renders[variant]
    (route,) = by_kind(docs, "HTTPRoute")
    grpc_rule, http_rule = route["spec"]["rules"]
    assert [m["path"] for m in grpc_rule["matches"]] == [
        {"type": "PathPrefix", "value": "/prefixcache.v1.ComputeService/"}]
    assert grpc_rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                         "kind": "InferencePool",
                                         "name": "prefixcache-workers-grpc"}]
    # The OpenAI API: the workers' model servers, picked by the same Endpoint Picker.
    assert [m["path"] for m in http_rule["matches"]] == [{"type": "PathPrefix", "value": "/v1/"}]
    assert http_rule["backendRefs"] == [{"group": "inference.networking.k8s.io",
                                         "kind": "InferencePool", "name": "prefixcache-workers"}]
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
    assert policies.allows(PROXY, compute, 8000)
    for src, dst, port in [(CLIENT, gateway, 9002), (CLIENT, compute, 50052),
                           (CLIENT, compute, 8000), (PROXY, compute, 50053),
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


@pytest.mark.parametrize("variant", WITH)
def test_the_gateway_reads_only_its_pool_and_pods(renders, variant):
    """The picker's one use of the Kubernetes API: get the gRPC pool, list / watch pods, in its
    namespace (gateway/core/inferencepool.py); no other pod mounts an API token."""
    docs = renders[variant]
    (role,) = by_kind(docs, "Role")
    assert not by_kind(docs, "ClusterRole") and not by_kind(docs, "ClusterRoleBinding")
    assert sorted((tuple(r["resources"]), tuple(r["verbs"]), tuple(r.get("resourceNames", ())))
                  for r in role["rules"]) == [
        (("inferencepools",), ("get",), ("prefixcache-workers-grpc",)),
        (("pods",), ("list", "watch"), ())]
    (binding,) = by_kind(docs, "RoleBinding")
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gateway",
                                    "namespace": NAMESPACE}]
    for w in workloads(docs):
        mounted = pod_spec(w).get("automountServiceAccountToken")
        assert mounted is (w["metadata"]["name"] == "gateway"), w["metadata"]["name"]
