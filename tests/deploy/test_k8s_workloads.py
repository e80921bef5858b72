"""What the rendered workloads must carry: restricted security, resources, probes on the health
ports, the shared configuration, the sidecar, drain timing, GPUs, discovery, Redis settings."""
from __future__ import annotations

import base64
import json
import re
from decimal import Decimal

import pytest

from prefixcache_client.hash import NS_DOMAIN
from tests.deploy.manifests import (NAMESPACE, VARIANTS, by_kind, container, containers, generated,
                                    one, pod_labels, pod_spec, quantity, redis_bytes, selects,
                                    sleep_seconds, workloads)

# The contract of the three services (ports are fixed across images, manifests and docs).
SERVICES = {
    # The gateway also serves the OpenAI-compatible HTTP API.
    "gateway": {"workload": "gateway", "grpc": 50050, "health": 8080, "metrics": 9090,
                "http": 8000},
    "cache": {"workload": "compute", "grpc": 50051, "health": 8081, "metrics": 9091},
    "compute": {"workload": "compute", "grpc": 50052, "health": 8082, "metrics": 9092},
}
GPU_VARIANTS = [v for v, (base, _) in VARIANTS.items() if base.endswith("gpu")]
PSA_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                    "persistentVolumeClaim", "projected", "secret"}


def service_container(docs, service):
    return container(docs, SERVICES[service]["workload"], service)


def test_namespace_enforces_restricted_pod_security(docs):
    labels = one(docs, "Namespace", NAMESPACE)["metadata"]["labels"]
    for mode in ("enforce", "audit", "warn"):
        assert labels[f"pod-security.kubernetes.io/{mode}"] == "restricted"


def test_pods_meet_the_restricted_profile(docs):
    for w in workloads(docs):
        pod, name = pod_spec(w), w["metadata"]["name"]
        sc = pod["securityContext"]
        assert sc["runAsNonRoot"] is True and sc["runAsUser"] > 0, name
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", name
        for host in ("hostNetwork", "hostPID", "hostIPC"):
            assert not pod.get(host), (name, host)
        for v in pod.get("volumes", []):
            kinds = set(v) - {"name"}
            assert kinds <= PSA_VOLUME_TYPES, (name, v)
    for c in containers(docs):
        sc, where = c.spec["securityContext"], (c.workload["metadata"]["name"], c.name)
        assert sc["allowPrivilegeEscalation"] is False, where
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add"), where
        assert sc["runAsNonRoot"] is True and sc.get("runAsUser", 1) > 0, where
        assert sc["seccompProfile"]["type"] == "RuntimeDefault", where
        assert not sc.get("privileged"), where
        assert not any("hostPort" in p for p in c.spec.get("ports", [])), where


def test_root_filesystems_are_read_only_with_a_writable_tmp(docs):
    for c in containers(docs):
        where = (c.workload["metadata"]["name"], c.name)
        assert c.spec["securityContext"]["readOnlyRootFilesystem"] is True, where
        tmp = c.mounts().get("/tmp")
        assert tmp is not None, f"{where}: no /tmp mount"
        assert "emptyDir" in c.volume(tmp["name"]), where
        assert c.volume(tmp["name"])["emptyDir"].get("sizeLimit"), where


