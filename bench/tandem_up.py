"""TandemUp: `tandem up` with its defaults, as a user starts it, run as a subprocess for a benchmark.

Only the ports, the cluster name, the control socket and the log folder are the benchmark's own
(so that it never meets another stack on this machine), and --no-demo; everything else (the
mode, the workers, the gateway's limits) is `tandem up`'s default. The gateway is found among
the launcher's children, so its memory can be read (/proc/<pid>/status) while it serves.
"""

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.cli.processes import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
READY_LINE = "tandem is ready"
STOP_TIMEOUT_S = 60.0  # SIGINT: the launcher stops its services in order, then exits


class TandemUp:
    def __init__(self, name: str, ready_timeout_s: float = 600.0, extra_args: tuple = ()):
        self.name = f"{name}-{os.getpid()}"
        self.ready_timeout_s = ready_timeout_s
        self.extra_args = list(extra_args)
        self.dir = Path(tempfile.mkdtemp(prefix=f"tandem-{name}-"))
        self.http_port = 0
        self.process: subprocess.Popen | None = None
        self.gateway_pids: list[int] = []  # every gateway process seen (a restart adds one)
        self.started = 0.0  # monotonic: when it was ready

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def __enter__(self) -> "TandemUp":
        self.http_port, grpc_port = free_port(), free_port()
        argv = [sys.executable, "-m", "shared.cli.main", "up", "--no-demo"]
        argv += ["--cluster", self.name, "--control-socket", str(self.dir / "control.sock")]
        argv += ["--grpc-port", str(grpc_port), "--http-port", str(self.http_port)]
        argv += ["--log-dir", str(self.dir / "logs"), *self.extra_args]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(self.dir / "up.log", "wb") as out:
            self.process = subprocess.Popen(
                argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tandem up exited ({self.process.returncode}):\n{self.log()}")
            if READY_LINE in self.log():
                self.gateway_pid()
                self.started = time.monotonic()
                return
            time.sleep(0.5)
        raise TimeoutError(f"tandem up not ready within {self.ready_timeout_s:.0f}s:\n{self.log()}")

    def log(self) -> str:
        return (self.dir / "up.log").read_text(errors="replace")

    def gateway_pid(self) -> int:
        """The gateway's process now (the launcher restarts a gateway that crashed)."""
        for child in psutil.Process(self.process.pid).children():
            try:
                if "services.gateway" in child.cmdline():
                    if child.pid not in self.gateway_pids:
                        self.gateway_pids.append(child.pid)
                    return child.pid
            except psutil.NoSuchProcess:
                continue
        raise RuntimeError("no gateway process under tandem up")

    def model(self) -> str:
        with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=10) as reply:
            return json.load(reply)["data"][0]["id"]

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


ROLES = ("gateway", "scheduler", "prefill", "decode")


def cpu_seconds(root: int, extra: dict[str, int] | None = None) -> dict[str, float]:
    """CPU seconds (user + system) used so far by the processes under `root` (a `tandem up`), by
    what they run (a service's role, "nats", "launcher"), and by each of `extra` (name: pid)."""
    used: dict[str, float] = {}
    tree = psutil.Process(root)
    for process in [tree, *tree.children(recursive=True)]:
        try:
            line, times = " ".join(process.cmdline()), process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        role = next((r for r in ROLES if f"services.{r}" in line), None)
        name = role or ("nats" if "nats-server" in line else "launcher")
        used[name] = used.get(name, 0.0) + times.user + times.system
    for name, pid in (extra or {}).items():
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.NoSuchProcess:
            continue
        used[name] = times.user + times.system
    return used


def rss_mib(pid: int) -> float:
    """A process's resident memory now (VmRSS), in MiB; NaN once it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")
