"""`tandem up`: starts the whole stack (secure by default: NATS users per role), says ready,
answers the demo, starts again whatever crashes, and Ctrl-C leaves no process and no secret behind."""

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import nats
import psutil
import pytest

from shared.cli.processes import free_port
from tests.integration.helpers import chat_request, chat_status, collect, openai_streams
from tests.integration.stack import Stack

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _children(pid: int) -> list[int]:
    return [int(p) for p in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def _launch(tmp_path, port: int, *flags: str, http_port: int = -1) -> subprocess.Popen:
    # Its own session, like a shell's foreground job: Ctrl-C is SIGINT to that process group.
    env = {**os.environ, "TANDEM_TORCH_THREADS": "1"}
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shared.cli.main",
            "up",
            "--grpc-port",
            str(port),
            "--http-port",
            str(http_port),
            "--log-dir",
            str(tmp_path),
            "--control-socket",
            str(tmp_path / "control.sock"),
            *flags,
        ],  # not the default socket: a developer's may be held
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )


def _read_until(proc: subprocess.Popen, done, timeout: float) -> list[str]:
    lines, deadline = [], time.monotonic() + timeout
    while not done(lines):
        assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
        lines.append(proc.stdout.readline())
    return lines


def _child(launcher_pid: int, marker: str, other_than: int = 0, timeout: float = 60) -> int:
    """The launcher's live child running `marker` (not `other_than`: one killed, perhaps still a
    zombie until the launcher reaps it and starts another)."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in _children(launcher_pid):
            try:
                proc = psutil.Process(pid)
                running = proc.status() != psutil.STATUS_ZOMBIE
                if running and pid != other_than and marker in " ".join(proc.cmdline()):
                    return pid
            except psutil.Error:  # gone meanwhile
                continue
        assert time.monotonic() < deadline, f"no {marker} process under the launcher"
        time.sleep(0.1)


def _seconds_until_serving(stack: Stack, timeout: float = 120) -> float:
    started = time.monotonic()
    while True:
        try:
            _, ids, _ = collect(stack.stub(), chat_request("Say hi.", 4), timeout=20)
            assert ids
            return time.monotonic() - started
        except grpc.RpcError as err:
            assert time.monotonic() - started < timeout, err
            time.sleep(0.3)


async def _nats_admits_strangers(port: int) -> bool:
    try:
        client = await nats.connect(
            f"nats://127.0.0.1:{port}",
            allow_reconnect=False,
            max_reconnect_attempts=0,
            connect_timeout=3,
        )
    except Exception:
        return False
    await client.close()
    return True


def test_tandem_up_secure_by_default_serves_and_stops_cleanly(tmp_path):
    port, http_port = free_port(), free_port()
    # no flag: NATS users per role (it was --secure before)
    launcher = _launch(tmp_path, port, http_port=http_port)
    children = []
    try:
        lines = _read_until(
            launcher,
            lambda ls: any(line.startswith("[") and "generated tokens" in line for line in ls),
            300,
        )
        output = "".join(lines)
        assert "ready" in output and f"control socket {tmp_path / 'control.sock'}" in output
        assert f"OpenAI API on http://127.0.0.1:{http_port}/v1" in output
        chat, completion = openai_streams(f"http://127.0.0.1:{http_port}/v1")
        assert "Paris" in chat and completion.strip(), (chat, completion)
        answer = lines[lines.index(next(line for line in lines if line.startswith("demo>"))) + 1]
        assert answer.strip(), output
        status = Stack("default", f"127.0.0.1:{port}", None, "disaggregated").status()
        assert sorted(w.role for w in status.workers) == ["decode", "prefill"]
        children = _children(launcher.pid)
        # + nats, scheduler, gateway
        assert {w.pid for w in status.workers} <= set(children) and len(children) == 5
        assert "NATS: one user per role" in output
        nats_argv = next(
            psutil.Process(pid).cmdline()
            for pid in children
            if "nats-server" in " ".join(psutil.Process(pid).cmdline())
        )
        secrets = Path(nats_argv[nats_argv.index("-c") + 1]).parent
        assert secrets.stat().st_mode & 0o077 == 0  # the passwords: readable by their owner only
        assert not asyncio.run(_nats_admits_strangers(int(nats_argv[nats_argv.index("-p") + 1])))

        # Whatever crashes is started again as it was (NATS on its port, with its users): serving goes on.
        stack = Stack("default", f"127.0.0.1:{port}", None, "disaggregated")
        for service, marker in (
            ("scheduler", "services.scheduler"),
            ("NATS", "nats-server"),
            ("gateway", "services.gateway"),
        ):
            victim = _child(launcher.pid, marker)
            children.append(victim)
            os.kill(victim, signal.SIGKILL)
            print(f"{service} killed: serving again {_seconds_until_serving(stack):.1f}s later")
            _child(launcher.pid, marker, other_than=victim)  # started again
        children += _children(launcher.pid)
    finally:
        os.killpg(launcher.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        rest, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, rest
    assert "stopped." in rest
    assert not [pid for pid in children if _alive(pid)]
    assert not secrets.exists()  # and they are gone with the stack


def test_ctrl_c_while_starting_stops_everything(tmp_path):
    launcher = _launch(tmp_path, free_port())
    _read_until(launcher, lambda ls: any("starting" in line for line in ls), 120)
    children = _children(launcher.pid)
    assert children
    os.killpg(launcher.pid, signal.SIGINT)
    rest, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 130, rest
    assert not [pid for pid in children if _alive(pid)]


def test_tandem_up_with_api_keys_refuses_a_request_without_a_key(tmp_path):
    """Before, `tandem up` had no --api-keys-file: its gateway served anyone who reached it."""
    keys = tmp_path / "keys.json"
    make = [sys.executable, "-m", "shared.cli.main", "api-keys", "--new", str(keys)]
    key = subprocess.run(make + ["--name", "me"], check=True, capture_output=True, text=True)
    key = key.stdout.strip()
    port, http_port = free_port(), free_port()
    flags = ("--api-keys-file", str(keys), "--mode", "colocated", "--no-demo")
    launcher = _launch(tmp_path, port, *flags, http_port=http_port)
    try:
        lines = _read_until(launcher, lambda ls: any("ready" in line for line in ls), 300)
        assert f"API keys from {keys}" in "".join(lines)
        url = f"http://127.0.0.1:{http_port}"
        assert chat_status(url) == 401
        assert chat_status(url, "not-" + key) == 401
        assert chat_status(url, key) == 200
        with pytest.raises(grpc.RpcError) as refused:
            collect(
                Stack("default", f"127.0.0.1:{port}", None, "colocated").stub(),
                chat_request("Hi", 2),
            )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        status = [
            sys.executable,
            "-m",
            "shared.cli.main",
            "status",
            "--address",
            f"127.0.0.1:{port}",
        ]
        anonymous = subprocess.run(status, capture_output=True, text=True, timeout=60)
        assert anonymous.returncode == 1 and "UNAUTHENTICATED" in anonymous.stderr
        env = {**os.environ, "TANDEM_API_KEY": key}
        keyed = subprocess.run(status, capture_output=True, text=True, timeout=60, env=env)
        assert keyed.returncode == 0 and "colocated" in keyed.stdout, keyed.stderr
    finally:
        os.killpg(launcher.pid, signal.SIGINT)
        rest, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, rest


def _listeners(pid: int) -> set[int]:
    """The TCP ports process `pid` listens on."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN}


