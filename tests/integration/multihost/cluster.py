"""A Tandem stack over Hosts, laid out as on separate machines:

- a NATS cluster of one server per host, each routed to every other, admitting one user per role
  as `tandem up` makes them (shared.control.nats_auth); every service is given every server's
  URL, so a client whose server dies reconnects to another;
- a gateway and a scheduler replica on each of the first two hosts (schedulers spread sequences
  evenly: --decode-slack 0); a prefill and a decode worker on each of those, a decode worker
  alone on the third, whose prompts are prefilled on another host and whose KV comes over the
  hosts' links; every worker's KV data plane on its host's link (UCX_NET_DEVICES), its host
  label unset: it comes from the host name;
- the test process reaches each gateway through a Unix socket that a forwarder on its host
  carries on to the gateway's loopback port (see forward.py).
"""

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from shared.cli.processes import child_env, nats_server_binary
from shared.control.nats_auth import write_credentials
from tests.integration.multihost.hosts import DEVICE, Hosts
from tests.integration.stack import Stack, wait_serving

NATS_PORT, ROUTE_PORT, MONITOR_PORT, GRPC_PORT = 4222, 6222, 8222, 50051
GATEWAY_HOSTS = 2  # the first two hosts run a gateway and a scheduler each
# Each host's workers, id: role. The ids run against the hosts: where two pairs cost the same, the
# router takes the lower prefill id, here another host's (prefill-1 is on host b, decode-1 on host
# a); only its preference for a pair on one host keeps a prompt beside its decode worker.
WORKERS = (
    {"decode-1": "decode", "prefill-2": "prefill"},
    {"decode-2": "decode", "prefill-1": "prefill"},
    {"decode-3": "decode"},
)
_FETCH = "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"


@dataclass
class MultiHostStack:
    hosts: Hosts
    cluster: str
    nats_url: str  # every server's, comma-separated: what each service is given
    gateways: dict[str, Stack]  # by host label: its gateway, through its forwarder

    def monitor(self, label: str, endpoint: str) -> dict:
        """The NATS server of host `label`'s monitoring `endpoint` (varz, connz, routez)."""
        address = self.hosts.hosts[label].address
        url = f"http://{address}:{MONITOR_PORT}/{endpoint}"
        return json.loads(self.hosts.run(label, [sys.executable, "-S", "-c", _FETCH, url]))

    def clients(self, label: str) -> set[str]:
        """The names of the clients of host `label`'s NATS server (service, worker ids)."""
        return {c.get("name", "") for c in self.monitor(label, "connz?limit=1024")["connections"]}

    def wait_routes(self, labels: list[str], timeout: float = 30) -> None:
        """Until the NATS server of each host of `labels` is routed to all the others."""
        deadline = time.monotonic() + timeout
        for label in labels:
            others = {f"nats-{other}" for other in labels if other != label}
            while not others <= self._routed(label):
                assert time.monotonic() < deadline, f"NATS on host {label}: routes missing"
                time.sleep(0.2)

    def _routed(self, label: str) -> set[str]:
        """The servers host `label`'s NATS server has routes to (none while it is not up)."""
        try:
            return {r.get("remote_name", "") for r in self.monitor(label, "routez")["routes"]}
        except RuntimeError:  # not listening yet
            return set()

    def restart_nats(self, label: str) -> None:
        self.hosts.group.restart(f"nats-{label}")
        self.wait_routes(list(self.hosts.hosts))