def test_every_container_has_requests_and_limits(docs):
    for c in containers(docs):
        where = (c.workload["metadata"]["name"], c.name)
        req, lim = c.spec["resources"]["requests"], c.spec["resources"]["limits"]
        for r in ("cpu", "memory"):
            assert r in req and r in lim, (where, r)
            assert quantity(req[r]) <= quantity(lim[r]), (where, r)
        for r in set(req) | set(lim):
            if "/" in r:  # extended resources (GPUs) cannot be overcommitted
                assert quantity(req.get(r, 0)) == quantity(lim.get(r, -1)), (where, r)
        # Memory-backed emptyDirs count against the memory limit.
        for m in c.spec.get("volumeMounts", []):
            v = c.volume(m["name"])
            if v.get("emptyDir", {}).get("medium") == "Memory":
                assert quantity(v["emptyDir"]["sizeLimit"]) < quantity(lim["memory"]), where


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_grpc_probes_on_the_dedicated_health_port(docs, service):
    c, ports = service_container(docs, service), SERVICES[service]
    assert c.env_value("PREFIXCACHE_HEALTH_PORT") == str(ports["health"])
    assert c.env_value("PREFIXCACHE_METRICS_PORT") == str(ports["metrics"])
    container_ports = {p["containerPort"] for p in c.spec["ports"]}
    epp = c.env_value("PREFIXCACHE_EPP_PORT")  # the inference-extension component's
    # The vllm-kv-events component's PUB and replay ports (tcp://*:PORT).
    kv_events = [int(c.env_value(f"PREFIXCACHE_KV_EVENTS_ZMQ_{e}").rpartition(":")[2])
                 for e in ("ENDPOINT", "REPLAY_ENDPOINT")
                 if c.env_value(f"PREFIXCACHE_KV_EVENTS_ZMQ_{e}")]
    assert container_ports == {ports["grpc"], ports["health"], ports["metrics"],
                               *([ports["http"]] if "http" in ports else []),
                               *([int(epp)] if epp else []), *kv_events}
    if "http" in ports:
        assert c.env_value("PREFIXCACHE_HTTP_PORT") == str(ports["http"])
    for probe, health_service in (("startupProbe", "liveness"), ("livenessProbe", "liveness"),
                                  ("readinessProbe", "readiness")):
        spec = c.spec[probe]
        assert spec["grpc"] == {"port": ports["health"], "service": health_service}, probe