def _gateways(launcher_pid: int) -> list[int]:
    found = [(pid, " ".join(psutil.Process(pid).cmdline())) for pid in _children(launcher_pid)]
    return [pid for pid, argv in found if "services.gateway" in argv]


def test_tandem_up_runs_several_gateways_on_one_port(tmp_path):
    """`--gateways 2`: two gateway processes listen on the same gRPC and HTTP ports
    (SO_REUSEPORT); connections are spread over both, every request is answered; one killed,
    the other serves alone meanwhile and the killed one starts again on the same ports."""
    port, http_port = free_port(), free_port()
    flags = ("--mode", "colocated", "--no-demo", "--gateways", "2")
    launcher = _launch(tmp_path, port, *flags, http_port=http_port)
    url = f"http://127.0.0.1:{http_port}"
    try:
        _read_until(launcher, lambda ls: any("ready" in line for line in ls), 300)
        gateways = _gateways(launcher.pid)
        assert len(gateways) == 2
        assert all({port, http_port} <= _listeners(pid) for pid in gateways)
        assert [chat_status(url) for _ in range(24)] == [200] * 24  # a connection each
        served = [
            sum("placed:" in line for line in (tmp_path / f"{name}.log").read_text().splitlines())
            for name in ("gateway", "gateway-1")
        ]
        assert sum(served) == 24 and min(served) > 0, served  # both took connections

        os.kill(gateways[0], signal.SIGKILL)
        # gone, reaped: its listener closed once its last thread ended (a zombie's may still
        # take a connection, and reset it as it closes)
        while os.path.exists(f"/proc/{gateways[0]}"):
            time.sleep(0.05)
        assert [chat_status(url) for _ in range(8)] == [200] * 8  # the other one, meanwhile
        deadline = time.monotonic() + 120
        while len(again := _gateways(launcher.pid)) < 2 or not all(
            {port, http_port} <= _listeners(pid) for pid in again
        ):
            assert time.monotonic() < deadline, "the killed gateway did not start again"
            time.sleep(0.5)
        assert gateways[0] not in again and gateways[1] in again
        assert [chat_status(url) for _ in range(8)] == [200] * 8
    finally:
        os.killpg(launcher.pid, signal.SIGINT)
        rest, _ = launcher.communicate(timeout=60)
    assert launcher.returncode == 0, rest
