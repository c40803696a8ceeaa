"""The NATS server restarts under load: every service reconnects by itself, nothing hangs or leaks.

The stack has a NATS server of its own (the session's is shared by other stacks). While a stream
is in flight the server is killed and, a second later, started again on the same port. The stream
either completes (token-identical to an undisturbed run) or fails with UNAVAILABLE; requests
after the restart succeed without restarting any service; every KV block is free at the end.
"""

import concurrent.futures
import time

import grpc
import pytest

from shared.cli.processes import child_env, free_port, nats_server_binary, wait_for_port
from tests.integration.helpers import chat_request, collect
from tests.integration.stack import NatsServer, start_stack

pytestmark = pytest.mark.slow


def _spawn_nats(processes, port: int, monitor: int, name: str):
    proc = processes.spawn(
        name,
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor)],
        child_env({}),
    )
    assert wait_for_port("127.0.0.1", port, 15), processes.log_tail(name)
    return proc


def _first_success(stack, request, timeout_s: float = 60) -> tuple[list[int], float]:
    """Tries `request` until it succeeds; returns its tokens and how long until it did."""
    started = time.monotonic()
    while True:
        try:
            return collect(stack.stub(), request, timeout=60)[1], time.monotonic() - started
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err
            assert time.monotonic() - started < timeout_s, (
                f"not serving {timeout_s:.0f}s after the restart: {err}"
            )
            time.sleep(0.2)


def test_services_reconnect_after_a_nats_restart(processes):
    port, monitor = free_port(), free_port()
    server = _spawn_nats(processes, port, monitor, "nats-restart-0")
    nats = NatsServer(f"nats://127.0.0.1:{port}", monitor)
    stack = start_stack(processes, nats, "it-nats", "auto", prefill=1, decode=1)
    try:
        story = chat_request("Write a long story about a lighthouse keeper.", 120, ignore_eos=True)
        short = chat_request("Name three colours.", 12)
        undisturbed = collect(stack.stub(), story)[1]
        expected_short = collect(stack.stub(), short)[1]

        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(collect, stack.stub(), story, 120)
            time.sleep(1.0)  # streaming by now
            server.kill()
            server.wait()
            time.sleep(1.0)
            server = _spawn_nats(processes, port, monitor, "nats-restart-1")
            ids, recovery_s = _first_success(stack, short)
            assert ids == expected_short
            try:
                assert in_flight.result()[1] == undisturbed  # it completed, and correctly
            except grpc.RpcError as err:
                assert err.code() == grpc.StatusCode.UNAVAILABLE, err
        print(f"serving again {recovery_s:.1f}s after NATS came back")
        # once more, on the reconnected paths
        assert collect(stack.stub(), short)[1] == expected_short
        assert not stack.dead(), stack.dead()  # no service crashed or needed a restart
        stack.wait_idle()
    finally:
        stack.stop()
        server.kill()
