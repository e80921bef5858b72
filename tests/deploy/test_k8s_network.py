"""The NetworkPolicies allow exactly the flows the system needs: evaluated over a matrix of the
namespace's pods and the outside peers that matter (clients, Prometheus, kube-dns, the API
server, the internet)."""
from __future__ import annotations

import pytest

from tests.deploy.manifests import NAMESPACE, VARIANTS, by_kind, pod_labels, workloads
from tests.deploy.netpol import Peer, Policies

CLIENT = Peer("client", "10.244.9.1", "clients", {"app": "some-client"})
PROMETHEUS = Peer("prometheus", "10.244.8.1", "monitoring", {"app.kubernetes.io/name": "prometheus"})
KUBE_DNS = Peer("kube-dns", "10.244.7.1", "kube-system", {"k8s-app": "kube-dns"})
OTHER_SYSTEM = Peer("other-system-pod", "10.244.7.2", "kube-system", {"k8s-app": "metrics-server"})
API_SERVER = Peer("api-server", "172.18.0.2")  # a control-plane address, not a pod
INTERNET = Peer("internet", "93.184.216.34")
# The Gateway's proxies, where the inference-extension component admits them.
DATA_PLANE = Peer("data-plane", "10.244.6.1", "inference-gateway", {"app": "envoy"})
# A KV event indexer (llm-d, Dynamo), where the vllm-kv-events component admits it.
KV_CONSUMER = Peer("kv-events-consumer", "10.244.5.1", "llm-d",
                   {"prefixcache.io/kv-events-consumer": "true"})


@pytest.fixture
def net(docs):
    pods = {}
    for i, w in enumerate(workloads(docs)):
        name = w["metadata"]["name"]
        pods[name] = Peer(name, f"10.244.1.{i + 1}", NAMESPACE, pod_labels(w))
    return Policies(docs, NAMESPACE), pods


def test_everything_is_denied_by_default(docs):
    deny = [p for p in by_kind(docs, "NetworkPolicy") if p["spec"]["podSelector"] == {}
            and set(p["spec"]["policyTypes"]) == {"Ingress", "Egress"}
            and not p["spec"].get("ingress") and not p["spec"].get("egress")]
    assert len(deny) == 1


def test_policy_ports_are_numbers(docs):
    for p in by_kind(docs, "NetworkPolicy"):
        for rule in p["spec"].get("ingress", []) + p["spec"].get("egress", []):
            for port in rule.get("ports", []):
                assert isinstance(port["port"], int), (p["metadata"]["name"], port)


def test_needed_flows_are_allowed(net):
    policies, pods = net
    gateway, compute, redis = pods["gateway"], pods["compute"], pods["redis"]
    allowed = [
        (CLIENT, gateway, 50050), (PROMETHEUS, gateway, 9090),   # clients, scraping
        (CLIENT, gateway, 8000),                                 # clients, HTTP API
        (gateway, compute, 50052), (gateway, compute, 50051),    # Generate, Subscribe
        (PROMETHEUS, compute, 9092), (PROMETHEUS, compute, 9091),
        (compute, redis, 6379),                                  # L3 pages
    ]
    for pod in pods.values():
        allowed += [(pod, KUBE_DNS, 53)]
    for src, dst, port in allowed:
        assert policies.allows(src, dst, port), f"{src.name} -> {dst.name}:{port} is blocked"
    for pod in pods.values():
        assert policies.allows(pod, KUBE_DNS, 53, "UDP"), pod.name


def test_everything_else_is_denied(net, variant):
    policies, pods = net
    gateway, compute, redis = pods["gateway"], pods["compute"], pods["redis"]
    denied = [
        (CLIENT, compute, 50052), (CLIENT, compute, 50051),      # workers only via the gateway
        (CLIENT, redis, 6379), (gateway, redis, 6379),           # Redis only from workers
        (CLIENT, gateway, 9090), (CLIENT, compute, 9092),        # metrics only from monitoring
        (PROMETHEUS, redis, 6379), (PROMETHEUS, compute, 50052),
        (compute, gateway, 50050), (redis, compute, 50052),      # no reverse flows
        (CLIENT, compute, 8000), (CLIENT, redis, 8000),          # the HTTP API is the gateway's
        (compute, API_SERVER, 443), (redis, API_SERVER, 443),    # no pod needs the API server:
        (gateway, API_SERVER, 443), (gateway, API_SERVER, 6443),  # discovery is DNS only
        (compute, INTERNET, 443), (redis, INTERNET, 443), (gateway, INTERNET, 80),
        (gateway, INTERNET, 443), (gateway, INTERNET, 6443),     # no 0.0.0.0/0 egress
        (gateway, OTHER_SYSTEM, 53), (compute, OTHER_SYSTEM, 443),
    ]
    for src, dst, port in denied:
        assert not policies.allows(src, dst, port), f"{src.name} -> {dst.name}:{port} is open"
    # The engine reaches its own sidecar on localhost, not the pod IP; only a model server
    # (inference-extension) reaches the other worker pods, to resume a stream there.
    peers = "inference-extension" in VARIANTS[variant][1]
    for port in (50052, 50051):
        assert policies.allows(compute, compute, port) == peers, (variant, port)


def test_every_listening_port_is_reachable_by_someone(net, docs):
    # Guards against a policy typo that would silently cut a service off: each gRPC and metrics
    # port of every pod is allowed from at least one peer.
    policies, pods = net
    peers = [CLIENT, PROMETHEUS, DATA_PLANE, KV_CONSUMER, *pods.values()]
    for w in workloads(docs):
        pod = pods[w["metadata"]["name"]]
        spec = w["spec"]["template"]["spec"]
        for c in spec.get("initContainers", []) + spec["containers"]:
            for p in c.get("ports", []):
                if "health" in p["name"]:
                    continue  # kubelet probes are not subject to NetworkPolicy
                assert any(policies.allows(src, pod, p["containerPort"]) for src in peers), \
                    (pod.name, c["name"], p)


def test_evaluator_negative_controls(docs):
    # The matrix above means something only if the evaluator can say no and yes.
    pods = {w["metadata"]["name"]: Peer(w["metadata"]["name"], f"10.244.1.{i + 1}", NAMESPACE,
                                        pod_labels(w)) for i, w in enumerate(workloads(docs))}
    without_egress = [d for d in docs if d["metadata"]["name"] != "compute-egress"]
    assert not Policies(without_egress, NAMESPACE).allows(pods["compute"], pods["redis"], 6379)
    no_policies = [d for d in docs if d["kind"] != "NetworkPolicy"]
    assert Policies(no_policies, NAMESPACE).allows(pods["compute"], INTERNET, 443)
