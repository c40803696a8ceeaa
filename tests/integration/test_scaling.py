"""`tandem scale` on a running `tandem up`: a decode worker joins, crashes (and is replaced) and leaves
under load, and no request fails."""

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from shared.cli.processes import free_port
from tests.integration.helpers import chat_request
from tests.integration.stack import Stack
from tests.integration.test_launcher import _alive, _children, _read_until

pytestmark = pytest.mark.slow
PROMPTS = ["Name a colour.", "Count to five.", "Say hello.", "What is 2+2?"]


class Load:
    """Threads that keep `concurrency` short streaming requests in flight; every failure is kept."""

    def __init__(self, address: str, concurrency: int = 4):
        self.channel = grpc.insecure_channel(address)
        self.stop = threading.Event()
        self.completed = 0
        self.failures: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(concurrency)]

    def _run(self, i: int) -> None:
        stub = pb_grpc.TandemStub(self.channel)
        while not self.stop.is_set():
            request = chat_request(PROMPTS[i % len(PROMPTS)], max_tokens=16)
            try:
                last = list(stub.Generate(request, timeout=60))[-1]
                outcome = (
                    None
                    if last.finish_reason != pb.FINISH_REASON_UNSPECIFIED
                    else "no finish reason"
                )
            except grpc.RpcError as err:
                outcome = f"{err.code().name}: {err.details()}"
            with self.lock:
                if outcome:
                    self.failures.append(outcome)
                else:
                    self.completed += 1

    def wait_for(self, more: int, timeout: float = 60) -> None:
        target, deadline = self.completed + more, time.monotonic() + timeout
        while self.completed < target:
            assert time.monotonic() < deadline, f"only {self.completed}/{target} requests completed"
            time.sleep(0.1)

    def __enter__(self) -> "Load":
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(90)
        self.channel.close()


def _tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shared.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=240,
    )


def _decode_workers(stack: Stack) -> list[pb.WorkerStatus]:
    return [w for w in stack.status().workers if w.role == "decode"]


def _replaced(stack: Stack, launcher_pid: int, crashed_pid: int) -> bool:
    """Two decode workers serve again, both the launcher's own children, neither the crashed one
    (a stale entry, or a worker this launcher did not start, does not count)."""
    pids = {w.pid for w in _decode_workers(stack)}
    return len(pids) == 2 and crashed_pid not in pids and pids <= set(_children(launcher_pid))


def _wait_until(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def test_scale_decode_out_and_in_under_load(tmp_path):
    port, sock = free_port(), tmp_path / "sock"
    # Slack 0: the emptiest decode worker takes each request. With the default slack a light load
    # stays on the worker that already holds the prompts' prefix, and a new one waits for more load.
    env = {**os.environ, "TANDEM_TORCH_THREADS": "1", "TANDEM_DECODE_SLACK": "0"}
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shared.cli.main",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--no-demo",
            "--grpc-port",
            str(port),
            "--http-port",
            "-1",
            "--log-dir",
            str(tmp_path),
            "--control-socket",
            str(sock),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    stack = Stack("default", f"127.0.0.1:{port}", None, "disaggregated")
    seen: set[int] = set()
    try:
        _read_until(launcher, lambda ls: any(line.startswith("control socket") for line in ls), 300)
        seen |= set(_children(launcher.pid))
        with Load(stack.address) as load:
            load.wait_for(4)
            out = _tandem(
                "scale", "decode=2", "--wait", "--control-socket", str(sock), "--timeout", "150"
            )
            assert out.returncode == 0, out.stdout + out.stderr
            assert "started decode-1" in out.stdout and "settled" in out.stdout
            seen |= set(_children(launcher.pid))
            assert len(_decode_workers(stack)) == 2
            _wait_until(
                lambda: all(w.requests_served > 0 for w in _decode_workers(stack)),
                60,
                "the new decode worker took no request",
            )

            # A decode worker crashes: its requests move to the other one, and the launcher starts
            # decode-2 in its place.
            crashed = _decode_workers(stack)[0]
            os.kill(crashed.pid, signal.SIGKILL)
            _wait_until(
                lambda: _replaced(stack, launcher.pid, crashed.pid),
                150,
                "the crashed decode worker was not replaced",
            )
            load.wait_for(4)

            out = _tandem(
                "scale", "decode=1", "--wait", "--control-socket", str(sock), "--timeout", "90"
            )
            assert out.returncode == 0, out.stdout + out.stderr
            assert "stopping decode-2" in out.stdout
            assert len(_decode_workers(stack)) == 1
            load.wait_for(4)  # the one left keeps serving
        assert load.failures == [], load.failures
        assert load.completed >= 8
    finally:
        os.killpg(launcher.pid, signal.SIGINT)
        rest, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, rest
    assert "retired decode-2 is gone (exit code 0)" in rest, rest
    assert "exited with code -9; started decode-2 in its place" in rest, rest
    assert not [pid for pid in seen if _alive(pid)]
