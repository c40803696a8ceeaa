"""NVIDIA Dynamo 1.6.1's frontend and mocker engine, run as ../shared/peers/dynamo/RUN.md says:
file discovery, TCP request plane, every socket on loopback, in its own venv (.venv-dynamo,
`make bench-control-plane` installs it). The mocker runs at --speedup-ratio 1e6 (its
"infinite speedup" 0 behaves like 1 in 1.6.1), so what is measured is the control plane.
"""

import json
import os
import shutil
import tempfile
import time
import urllib.request
from pathlib import Path

from shared.cli.processes import ProcessGroup, child_env, free_port

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-dynamo"


def available() -> bool:
    return (VENV / "bin" / "python").exists()


class DynamoStack:
    """`with DynamoStack(model_dir, disaggregated) as d:` then d.base_url serves
    /v1/chat/completions; the model's name is str(model_dir)."""

    def __init__(self, model_dir: Path, disaggregated: bool):
        self.model = str(model_dir)
        self.disaggregated = disaggregated
        self.root = Path(tempfile.mkdtemp(prefix="tandem-bench-dynamo-"))
        (self.root / "logs").mkdir()
        self.group = ProcessGroup(self.root / "logs")
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"

    def _env(self) -> dict:
        loopback = ("TCP_RPC", "TCP_RESPONSE_STREAM", "EVENT_PLANE", "SYSTEM")
        env = {f"DYN_{name}_HOST": "127.0.0.1" for name in loopback}
        return child_env(
            {
                **env,
                "DYN_DISCOVERY_BACKEND": "file",
                "DYN_FILE_KV": str(self.root / "kv"),
                "DYN_REQUEST_PLANE": "tcp",
                "DYN_LOG": "warn",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
            }
        )

    def __enter__(self) -> "DynamoStack":
        python = str(VENV / "bin" / "python")
        env = self._env()
        frontend = ["-m", "dynamo.frontend", "--http-host", "127.0.0.1"]
        self.group.spawn("frontend", [python, *frontend, "--http-port", str(self.port)], env)
        mocker = [python, "-m", "dynamo.mocker", "--model-path", self.model]
        mocker += ["--speedup-ratio", "1000000"]
        if self.disaggregated:
            for mode in ("prefill", "decode"):
                extra = ["--disaggregation-mode", mode, "--kv-transfer-bandwidth", "0"]
                self.group.spawn(mode, mocker + extra, env)
        else:
            self.group.spawn("mocker", mocker, env)
        try:
            self._wait_ready(120)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.group.dead():
                name, code = self.group.dead()[0]
                raise RuntimeError(f"dynamo {name} exited {code}:\n{self.group.log_tail(name)}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/v1/models", timeout=2) as r:
                    if json.load(r).get("data") and self._answers():
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError("Dynamo's frontend did not serve the model in time")

    def _answers(self) -> bool:
        """One request through (in disaggregated mode, once the prefill router is active)."""
        body = {
            "model": self.model,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
        }
        request = urllib.request.Request(
            f"{self.base_url}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    def pids(self) -> dict[str, int]:
        return {name: p.pid for name, p in self.group.children}

    def __exit__(self, *exc) -> None:
        self.group.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def dynamo_version() -> str:
    try:
        meta = next(VENV.glob("lib/python*/site-packages/ai_dynamo-*.dist-info"))
        return meta.name.removesuffix(".dist-info").split("-")[1]
    except StopIteration:
        return "?"


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process so far (seconds)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
