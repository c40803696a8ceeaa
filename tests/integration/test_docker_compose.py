"""compose.yaml on a real Docker engine: `docker compose up` of the real images serves through the
gateway (gRPC and the official openai client), scales decode to 2, survives a decode container
killed mid-stream (every stream completes, token-identical), and `down` leaves nothing behind.

Runs where a Docker engine and the compose plugin answer; `.ci/run` installs and starts one and
sets TANDEM_REQUIRE_DOCKER=1, so that there a missing engine fails instead of skipping. Where an
image must be built and the disk has no room for it (deploy/build-images.sh checks before each
build), the test skips, saying how much is free: that is the machine's state, not the stack's."""

import os
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from harness.compose import (
    ComposeProject,
    NoRoom,
    build_images,
    docker_config,
    engine_missing,
)
from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from tests.integration.helpers import chat_request, chat_status, collect, openai_streams

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3000)]
STORY = "Tell me a long story about a lighthouse keeper and a storm."
LENGTH = 192  # tokens per stream: several seconds of decoding, for the kill to land mid-stream


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    env = {**os.environ, "DOCKER_CONFIG": str(docker_config())}
    why = engine_missing(env)
    if why:
        if os.environ.get("TANDEM_REQUIRE_DOCKER") == "1":
            pytest.fail(f"TANDEM_REQUIRE_DOCKER=1 but no Docker engine: {why}")
        pytest.skip(f"no Docker engine: {why}")
    try:
        images = build_images(env, tmp_path_factory.mktemp("images") / "build.log")
    except NoRoom as err:
        pytest.skip(f"no room to build the images: {err}")
    project = ComposeProject(env, images)
    try:
        yield project
    finally:
        project.down()
        assert project.leftovers() == {"container": [], "network": [], "volume": []}


def _stub(project: ComposeProject) -> pb_grpc.TandemStub:
    return pb_grpc.TandemStub(grpc.insecure_channel(f"127.0.0.1:{project.grpc_port}"))


def _wait_roles(project: ComposeProject, roles: list[str], timeout: float = 300):
    """Until the cluster's workers are `roles` (sorted); their status."""
    stub, deadline = _stub(project), time.monotonic() + timeout
    seen: list[str] = []
    while time.monotonic() < deadline:
        try:
            workers = stub.ClusterStatus(
                pb.ClusterStatusRequest(), timeout=5, metadata=project.auth
            ).workers
            seen = sorted(w.role for w in workers)
            if seen == roles:
                return workers
        except grpc.RpcError:
            pass
        time.sleep(1)
    raise AssertionError(f"workers {seen}, not {roles}\n{project.logs()}")


def _serving(project: ComposeProject) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{project.grpc_port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
        return check.status == health_pb2.HealthCheckResponse.SERVING


def _streams(project: ComposeProject, count: int, max_tokens: int) -> tuple[list, list, list]:
    """`count` greedy streams of STORY in threads: their token lists (growing), errors, threads."""
    tokens: list[list[int]] = [[] for _ in range(count)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            request = chat_request(STORY, max_tokens, temperature=0.0)
            for chunk in _stub(project).Generate(request, timeout=600, metadata=project.auth):
                tokens[i].extend(chunk.token_ids)
        except BaseException as e:  # noqa: BLE001 (reported by the test)
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(count)]
    for t in threads:
        t.start()
    return tokens, errors, threads


def test_compose_up_serves_scales_and_survives_a_killed_decode(project):
    started = time.monotonic()
    project.check("up", "--detach", "--wait", timeout=900)
    up_s = time.monotonic() - started
    assert _serving(project)
    _wait_roles(project, ["decode", "prefill"])
    question = chat_request("What is the capital of France?", 16)
    with pytest.raises(grpc.RpcError) as refused:  # the keys secret: no key, no answer
        collect(_stub(project), question)
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert (
        chat_status(f"http://127.0.0.1:{project.http_port}") == 401
        and chat_status(f"http://127.0.0.1:{project.http_port}", project.api_key) == 200
    )
    _, _, text = collect(_stub(project), question, metadata=project.auth)
    assert "Paris" in text, text
    url = f"http://127.0.0.1:{project.http_port}/v1"
    chat, completion = openai_streams(url, api_key=project.api_key)
    assert "Paris" in chat and completion.strip(), (chat, completion)
    story = chat_request(STORY, LENGTH, temperature=0.0)
    _, reference, _ = collect(_stub(project), story, metadata=project.auth)
    assert len(reference) == LENGTH

    project.check("up", "--detach", "--wait", "--no-recreate", "--scale", "decode=2", timeout=900)
    _wait_roles(project, ["decode", "decode", "prefill"])

    tokens, errors, threads = _streams(project, 4, LENGTH)
    deadline = time.monotonic() + 120
    while min(len(t) for t in tokens) < 8 and not errors and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not errors and min(len(t) for t in tokens) >= 8, (errors, [len(t) for t in tokens])
    busy = _busy_decode(project)
    victim = project.container_of(busy.host)
    project.kill(victim)
    at_kill = [len(t) for t in tokens]
    assert min(at_kill) < LENGTH, at_kill  # streams were in flight
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert all(t == reference for t in tokens), [len(t) for t in tokens]
    _wait_idle(project)
    print(f"compose up --wait: {up_s:.0f} s; killed {victim[:12]} ({busy.running} streams)")


def _busy_decode(project: ComposeProject, timeout: float = 30) -> pb.WorkerStatus:
    """The decode worker running the most streams, once a heartbeat shows one running any
    (ClusterStatus is as fresh as the workers' last heartbeats)."""
    deadline, workers = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        workers = (
            _stub(project)
            .ClusterStatus(pb.ClusterStatusRequest(), timeout=5, metadata=project.auth)
            .workers
        )
        busy = max((w for w in workers if w.role == "decode"), key=lambda w: w.running)
        if busy.running:
            return busy
        time.sleep(0.2)
    raise AssertionError(f"no decode worker running a stream: {workers}")


def _wait_idle(project: ComposeProject, timeout: float = 60) -> None:
    """Until every live worker holds no request and no KV block, and none leaked."""
    deadline, workers = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        workers = (
            _stub(project)
            .ClusterStatus(pb.ClusterStatusRequest(), timeout=5, metadata=project.auth)
            .workers
        )
        if all(
            w.running == w.queued == w.kv_blocks_used == w.kv_blocks_leaked == 0 for w in workers
        ):
            return
        time.sleep(0.5)
    raise AssertionError(f"not idle: {workers}")
