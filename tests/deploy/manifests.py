"""Rendering the kustomizations, validating the result against JSON schemas, and walking it."""
from __future__ import annotations

import functools
import importlib.resources
import json
import os
import re
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
NAMESPACE = "prefixcache"
CRD_SCHEMAS = Path(__file__).resolve().parent / "schemas"

# Everything the tests render: the base, each overlay, and overlays with components (as a user's
# own kustomization would combine them, see deploy/README.md).
VARIANTS: dict[str, tuple[str, tuple[str, ...]]] = {
    "base": ("base", ()),
    "dev-cpu": ("overlays/dev-cpu", ()),
    "gpu": ("overlays/gpu", ()),
    "dev-cpu+monitoring": ("overlays/dev-cpu", ("monitoring",)),
    "dev-cpu+mtls": ("overlays/dev-cpu", ("mtls",)),
    "dev-cpu+monitoring+mtls": ("overlays/dev-cpu", ("monitoring", "mtls")),
    "gpu+monitoring+mtls": ("overlays/gpu", ("monitoring", "mtls")),
    "dev-cpu+inference-extension": ("overlays/dev-cpu", ("inference-extension",)),
    "gpu+monitoring+inference-extension": ("overlays/gpu", ("monitoring", "inference-extension")),
    "dev-cpu+monitoring+autoscaling-workers": ("overlays/dev-cpu",
                                               ("monitoring", "autoscaling-workers")),
    "gpu+monitoring+mtls+autoscaling-workers": ("overlays/gpu",
                                                ("monitoring", "mtls", "autoscaling-workers")),
    "dev-cpu+vllm-kv-events": ("overlays/dev-cpu", ("vllm-kv-events",)),
    "gpu+monitoring+mtls+vllm-kv-events": ("overlays/gpu", ("monitoring", "mtls", "vllm-kv-events")),
    "dev-cpu+mtls+redis-tls": ("overlays/dev-cpu", ("mtls", "redis-tls")),
    "gpu+monitoring+mtls+redis-tls": ("overlays/gpu", ("monitoring", "mtls", "redis-tls")),
    "dev-cpu+redis-cluster": ("overlays/dev-cpu", ("redis-cluster",)),
    "gpu+monitoring+mtls+redis-cluster": ("overlays/gpu", ("monitoring", "mtls", "redis-cluster")),
    "dev-cpu+shared-index": ("overlays/dev-cpu", ("shared-index",)),
    "gpu+monitoring+shared-index": ("overlays/gpu", ("monitoring", "shared-index")),
}

# The oldest Kubernetes the manifests support (native sidecars are on by default from 1.29; gRPC
# probes are GA since 1.27) and the newest whose schemas kubernetes-validate ships.
MIN_KUBERNETES = "1.30.0"

Doc = dict


def render(kustomize: tuple[str, ...], variant: str) -> list[Doc]:
    base, components = VARIANTS[variant]
    if not components:
        return render_dir(kustomize, K8S / base)
    with tempfile.TemporaryDirectory(prefix="prefixcache-kustomize-") as tmp:
        rel = lambda p: os.path.relpath(p, tmp)  # noqa: E731  (kustomize refuses absolute paths)
        wrapper = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "namespace": NAMESPACE,
            "resources": [rel(K8S / base)],
            "components": [rel(K8S / "components" / c) for c in components],
        }
        Path(tmp, "kustomization.yaml").write_text(yaml.safe_dump(wrapper))
        return render_dir(kustomize, Path(tmp))


