"""Real stacks for integration tests: nats-server and each service as its own process."""

import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from shared.cli.processes import (
    ProcessGroup,
    child_env,
    free_port,
    nats_server_binary,
    wait_for_port,
)

AUTO_GATEWAY_ID = "gw-auto"  # the session's auto-mode stack's gateway (conftest.auto)
# a worker reports its load every heartbeat interval (0.5 s, the default): a report this long
# after a moment was made after it (and reached the scheduler)
REPORT_S = 0.5 + 0.3


@dataclass
class NatsServer:
    url: str
    monitor_port: int

    def varz(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.monitor_port}/varz", timeout=5) as r:
            return json.load(r)


def start_nats(group: ProcessGroup) -> NatsServer:
    port, monitor = free_port(), free_port()
    group.spawn(
        "nats",
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor)],
        child_env({}),
    )
    assert wait_for_port("127.0.0.1", port, 15), group.log_tail("nats")
    return NatsServer(f"nats://127.0.0.1:{port}", monitor)


@dataclass
class Stack:
    cluster: str
    address: str
    group: ProcessGroup
    mode: str
    names: list[str] = field(default_factory=list)
    http_port: int = 0  # the OpenAI-compatible API's
    api_key: str = ""  # ClusterStatus's, where the gateway requires keys
    metrics_ports: dict[str, int] = field(default_factory=dict)  # each service's Prometheus port

    @property
    def auth(self) -> list | None:
        """gRPC metadata with the stack's API key (None without one)."""
        return [("authorization", f"Bearer {self.api_key}")] if self.api_key else None

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def stub(self) -> pb_grpc.TandemStub:
        return pb_grpc.TandemStub(self.channel())

    def dead(self) -> list[tuple[str, int]]:
        """This stack's processes that exited (others in the same group are not its concern)."""
        return [(n, c) for n, c in self.group.dead() if n in self.names]

    def stop(self) -> None:
        """Stops this stack's processes now, so they do not load the machine for later tests."""
        procs = [p for n, p in self.group.children if n in self.names and p.poll() is None]
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=15)
            except Exception:
                proc.kill()

    def status(self) -> pb.ClusterStatusResponse:
        return self.stub().ClusterStatus(pb.ClusterStatusRequest(), timeout=5, metadata=self.auth)

    def wait_idle(self, timeout: float = 30) -> pb.ClusterStatusResponse:
        """Until every worker reports nothing running, nothing queued, no KV blocks held and none
        leaked, in a report made after this call: a short request a gateway placed itself (a
        room) may start and end between two heartbeats, and a report from before it is idle too,
        without its counters. Idle is read once more a heartbeat interval (and some) later."""
        deadline = time.monotonic() + timeout
        fresh_after = time.monotonic() + REPORT_S
        while True:
            try:
                status = self.status()
            except grpc.RpcError as err:
                # Just after a NATS outage the schedulers may not have reconnected yet.
                if err.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
                continue
            if all(
                w.running == 0
                and w.queued == 0
                and w.kv_blocks_used == 0
                and w.kv_blocks_leaked == 0
                for w in status.workers
            ):
                if time.monotonic() >= fresh_after:
                    return status
                time.sleep(max(0.0, fresh_after - time.monotonic()))
                continue
            if time.monotonic() > deadline:
                raise AssertionError(f"workers not idle: {status}")
            time.sleep(0.2)


def wait_serving(
    address: str,
    group: ProcessGroup,
    timeout: float = 240,
    names: list[str] | None = None,
    credentials: grpc.ChannelCredentials | None = None,
) -> None:
    """Until the gateway is SERVING (over TLS with `credentials`); fails early if one of `names`
    (default: any process) died."""
    deadline = time.monotonic() + timeout
    channel = (
        grpc.secure_channel(address, credentials) if credentials else grpc.insecure_channel(address)
    )
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            dead = [(n, c) for n, c in group.dead() if names is None or n in names]
            assert not dead, [(n, c, group.log_tail(n)) for n, c in dead]
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError("gateway not SERVING")


def start_stack(
    group: ProcessGroup,
    nats: NatsServer,
    cluster: str,
    mode: str = "disaggregated",
    prefill: int = 1,
    decode: int = 1,
    wait: bool = True,
    extra_env: dict | None = None,
    schedulers: int = 1,
    role_env: dict[str, dict] | None = None,
) -> Stack:
    """`role_env`: variables for one role's services only (credentials), by role name."""
    role_env = role_env or {}
    port, http_port = free_port(), free_port()
    common = {
        "TANDEM_NATS_URL": nats.url,
        "TANDEM_CLUSTER": cluster,
        "TANDEM_LOG_LEVEL": "INFO",
        **(extra_env or {}),
    }
    # 512 MiB of KV each (11k SmolLM2 fp32 tokens; the longest test prompt is ~3k), not the 1 GiB
    # default: a test may run 5 workers beside the session's stacks on CI's 24 GB
    worker = {"TANDEM_KV_CACHE_MB": "512", **common, "TANDEM_TORCH_THREADS": "1"}
    names, metrics_ports = [], {}

    def spawn(name: str, service: str, env: dict) -> None:
        """Each service with a Prometheus endpoint of its own."""
        names.append(name)
        metrics_ports[name] = free_port()
        env = {**env, "TANDEM_METRICS_PORT": str(metrics_ports[name]), **role_env.get(service, {})}
        group.spawn(name, [sys.executable, "-m", f"services.{service}"], child_env(env))

    for i in range(schedulers):
        name = f"{cluster}-scheduler" + (f"-{i}" if i else "")
        spawn(name, "scheduler", {**common, "TANDEM_MODE": mode})
    for i in range(prefill if mode != "colocated" else 0):
        spawn(f"{cluster}-prefill-{i}", "prefill", worker)
    colocated = "1" if mode == "colocated" else "0"
    for i in range(decode):
        spawn(f"{cluster}-decode-{i}", "decode", {**worker, "TANDEM_COLOCATED": colocated})
    ports = {"TANDEM_GRPC_PORT": str(port), "TANDEM_HTTP_PORT": str(http_port)}
    spawn(f"{cluster}-gateway", "gateway", {**common, **ports})
    address = f"127.0.0.1:{port}"
    stack = Stack(cluster, address, group, mode, names, http_port, metrics_ports=metrics_ports)
    if wait:
        wait_serving(address, group, names=names)
        # In auto mode the gateway serves once a decode worker is up; a test that needs the
        # prefill pool (a long prompt sent to it, a prefill worker to kill) needs every worker.
        workers = decode + (prefill if mode != "colocated" else 0)
        deadline = time.monotonic() + 240
        while len(stack.status().workers) < workers:
            assert time.monotonic() < deadline and not stack.dead(), (stack.status(), stack.dead())
            time.sleep(0.2)
    return stack