def start(hosts: Hosts, cluster: str, secrets: Path, sockets: Path) -> MultiHostStack:
    """Starts the NATS cluster, then the services, and waits until every worker has joined."""
    # the config gives up a silent client within ~6 s (nats_auth.SILENCE): one cut off here
    # does not keep its subscriptions on its old server
    conf, role_env = write_credentials(secrets, cluster)
    labels = list(hosts.hosts)
    nats_url = ",".join(f"nats://{h.address}:{NATS_PORT}" for h in hosts.hosts.values())
    stack = MultiHostStack(hosts, cluster, nats_url, {})
    for label in labels:
        _start_nats(hosts, label, conf)
    stack.wait_routes(labels)
    common = {"TANDEM_NATS_URL": nats_url, "TANDEM_CLUSTER": cluster, "TANDEM_LOG_LEVEL": "INFO"}
    for label in labels[:GATEWAY_HOSTS]:
        policy = {"TANDEM_MODE": "disaggregated", "TANDEM_DECODE_SLACK": "0"}
        replica = {**policy, "TANDEM_SCHEDULER_ID": f"scheduler-{label}"}
        _spawn(hosts, label, "scheduler", {**common, **role_env["scheduler"], **replica})
    for label, workers in zip(labels, WORKERS):
        for worker, role in workers.items():
            env = {**common, **role_env[role], **_worker_env(worker)}
            hosts.spawn(label, worker, [sys.executable, "-m", f"services.{role}"], child_env(env))
    for label in labels[:GATEWAY_HOSTS]:
        env = {**common, **role_env["gateway"]}
        stack.gateways[label] = _start_gateway(hosts, label, env, sockets)
    _wait_ready(stack, workers=sum(len(workers) for workers in WORKERS[: len(labels)]))
    return stack


def _start_nats(hosts: Hosts, label: str, conf: Path) -> None:
    host = hosts.hosts[label]
    routes = [f"nats://{h.address}:{ROUTE_PORT}" for h in hosts.hosts.values() if h != host]
    listen = ["-a", host.address, "-p", str(NATS_PORT), "-m", str(MONITOR_PORT)]
    cluster = ["--cluster_name", "tandem", "--cluster", f"nats://{host.address}:{ROUTE_PORT}"]
    argv = [nats_server_binary(), "-c", str(conf), "-n", f"nats-{label}", *listen, *cluster]
    hosts.spawn(label, f"nats-{label}", [*argv, "--routes", ",".join(routes)], child_env({}))


def _worker_env(worker_id: str) -> dict[str, str]:
    return {
        "TANDEM_WORKER_ID": worker_id,
        "TANDEM_HOST_LABEL": "",  # the host's own name, whatever the test process's environment says
        "TANDEM_UCX_NET_DEVICES": DEVICE,
        "TANDEM_TORCH_THREADS": "1",
        "TANDEM_KV_CACHE_MB": "256",
    }


def _spawn(hosts: Hosts, label: str, service: str, env: dict[str, str]) -> None:
    argv = [sys.executable, "-m", f"services.{service}"]
    hosts.spawn(label, f"{service}-{label}", argv, child_env(env))


def _start_gateway(hosts: Hosts, label: str, env: dict[str, str], sockets: Path) -> Stack:
    """The gateway of host `label` on its loopback, and a forwarder to it from a Unix socket."""
    gateway = {"TANDEM_GATEWAY_ID": f"gateway-{label}", "TANDEM_HTTP_PORT": "-1"}
    _spawn(hosts, label, "gateway", {**env, **gateway, "TANDEM_GRPC_PORT": str(GRPC_PORT)})
    socket = sockets / f"gateway-{label}.sock"
    forward = [sys.executable, str(Path(__file__).with_name("forward.py")), str(socket)]
    hosts.spawn(label, f"forward-{label}", [*forward, "127.0.0.1", str(GRPC_PORT)], child_env({}))
    names = [n for n, _ in hosts.group.children]
    return Stack(env["TANDEM_CLUSTER"], f"unix:{socket}", hosts.group, "disaggregated", names)


def _wait_ready(stack: MultiHostStack, workers: int, timeout: float = 300) -> None:
    """Until every gateway serves and sees `workers` workers."""
    deadline = time.monotonic() + timeout
    for gateway in stack.gateways.values():
        wait_serving(gateway.address, stack.hosts.group, timeout)
        while len(gateway.status().workers) < workers:
            assert time.monotonic() < deadline, gateway.status()
            assert not stack.hosts.group.dead(), stack.hosts.group.dead()
            time.sleep(0.3)
