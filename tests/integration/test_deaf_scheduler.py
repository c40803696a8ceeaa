"""A scheduler replica that hears no worker steps aside (issue 45), with real nats-server and
real services: two scheduler replicas share a cluster, one of them connected as a NATS user whose
permissions deny it the workers' heartbeats (a misconfigured account, or a link that carries the
gateways' subjects but not the workers'). Every request completes; before, the gateways gave that
replica its turn and about half the requests failed UNAVAILABLE ("no live colocated worker").
The gateway's readiness and ClusterStatus come from the replica that hears the workers. With no
worker anywhere, both replicas stand aside and a request is told so at once.
"""

import re
import secrets
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.api import tandem_pb2 as pb
from shared.cli.processes import child_env, free_port, nats_server_binary, wait_for_port
from shared.control.subjects import Subjects
from tests.integration.stack import NatsServer, Stack, start_stack

pytestmark = pytest.mark.slow
CLUSTER = "it-deaf"
MOCK = {"TANDEM_ENGINE": "mock", "TANDEM_MOCK_SPEEDUP": "0"}
DEAF_ID = "it-deaf-scheduler-deaf"
REQUESTS = 12


def _nats_with_a_deaf_user(group, password: str) -> NatsServer:
    """A NATS server with two users: `tandem` may do anything; `deaf` may too, except hear the
    workers' heartbeats (its subscription there gets nothing)."""
    port, monitor = free_port(), free_port()
    heartbeats = Subjects(CLUSTER).heartbeat
    config = group.log_dir / "nats-deaf.conf"
    config.write_text(
        f'listen: "127.0.0.1:{port}"\nhttp: "127.0.0.1:{monitor}"\n'
        "authorization {\n  users = [\n"
        f'    {{user: "tandem", password: "{password}"}}\n'
        f'    {{user: "deaf", password: "{password}", permissions: {{subscribe: '
        f'{{allow: [">"], deny: ["{heartbeats}"]}}}}}}\n'
        "  ]\n}\n"
    )
    group.spawn("nats-deaf", [nats_server_binary(), "-c", str(config)], child_env({}))
    assert wait_for_port("127.0.0.1", port, 15), group.log_tail("nats-deaf")
    return NatsServer(f"nats://127.0.0.1:{port}", monitor)


def _metric(port: int, name: str) -> float | None:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        found = re.search(rf"^{name}\{{[^}}]*\}} (\S+)$", r.read().decode(), re.M)
    return float(found.group(1)) if found else None


def _generate(stack, i: int) -> str:
    """ "ok", or the failure's code and message."""
    request = pb.GenerateRequest(
        prompt_token_ids=[5 + i, 17, 23, 42],
        sampling=pb.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
    )
    try:
        ids = [t for r in stack.stub().Generate(request, timeout=60) for t in r.token_ids]
    except grpc.RpcError as err:
        return f"{err.code().name}: {err.details()}"
    return "ok" if len(ids) == 8 else f"{len(ids)} tokens"


@pytest.fixture(scope="module")
def deaf_stack(processes):
    password = secrets.token_hex(16)
    nats = _nats_with_a_deaf_user(processes, password)
    user = {"TANDEM_NATS_USER": "tandem", "TANDEM_NATS_PASSWORD": password}
    stack = start_stack(processes, nats, CLUSTER, "colocated", extra_env={**MOCK, **user})
    deaf_metrics = free_port()
    env = {
        "TANDEM_NATS_URL": nats.url,
        "TANDEM_CLUSTER": CLUSTER,
        "TANDEM_MODE": "colocated",
        "TANDEM_NATS_USER": "deaf",
        "TANDEM_NATS_PASSWORD": password,
        "TANDEM_SCHEDULER_ID": DEAF_ID,
        "TANDEM_METRICS_PORT": str(deaf_metrics),
    }
    processes.spawn(DEAF_ID, [sys.executable, "-m", "services.scheduler"], child_env(env))
    stack.names.append(DEAF_ID)
    stack.metrics_ports[DEAF_ID] = deaf_metrics
    assert wait_for_port("127.0.0.1", deaf_metrics, 60), processes.log_tail(DEAF_ID)
    # its heartbeats reach the gateway; its wait for the workers' (a worker timeout) is over
    time.sleep(4.0)
    yield stack
    stack.stop()
    Stack("", "", processes, "", ["nats-deaf"]).stop()  # last: the services leave it cleanly


def test_a_replica_that_hears_no_worker_takes_no_request_and_none_fails(deaf_stack):
    outcomes = [_generate(deaf_stack, i) for i in range(REQUESTS)]
    assert outcomes == ["ok"] * REQUESTS
    assert not deaf_stack.dead(), deaf_stack.dead()
    sees = deaf_stack.metrics_ports[f"{CLUSTER}-scheduler"]
    assert _metric(sees, "tandem_scheduler_accepting") == 1
    assert _metric(deaf_stack.metrics_ports[DEAF_ID], "tandem_scheduler_accepting") == 0


def test_the_gateways_readiness_and_status_are_the_replica_that_hears_the_workers(deaf_stack):
    """The deaf replica answers no status request either: before, half of them said "no worker,
    not ready", and the gateway's readiness flapped (NOT_SERVING 23 times in 30 checks)."""
    health = health_pb2_grpc.HealthStub(deaf_stack.channel())
    seen = []
    for _ in range(10):  # the gateway checks its readiness every second
        serving = health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
        seen.append((serving, len(deaf_stack.status().workers)))
        time.sleep(0.4)
    assert seen == [(health_pb2.HealthCheckResponse.SERVING, 1)] * 10


def test_with_no_worker_anywhere_a_request_is_told_so_at_once(deaf_stack):
    worker = f"{CLUSTER}-decode-0"
    deaf_stack.group.retire(worker, grace_s=10).wait(15)  # its last heartbeat says it stops
    time.sleep(1.0)  # both replicas' beats say they stood aside
    started = time.monotonic()
    outcome = _generate(deaf_stack, 0)
    took = time.monotonic() - started
    assert outcome == "UNAVAILABLE: no live colocated worker"
    assert took < 3.0, took  # not the gateway's 20 s submit timeout
    sees = deaf_stack.metrics_ports[f"{CLUSTER}-scheduler"]
    assert _metric(sees, "tandem_scheduler_accepting") == 0
    assert _metric(sees, "tandem_scheduler_stood_aside_total") == 1
    with pytest.raises(grpc.RpcError) as err:
        deaf_stack.status()
    assert err.value.details() == "no scheduler answered: none is running, or none hears a worker"
