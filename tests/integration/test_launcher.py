"""`tandem up`: starts the whole stack, says ready, answers the demo, and Ctrl-C leaves no process behind."""

import os
import signal
import subprocess
import sys
import time

import pytest

from shared.cli.processes import free_port
from tests.integration.stack import Stack

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().split()[2] != "Z"


def test_tandem_up_serves_and_stops_cleanly(tmp_path):
    port = free_port()
    env = {**os.environ, "TANDEM_TORCH_THREADS": "1"}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "shared.cli.main", "up", "--grpc-port", str(port), "--log-dir", str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + 300
        while not any(line.startswith("[") and "generated tokens" in line for line in lines):
            assert time.monotonic() < deadline and launcher.poll() is None, "".join(lines)
            lines.append(launcher.stdout.readline())
        output = "".join(lines)
        assert "ready" in output
        answer = lines[lines.index(next(l for l in lines if l.startswith("demo>"))) + 1]
        assert answer.strip(), output
        status = Stack("default", f"127.0.0.1:{port}", None, "disaggregated").status()
        pids = [w.pid for w in status.workers]
        assert sorted(w.role for w in status.workers) == ["decode", "prefill"]
        children = [int(p) for p in open(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read().split()]
        assert set(pids) <= set(children) and len(children) == 5  # nats, scheduler, prefill, decode, gateway
    finally:
        launcher.send_signal(signal.SIGINT)
        rest, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, rest
    assert "stopped." in rest
    assert not [pid for pid in children if _alive(pid)]
