"""KV between compose containers (`make bench-compose-kv`): the transfer rate from a prefill
container to a decode container on compose.yaml's default network path (TCP over the bridge)
against the workers sharing an IPC and a PID namespace with SYS_PTRACE (UCX's shared-memory
transports, cma among them), measured on a real Docker engine in one run.

Each setting: a compose project (the images from deploy/build-images.sh), the scheduler in
disaggregated mode, the KV sent as one segment after the whole prompt is computed (so the
transfer span is the transfer alone), prompts of --tokens tokens with max_tokens=1 (a different
first word each: no prefix-cache hit). Rate = KV bytes the decode worker received / (TTFT -
prefill time). Writes bench/results/compose-kv.{md,json}.
"""

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402

from bench.kv import prompt_text  # noqa: E402
from harness.compose import (  # noqa: E402
    ComposeProject,
    build_images,
    docker_config,
    engine_missing,
)
from shared.api import tandem_pb2 as pb  # noqa: E402
from shared.api import tandem_pb2_grpc as pb_grpc  # noqa: E402

RESULTS = Path(__file__).parent / "results"
BENCH_OVERRIDE = """services:
  scheduler: {environment: {TANDEM_MODE: disaggregated}}
  prefill: {environment: {TANDEM_KV_SEGMENT_TOKENS: "16384", TANDEM_MAX_MODEL_LEN: "8192"}}
  decode: {environment: {TANDEM_KV_SEGMENT_TOKENS: "16384", TANDEM_MAX_MODEL_LEN: "8192"}}
"""
# The workers in one IPC and one PID namespace (held by a process of their own), with the
# capability cma needs to read another process's memory: UCX's shared-memory transports reach
# from container to container, as between processes of one host. Measured, not offered: every
# worker container could read every other's memory (its NATS password among it).
SHARED_MEMORY = """services:
  kvshm:
    image: ${TANDEM_IMAGE:-tandem:latest}
    pull_policy: never
    command: ["python", "-c", "import signal, sys; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); signal.pause()"]
    ipc: shareable
    shm_size: 1gb
  prefill: &shared
    ipc: "service:kvshm"
    pid: "service:kvshm"
    cap_add: [SYS_PTRACE]
    depends_on: {kvshm: {condition: service_started}}
  decode: *shared
"""
SETTINGS = {
    "compose.yaml (the container network)": [BENCH_OVERRIDE],
    "shared IPC + PID namespaces, SYS_PTRACE": [BENCH_OVERRIDE, SHARED_MEMORY],
}


def workers(stub, auth: tuple) -> dict[str, pb.WorkerStatus]:
    status = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=5, metadata=auth)
    return {w.role: w for w in status.workers}


def wait_pair(stub, auth: tuple, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if set(workers(stub, auth)) == {"prefill", "decode"}:
                return
        except grpc.RpcError:
            pass
        time.sleep(1)
    raise TimeoutError("no prefill and decode worker")


def measure(project: ComposeProject, text: str, repeats: int) -> dict:
    """The runs after a warm-up, and the requests that failed. KV bytes per token: all the decode
    worker received over the prompts it was sent (its counters, once the last heartbeat is in)."""
    rows, failures, tokens = [], [], 0
    with grpc.insecure_channel(f"127.0.0.1:{project.grpc_port}") as channel:
        stub = pb_grpc.TandemStub(channel)
        wait_pair(stub, project.auth)
        for i in range(repeats + 1):
            request = pb.GenerateRequest(
                prompt=f"Run {i}. {text}", sampling=pb.SamplingParams(max_tokens=1)
            )
            try:
                last = list(stub.Generate(request, timeout=600, metadata=project.auth))[-1]
            except grpc.RpcError as e:
                failures.append(f"{e.code().name}: {e.details()}")
                continue
            tokens += last.usage.prompt_tokens
            t = last.timing
            if i:  # not the warm-up
                rows.append(
                    dict(
                        prompt_tokens=last.usage.prompt_tokens,
                        transfer_span_ms=t.kv_transfer_ms,
                        after_prefill_ms=t.ttft_ms - t.prefill_ms,
                        ttft_ms=t.ttft_ms,
                    )
                )
        time.sleep(2)  # heartbeats every 0.5 s
        now = workers(stub, project.auth)
    for row in rows:
        row["transport"] = now["decode"].kv_transport
        row["kv_bytes"] = row["prompt_tokens"] * now["decode"].kv_bytes_received / tokens
        row["mb_per_s"] = row["kv_bytes"] / 1e6 / (row["after_prefill_ms"] / 1e3)
        print(f"  {row}", flush=True)
    failed = sum(w.kv_transfers_failed for w in now.values())
    return dict(rows=rows, failures=failures, transfers_failed=failed)


def run_setting(env, images, overrides: list[str], text: str, repeats: int) -> list[dict]:
    folder = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    files = []
    for i, text_of in enumerate(overrides):
        files.append(folder / f"override-{i}.yaml")
        files[-1].write_text(text_of)
    project = ComposeProject(env, images, tuple(files))
    try:
        project.check("up", "--detach", "--wait", timeout=900)
        return measure(project, text, repeats)
    finally:
        project.down()


def summary(result: dict) -> dict:
    rows = result["rows"]
    return dict(
        transport=rows[0]["transport"] if rows else "-",
        kv_mb=statistics.median(r["kv_bytes"] for r in rows) / 1e6,
        span_ms=statistics.median(r["transfer_span_ms"] for r in rows),
        after_ms=statistics.median(r["after_prefill_ms"] for r in rows),
        mb_per_s=statistics.median(r["mb_per_s"] for r in rows),
        ttft_ms=statistics.median(r["ttft_ms"] for r in rows),
    )


def write(results: dict[str, dict], command: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "compose-kv.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        "# KV between compose containers",
        "",
        f"`{command}`, {os.cpu_count()} cores, medians. The KV is sent as one segment once the",
        "prompt is computed, so TTFT minus the prefill time is the transfer and its hand-over;",
        "rate = KV bytes / that time. The transfer span is the workers' own (first byte sent to",
        "last landed).",
        "",
        "| setting | UCX transports | KV per prompt | TTFT - prefill | rate | transfer span "
        "| TTFT | requests failed | transfers failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, result in results.items():
        s = summary(result)
        lines.append(
            f"| {name} | {s['transport']} | {s['kv_mb']:.0f} MB | {s['after_ms']:.0f} ms "
            f"| {s['mb_per_s']:.0f} MB/s | {s['span_ms']:.1f} ms | {s['ttft_ms']:.0f} ms "
            f"| {len(result['failures'])} | {result['transfers_failed']} |"
        )
    (RESULTS / "compose-kv.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "DOCKER_CONFIG": str(docker_config())}
    why = engine_missing(env)
    if why:
        print(f"no Docker engine: {why}", file=sys.stderr)
        return 2
    images = build_images(env, Path(tempfile.mkdtemp()) / "build.log")
    text = prompt_text(args.tokens)
    results = {}
    for name, overrides in SETTINGS.items():
        print(name, flush=True)
        results[name] = run_setting(env, images, overrides, text, args.repeats)
    write(results, f"python bench/compose_kv.py --tokens {args.tokens} --repeats {args.repeats}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