def render_dir(kustomize: tuple[str, ...], directory: Path) -> list[Doc]:
    """The rendering of one kustomization directory."""
    done = subprocess.run([*kustomize, str(directory)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(kustomize)} {directory} failed:\n{done.stderr}")
    return [d for d in yaml.safe_load_all(done.stdout) if d]


# --- schema validation ----------------------------------------------------------------------------

def kubernetes_version(which: str) -> str:
    """"oldest" (MIN_KUBERNETES) or "newest" (the newest schema set kubernetes-validate ships).

    Resolved at run time, not at collection: kubernetes-validate may be installed by the
    deploy_tools fixture (tests/deploy/tools.py)."""
    from kubernetes_validate.utils import all_versions
    return {"oldest": MIN_KUBERNETES, "newest": all_versions()[-1]}[which]


class SchemaMissing(LookupError):
    pass


@functools.cache
def _schema_dir(version: str) -> Path:
    root = importlib.resources.files("kubernetes_validate") / "kubernetes-json-schema"
    path = Path(str(root / f"v{version}-local-strict"))
    if not path.is_dir():
        raise SchemaMissing(f"kubernetes-validate has no strict schemas for {version}")
    return path


@functools.cache
def _builtin_validator(version: str, kind: str, api_version: str):
    import jsonschema
    from referencing import Registry, Resource

    # File naming of the schema set (the one kubeconform uses): kind-group-version.json, where
    # the group is cut at its first dot ("rbac.authorization.k8s.io/v1" -> "rbac-v1").
    group_version = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    directory = _schema_dir(version)
    path = directory / f"{kind.lower()}-{group_version}.json"
    if not path.is_file():
        raise SchemaMissing(f"no schema for {api_version} {kind} in Kubernetes {version}")
    schema = json.loads(path.read_text())
    definitions = json.loads((directory / "_definitions.json").read_text())
    registry = Resource.from_contents(schema) @ Registry()
    registry = Resource.from_contents(definitions) @ registry
    return jsonschema.Draft202012Validator(schema, registry=registry)


@functools.cache
def _crd_validator(kind: str, api_version: str):
    import jsonschema
    from referencing import Registry, Resource

    group, _, version = api_version.partition("/")
    path = CRD_SCHEMAS / f"{kind.lower()}-{group.split('.')[0]}-{version}.json"
    if not path.is_file():
        raise SchemaMissing(f"no schema for {api_version} {kind} in {CRD_SCHEMAS}")
    meta = json.loads((CRD_SCHEMAS / "_meta.json").read_text())
    registry = Resource.from_contents(meta) @ Registry()
    return jsonschema.Draft202012Validator(json.loads(path.read_text()), registry=registry)


# API groups under k8s.io whose kinds are CRDs, not built in (schemas in CRD_SCHEMAS).
CRD_GROUPS = frozenset({"gateway.networking.k8s.io", "inference.networking.k8s.io"})


def is_builtin(doc: Doc) -> bool:
    group = doc["apiVersion"].rpartition("/")[0]
    return group not in CRD_GROUPS and ("." not in group or group.endswith(".k8s.io"))


def schema_errors(doc: Doc, version: str) -> list[str]:
    """Every violation of the document's strict schema (empty: valid); SchemaMissing if none."""
    if is_builtin(doc):
        validator = _builtin_validator(version, doc["kind"], doc["apiVersion"])
    else:
        validator = _crd_validator(doc["kind"], doc["apiVersion"])
    return [f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
            for e in validator.iter_errors(doc)]


# --- walking rendered documents --------------------------------------------------------------------

def by_kind(docs: list[Doc], kind: str) -> list[Doc]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[Doc], kind: str, name: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind}/{name}, found {len(found)}"
    return found[0]


def generated(docs: list[Doc], kind: str, prefix: str) -> Doc:
    """A ConfigMap/Secret from a kustomize generator (its name carries a content hash)."""
    found = [d for d in docs if d["kind"] == kind
             and re.fullmatch(re.escape(prefix) + r"-[a-z0-9]{10}", d["metadata"]["name"])]
    assert len(found) == 1, f"expected one generated {kind} {prefix}-<hash>, found {len(found)}"
    return found[0]


WORKLOAD_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "Job", "CronJob")


