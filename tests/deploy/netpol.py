"""A small NetworkPolicy evaluator (networking.k8s.io/v1 semantics) for asserting a flow matrix.

A connection from A to B on port/protocol is allowed when A's namespace lets it leave (no policy
selects A for Egress, or one of those policies has a matching egress rule) and B's namespace lets
it in (same for Ingress). Only the policies of the rendered namespace are known; pods elsewhere
are treated as unrestricted on their own side, as a policy-free namespace would be.
"""
from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from tests.deploy.manifests import Doc, selects


@dataclass(frozen=True)
class Peer:
    name: str
    ip: str
    namespace: str | None = None            # None: not a pod (an address outside the cluster)
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def namespace_labels(self) -> dict[str, str]:
        return {} if self.namespace is None else {"kubernetes.io/metadata.name": self.namespace}


def _policy_types(policy: Doc) -> list[str]:
    spec = policy["spec"]
    if "policyTypes" in spec:
        return spec["policyTypes"]
    return ["Ingress"] + (["Egress"] if "egress" in spec else [])


def _peer_matches(rule_peer: dict, peer: Peer, policy_namespace: str) -> bool:
    if "ipBlock" in rule_peer:
        block = rule_peer["ipBlock"]
        ip = ipaddress.ip_address(peer.ip)
        if ip not in ipaddress.ip_network(block["cidr"]):
            return False
        return not any(ip in ipaddress.ip_network(e) for e in block.get("except", []))
    if peer.namespace is None:
        return False
    ns_sel = rule_peer.get("namespaceSelector")
    pod_sel = rule_peer.get("podSelector")
    if ns_sel is None:
        in_namespace = peer.namespace == policy_namespace
    else:
        in_namespace = selects(ns_sel, peer.namespace_labels)
    return in_namespace and (pod_sel is None or selects(pod_sel, peer.labels))


def _port_matches(rule: dict, port: int, protocol: str) -> bool:
    ports = rule.get("ports")
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        assert isinstance(p["port"], int), f"named port {p['port']!r} in a NetworkPolicy"
        if p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


class Policies:
    def __init__(self, docs: list[Doc], namespace: str):
        self.namespace = namespace
        self.policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
        for p in self.policies:
            assert p["metadata"].get("namespace") == namespace, p["metadata"]

    def _selecting(self, peer: Peer, direction: str) -> list[Doc]:
        if peer.namespace != self.namespace:
            return []
        return [p for p in self.policies if direction in _policy_types(p)
                and selects(p["spec"]["podSelector"], peer.labels)]

    def _side_allows(self, subject: Peer, other: Peer, direction: str, port: int,
                     protocol: str) -> bool:
        policies = self._selecting(subject, direction)
        if not policies:
            return True
        rules_key, peers_key = ("egress", "to") if direction == "Egress" else ("ingress", "from")
        for policy in policies:
            for rule in policy["spec"].get(rules_key, []):
                peers = rule.get(peers_key)
                peer_ok = (not peers) or any(_peer_matches(rp, other, self.namespace)
                                             for rp in peers)
                if peer_ok and _port_matches(rule, port, protocol):
                    return True
        return False

    def allows(self, src: Peer, dst: Peer, port: int, protocol: str = "TCP") -> bool:
        return (self._side_allows(src, dst, "Egress", port, protocol)
                and self._side_allows(dst, src, "Ingress", port, protocol))