def test_compute_startup_probe_allows_a_long_model_load(docs):
    probe = service_container(docs, "compute").spec["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 300


def test_every_service_reads_the_shared_config(docs):
    config = generated(docs, "ConfigMap", "prefixcache-config")
    data = config["data"]
    assert int(data["PREFIXCACHE_PAGE_SIZE"]) > 0
    assert data["PREFIXCACHE_MODEL_ID"]
    assert data["PREFIXCACHE_HASH_SPEC"] == NS_DOMAIN.decode() == "prefixcache-ns-v1"
    assert data["PREFIXCACHE_CACHE_PORT"] == str(SERVICES["cache"]["grpc"])
    assert data["PREFIXCACHE_COMPUTE_PORT"] == str(SERVICES["compute"]["grpc"])
    assert data["PREFIXCACHE_GATEWAY_PORT"] == str(SERVICES["gateway"]["grpc"])
    for service in SERVICES:
        refs = [e["configMapRef"]["name"] for e in service_container(docs, service).spec["envFrom"]]
        assert config["metadata"]["name"] in refs, service


def test_env_references_are_defined_before_use(docs):
    # Kubernetes expands $(VAR) only from entries listed *earlier*; an undefined one stays
    # literal, silently. Strategic-merge patches reorder env lists, so this is worth checking.
    for c in containers(docs):
        defined: set[str] = set()
        for e in c.spec.get("env", []):
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", e.get("value", "")):
                assert ref in defined, (c.name, e["name"], ref)
            defined.add(e["name"])
        for arg in c.spec.get("command", []) + c.spec.get("args", []):
            for ref in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                assert ref in defined, (c.name, arg)


def test_every_reference_resolves(docs, variant):
    names = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    cert_secrets = {d["spec"]["secretName"] for d in by_kind(docs, "Certificate")}
    external_claims = {"prefixcache-models"} if variant in GPU_VARIANTS else set()

    def data_keys(kind, name):
        assert (kind, name) in names, f"{kind}/{name} is not in the rendering"
        d = names[(kind, name)]
        return set(d.get("data", {})) | set(d.get("stringData", {}))

    for c in containers(docs):
        for e in c.spec.get("env", []):
            src = e.get("valueFrom", {})
            if "secretKeyRef" in src:
                ref = src["secretKeyRef"]
                assert ref["key"] in data_keys("Secret", ref["name"]), (c.name, e)
            if "configMapKeyRef" in src:
                ref = src["configMapKeyRef"]
                assert ref["key"] in data_keys("ConfigMap", ref["name"]), (c.name, e)
        for e in c.spec.get("envFrom", []):
            if "configMapRef" in e:
                data_keys("ConfigMap", e["configMapRef"]["name"])
            if "secretRef" in e:
                data_keys("Secret", e["secretRef"]["name"])
    for w in workloads(docs):
        pod = pod_spec(w)
        for v in pod.get("volumes", []):
            if "secret" in v and v["secret"]["secretName"] not in cert_secrets:
                data_keys("Secret", v["secret"]["secretName"])
            if "configMap" in v:
                data_keys("ConfigMap", v["configMap"]["name"])
            if "persistentVolumeClaim" in v:
                assert v["persistentVolumeClaim"]["claimName"] in external_claims, v
        sa = pod.get("serviceAccountName")
        assert sa and ("ServiceAccount", sa) in names, w["metadata"]["name"]


def test_cache_service_is_a_native_sidecar_of_each_worker(docs):
    cache, compute = service_container(docs, "cache"), service_container(docs, "compute")
    assert cache.sidecar and not compute.init
    assert compute.env_value("PREFIXCACHE_CACHE_SERVICE") == f"localhost:{SERVICES['cache']['grpc']}"
    # One pool per worker, named after the pod; the gateway finds the sidecar on the pod IP.
    env = compute.env()
    assert env["PREFIXCACHE_POOL_ID"]["value"] == "$(POD_NAME)"
    assert env["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert cache.spec["image"].split(":")[0].endswith("/cache")


@pytest.mark.parametrize("workload,name", [("gateway", "gateway"), ("compute", "compute")])
def test_drain_fits_in_the_termination_grace_period(docs, workload, name):
    c = container(docs, workload, name)
    pre_stop = sleep_seconds(c.spec["lifecycle"]["preStop"])
    grace = float(c.env_value("PREFIXCACHE_GRACE_S"))
    period = c.pod["terminationGracePeriodSeconds"]
    assert 0 < pre_stop and period > pre_stop + grace, (pre_stop, grace, period)
    if workload == "compute":  # the sidecar stops after the engine, within the same period
        sidecar_grace = float(container(docs, "compute", "cache").env_value("PREFIXCACHE_GRACE_S"))
        assert period >= pre_stop + grace + sidecar_grace


def test_workers_get_a_memory_backed_dev_shm(docs):
    c = service_container(docs, "compute")
    shm = c.volume(c.mounts()["/dev/shm"]["name"])
    assert shm["emptyDir"]["medium"] == "Memory" and shm["emptyDir"]["sizeLimit"]


def test_gpu_overlay_requests_whole_gpus(docs, variant):
    c = service_container(docs, "compute")
    res = c.spec["resources"]
    everything = [x.spec["resources"] for x in containers(docs)]
    if variant in GPU_VARIANTS:
        assert quantity(res["requests"]["nvidia.com/gpu"]) == quantity(res["limits"]["nvidia.com/gpu"]) >= 1
        assert c.spec["image"].startswith("prefixcache/compute-cuda:")
        assert any(t["key"] == "nvidia.com/gpu" for t in c.pod.get("tolerations", []))
        strategy = c.workload["spec"]["strategy"]["rollingUpdate"]
        assert strategy["maxSurge"] == 0, "a surge pod would wait for a free GPU"
        assert c.mounts()["/models"]["readOnly"] is True
        assert c.env_value("PREFIXCACHE_MODEL").startswith("/models/")
    else:
        assert not any("nvidia.com/gpu" in r.get(k, {}) for r in everything for k in r)
        assert c.spec["image"].startswith("prefixcache/compute:")


def test_gateway_discovers_workers_through_the_headless_service(docs, variant):
    gw = service_container(docs, "gateway")
    env = gw.env()
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    if "inference-extension" in VARIANTS[variant][1]:  # the pool's pods, through the API
        assert "PREFIXCACHE_WORKERS_DNS" not in env and env["PREFIXCACHE_WORKERS_INFERENCEPOOL"]
        return
    assert env["PREFIXCACHE_WORKERS_DNS"]["value"] == (
        f"compute-headless.$(POD_NAMESPACE).svc.cluster.local:{SERVICES['compute']['grpc']}")
    headless = one(docs, "Service", "compute-headless")["spec"]
    assert headless["clusterIP"] == "None"
    assert selects(headless["selector"], pod_labels(one(docs, "Deployment", "compute")))
    assert [p["port"] for p in headless["ports"]][0] == SERVICES["compute"]["grpc"]


def test_no_pod_talks_to_the_api_server(docs, variant):
    """Discovery is DNS only (gateway/core/discovery.py): no Role or binding grants anything, and no
    pod or service account mounts an API token. (With the inference-extension component the
    gateway reads its InferencePool: test_k8s_inference_extension.py checks that Role.)"""
    reader = "inference-extension" in VARIANTS[variant][1]
    assert [(d["kind"], d["metadata"]["name"]) for d in docs if d["kind"] in (
        "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding")] == ([
            ("Role", "gateway-inferencepool-reader"),
            ("RoleBinding", "gateway-inferencepool-reader")] if reader else [])
    for w in workloads(docs):
        pod = pod_spec(w)
        reads = reader and w["metadata"]["name"] == "gateway"
        assert pod["automountServiceAccountToken"] is reads, w["metadata"]["name"]
        is_gateway = w["metadata"]["name"] == "gateway"
        assert (pod["serviceAccountName"] == "gateway") is is_gateway
    for account in (d for d in docs if d["kind"] == "ServiceAccount"):
        assert account.get("automountServiceAccountToken") is not True, account["metadata"]


def test_gateway_tenants_come_from_a_mounted_secret(docs):
    gw = service_container(docs, "gateway")
    path = gw.env_value("PREFIXCACHE_TENANTS_FILE")
    mount_path, _, key = path.rpartition("/")
    mount = gw.mounts()[mount_path]
    assert mount["readOnly"] is True
    secret = gw.volume(mount["name"])["secret"]["secretName"]
    assert key in one(docs, "Secret", secret)["data"]


def test_autoscaling_and_disruption_budgets(docs):
    hpa = one(docs, "HorizontalPodAutoscaler", "gateway")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "gateway"}
    assert 1 <= hpa["minReplicas"] <= hpa["maxReplicas"]
    assert "replicas" not in one(docs, "Deployment", "gateway")["spec"], "the HPA owns replicas"
    for w in workloads(docs):
        if w["kind"] in ("Job", "CronJob"):  # run to completion: nothing to keep available
            continue
        pdbs = [p for p in by_kind(docs, "PodDisruptionBudget")
                if selects(p["spec"]["selector"], pod_labels(w))]
        assert len(pdbs) == 1, w["metadata"]["name"]
        spec = pdbs[0]["spec"]
        # A budget must never block node drains for good.
        replicas = w["spec"].get("replicas", hpa["minReplicas"])
        assert spec.get("maxUnavailable", 0) >= 1 or spec["minAvailable"] < replicas


def test_services_select_pods_and_target_their_ports(docs):
    expected = {"gateway": ("ClusterIP", SERVICES["gateway"]["grpc"]),
                "compute-headless": ("None", SERVICES["compute"]["grpc"]),
                "cache-headless": ("None", SERVICES["cache"]["grpc"]),
                "redis": ("ClusterIP", 6379), "redis-headless": ("None", 6379),
                "gateway-epp": ("ClusterIP", 9002),  # the inference-extension component's
                "index-redis": ("ClusterIP", 6379)}  # the shared-index component's
    for svc in by_kind(docs, "Service"):
        name, spec = svc["metadata"]["name"], svc["spec"]
        kind, port = expected[name]
        assert (spec.get("clusterIP") == "None") == (kind == "None"), name
        assert spec["ports"][0]["port"] == port, name
        pods = [w for w in workloads(docs) if selects(spec["selector"], pod_labels(w))]
        assert len(pods) == 1, name
        pod = pod_spec(pods[0])
        regular = {p.get("name"): p["containerPort"] for c in pod["containers"]
                   for p in c.get("ports", [])}
        every = {p["containerPort"] for c in pod["containers"] + pod.get("initContainers", [])
                 for p in c.get("ports", [])}
        for p in spec["ports"]:
            target = p["targetPort"]
            # Named ports only on regular containers: sidecar named ports are not resolved by
            # every Kubernetes version.
            resolved = target if isinstance(target, int) else regular.get(target)
            assert resolved in every, (name, p)


def test_redis_is_a_bounded_lru_cache_without_persistence(docs, variant):
    components = VARIANTS[variant][1]
    sts = one(docs, "StatefulSet", "redis")
    # One node; 3 masters of a Redis Cluster with components/redis-cluster.
    assert sts["spec"]["replicas"] == (3 if "redis-cluster" in components else 1)
    c = container(docs, "redis", "redis")
    flags = {k: v[0] for k, v in redis_flags(c.spec["args"]).items() if len(v) == 1}
    assert flags["--maxmemory-policy"] == "allkeys-lru"
    assert flags["--save"] == "" and flags["--appendonly"] == "no"
    # ACL users, not --requirepass (tests/deploy/test_k8s_redis.py runs them on a real Redis).
    assert "--requirepass" not in flags
    env = c.env()
    password = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert password["name"].startswith("redis-auth-")
    maxmemory_ref = env[flags["--maxmemory"][2:-1]]["valueFrom"]["configMapKeyRef"]
    maxmemory = one(docs, "ConfigMap", maxmemory_ref["name"])["data"][maxmemory_ref["key"]]
    limit = quantity(c.spec["resources"]["limits"]["memory"])
    # Headroom beyond the data (fragmentation, client buffers): at least 20 % of the limit.
    assert redis_bytes(maxmemory) <= limit * Decimal("0.8"), (maxmemory, limit)
    assert c.spec["livenessProbe"] and c.spec["readinessProbe"]
    # Every worker container reaches it as the ACL user `prefixcache`, with the same password
    # read from the Secret mounted as a file (never in its environment).
    for name in ("compute", "cache"):
        w = service_container(docs, name)
        assert "REDIS_PASSWORD" not in w.env()
        url = {"redis-tls": "rediss://prefixcache@redis:6379/0",
               "redis-cluster": "redis+cluster://prefixcache@redis:6379"}
        assert w.env_value("PREFIXCACHE_REDIS_URL") == next(
            (url[c] for c in components if c in url), "redis://prefixcache@redis:6379/0")
        path = w.env_value("PREFIXCACHE_REDIS_PASSWORD_FILE")
        mount = w.mounts()[path.rpartition("/")[0]]
        assert w.volume(mount["name"])["secret"]["secretName"] == password["name"]


def redis_flags(args: list[str]) -> dict[str, list[str]]:
    """redis-server arguments as {"--flag": [its words]}; `--user` repeats: its entries are
    joined, one user per line."""
    out: dict[str, list[str]] = {}
    flag = ""
    for a in args:
        if a.startswith("--"):
            flag = a
            if flag == "--user" and flag in out:
                out[flag].append("\n")
            else:
                out[flag] = []
        else:
            out[flag].append(a)
    return out


def test_example_secrets_are_marked_as_examples(docs):
    password = base64.b64decode(generated(docs, "Secret", "redis-auth")["data"]["password"]).decode()
    assert password.startswith("EXAMPLE-ONLY") and re.fullmatch(r"[A-Za-z0-9-]+", password), \
        "URL-safe: it is embedded in PREFIXCACHE_REDIS_URL"
    tenants = json.loads(base64.b64decode(
        generated(docs, "Secret", "gateway-tenants")["data"]["tenants.json"]))
    assert "EXAMPLE ONLY" in tenants["_comment"]
    assert tenants["tokens"]
    for token, entry in tenants["tokens"].items():
        assert token.startswith("example-only-") and set(entry) == {"tenant", "salt"}


def test_images_are_pinned_to_a_tag(docs):
    for c in containers(docs):
        image = c.spec["image"]
        assert re.fullmatch(r"[a-z0-9./_-]+:[A-Za-z0-9._-]+", image), image
        assert not image.endswith(":latest"), image