@dataclass(frozen=True, slots=True)
class Container:
    workload: Doc
    spec: dict          # the container
    pod: dict           # the pod spec it is in
    init: bool          # from initContainers

    @property
    def name(self) -> str:
        return self.spec["name"]

    @property
    def sidecar(self) -> bool:
        return self.init and self.spec.get("restartPolicy") == "Always"

    def env(self) -> dict[str, dict]:
        return {e["name"]: e for e in self.spec.get("env", [])}

    def env_value(self, name: str) -> str | None:
        entry = self.env().get(name)
        return None if entry is None else entry.get("value")

    def mounts(self) -> dict[str, dict]:
        return {m["mountPath"]: m for m in self.spec.get("volumeMounts", [])}

    def volume(self, name: str) -> dict:
        """The pod's volume `name`; a StatefulSet's claim template as {"name", "claimTemplate"}."""
        for v in self.pod.get("volumes", []):
            if v["name"] == name:
                return v
        for t in self.workload["spec"].get("volumeClaimTemplates", []):
            if t["metadata"]["name"] == name:
                return {"name": name, "claimTemplate": t["spec"]}
        raise AssertionError(f"{self.name}: no volume {name}")


def pod_spec(workload: Doc) -> dict:
    if workload["kind"] == "CronJob":
        return workload["spec"]["jobTemplate"]["spec"]["template"]["spec"]
    return workload["spec"]["template"]["spec"]


def pod_labels(workload: Doc) -> dict[str, str]:
    tpl = (workload["spec"]["jobTemplate"]["spec"]["template"] if workload["kind"] == "CronJob"
           else workload["spec"]["template"])
    return tpl["metadata"].get("labels", {})


def workloads(docs: list[Doc]) -> list[Doc]:
    return [d for d in docs if d["kind"] in WORKLOAD_KINDS]


def containers(docs: list[Doc]) -> Iterator[Container]:
    for w in workloads(docs):
        pod = pod_spec(w)
        for c in pod.get("initContainers", []):
            yield Container(w, c, pod, True)
        for c in pod["containers"]:
            yield Container(w, c, pod, False)


def container(docs: list[Doc], workload: str, name: str) -> Container:
    found = [c for c in containers(docs) if c.workload["metadata"]["name"] == workload
             and c.name == name]
    assert len(found) == 1, f"expected one container {workload}/{name}, found {len(found)}"
    return found[0]


def selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels + matchExpressions), or a plain Service selector map."""
    if "matchLabels" not in selector and "matchExpressions" not in selector:
        return all(labels.get(k) == v for k, v in selector.items())
    if not all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        key, op, values = expr["key"], expr["operator"], expr.get("values", [])
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


# --- quantities ------------------------------------------------------------------------------------

_SUFFIX = {"": 1, "m": Decimal("0.001"), "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def quantity(value: str | int | float) -> Decimal:
    """A Kubernetes resource quantity ("500m", "2", "4Gi") as a number."""
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    assert m and m.group(2) in _SUFFIX, f"not a quantity: {value!r}"
    return Decimal(m.group(1)) * _SUFFIX[m.group(2)]


def redis_bytes(value: str) -> int:
    """A Redis memory setting ("768mb", "24gb", "1gb", "100000") in bytes (redis.conf units)."""
    m = re.fullmatch(r"(\d+)(k|kb|m|mb|g|gb)?", value.strip().lower())
    assert m, f"not a Redis memory size: {value!r}"
    unit = {None: 1, "k": 1000, "kb": 1024, "m": 10**6, "mb": 1024**2, "g": 10**9,
            "gb": 1024**3}[m.group(2)]
    return int(m.group(1)) * unit


def sleep_seconds(handler: dict) -> float:
    """Seconds a preStop handler waits: `sleep N` exec or the native sleep action."""
    if "sleep" in handler:
        return float(handler["sleep"]["seconds"])
    command = handler.get("exec", {}).get("command", [])
    text = " ".join(command)
    m = re.search(r"\bsleep\s+(\d+(?:\.\d+)?)", text)
    assert m, f"preStop does not wait: {command}"
    return float(m.group(1))
