"""BenchStack: an embedded stack for benchmarks, each service its own process, workers pinned.

Like `tandem up`, but every worker's cores, threads and settings are given explicitly, so the
setups a study compares use the same cores: `Worker("prefill", cores="0", threads=1)` runs
`taskset -c 0 python -m services.prefill` with TANDEM_TORCH_THREADS=1. NATS, the scheduler and
the gateway float on every core.
"""

import json
import os
import shutil
import sys
import tempfile
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.cli.launcher import wait_until_serving  # noqa: E402
from shared.cli.processes import (  # noqa: E402
    ProcessGroup,
    child_env,
    free_port,
    nats_server_binary,
    wait_for_port,
)

# The benchmarks' load generator is one client standing for many users: the per-client limits
# (meant to keep one tenant from starving others) would cap the load it offers.
LOAD_GENERATOR = {
    "TANDEM_MAX_STREAMS_PER_CLIENT": "100000",
    "TANDEM_MAX_QUEUED_PER_CLIENT": "100000",
    "TANDEM_MAX_KV_TOKENS_PER_CLIENT": "1000000000",
}


@dataclass
class Worker:
    role: str  # prefill, decode or colocated
    cores: str = ""  # taskset -c list; empty = every core
    threads: int = 1
    env: dict = field(default_factory=dict)


class BenchStack:
    def __init__(
        self,
        name: str,
        mode: str,
        workers: list[Worker],
        scheduler_env: dict | None = None,
        common_env: dict | None = None,
        gateway_env: dict | None = None,
        metadata=(),
        expect_workers: int = 0,  # workers to wait for (default: one per Worker)
        gateway_cores: str = "",  # taskset -c list for the gateway; empty = every core
    ):
        self.name, self.mode, self.workers = name, mode, workers
        self.scheduler_env = scheduler_env or {}
        self.gateway_env = gateway_env or {}
        self.metadata = metadata  # an API key's, when gateway_env configures keys
        self.common_env = common_env or {}
        self.log_dir = Path(tempfile.mkdtemp(prefix=f"tandem-bench-{name}-"))
        self.group = ProcessGroup(self.log_dir)
        self.address = ""
        self.expect_workers = expect_workers or len(workers)
        self.monitor_port = 0  # nats-server's HTTP monitoring (/varz: its message counts)
        self.gateway_cores = gateway_cores

    def __enter__(self) -> "BenchStack":
        try:
            self._start()
        except BaseException:
            self.group.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.group.stop()

    def _start(self) -> None:
        port, grpc_port, self.http_port = free_port(), free_port(), free_port()
        self.monitor_port = free_port()
        nats = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)]
        self.group.spawn("nats", nats + ["-m", str(self.monitor_port)], child_env({}))
        if not wait_for_port("127.0.0.1", port, 15):
            raise RuntimeError("nats-server did not start")
        common = {
            "TANDEM_NATS_URL": f"nats://127.0.0.1:{port}",
            "TANDEM_CLUSTER": self.name,
            **self.common_env,
        }
        py = [sys.executable, "-m"]
        self.group.spawn(
            "scheduler",
            py + ["services.scheduler"],
            child_env({**common, "TANDEM_MODE": self.mode, **self.scheduler_env}),
        )
        for i, w in enumerate(self.workers):
            pin = ["taskset", "-c", w.cores] if w.cores and shutil.which("taskset") else []
            service = "services.prefill" if w.role == "prefill" else "services.decode"
            env = {
                **common,
                "TANDEM_TORCH_THREADS": str(w.threads),
                "TANDEM_COLOCATED": "1" if w.role == "colocated" else "0",
                **w.env,
            }
            self.group.spawn(f"{w.role}-{i}", pin + py + [service], child_env(env))
        pin = ["taskset", "-c", self.gateway_cores] if self.gateway_cores else []
        self.group.spawn(
            "gateway",
            pin + py + ["services.gateway"],
            child_env(
                {
                    **common,
                    "TANDEM_GRPC_PORT": str(grpc_port),
                    "TANDEM_HTTP_PORT": str(self.http_port),
                    **LOAD_GENERATOR,
                    **self.gateway_env,
                }
            ),
        )
        self.address = f"127.0.0.1:{grpc_port}"
        wait_until_serving(
            self.address, self.group, 300, workers=self.expect_workers, metadata=self.metadata
        )

    def varz(self) -> dict:
        """nats-server's counters now (in_msgs: messages clients published)."""
        url = f"http://127.0.0.1:{self.monitor_port}/varz"
        with urllib.request.urlopen(url, timeout=5) as reply:
            return json.load(reply)

    def pid(self, name: str) -> int:
        return next(p.pid for n, p in self.group.children if n == name)


def cores() -> int:
    return len(os.sched_getaffinity(0))
