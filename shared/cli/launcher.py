"""`tandem up`: NATS (unless given), one scheduler, prefill and decode workers and the gateway, as processes."""

import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared import model_store
from shared.cli.client import stream_generate, summary
from shared.cli.processes import ProcessGroup, child_env, free_port, nats_server_binary, wait_for_port

DEMO_PROMPT = "In one sentence, why does separating prefill from decode help LLM serving?"
READY_TIMEOUT_S = 300


def wait_until_serving(address: str, group: ProcessGroup, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if group.dead():
                name, code = group.dead()[0]
                raise RuntimeError(f"{name} exited with code {code}:\n{group.log_tail(name)}")
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.3)
    raise TimeoutError(f"the gateway did not report SERVING within {timeout:.0f}s")


def start_stack(args, group: ProcessGroup) -> str:
    """Starts every process; returns the gateway address."""
    nats_url = args.nats_url
    if not nats_url:
        port, monitor = free_port(), free_port()
        group.spawn("nats", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor)],
                    child_env({}))
        if not wait_for_port("127.0.0.1", port, 15):
            raise RuntimeError("nats-server did not start:\n" + group.log_tail("nats"))
        nats_url = f"nats://127.0.0.1:{port}"
    workers = args.prefill + args.decode if args.mode == "disaggregated" else args.decode
    common = {"TANDEM_NATS_URL": nats_url, "TANDEM_CLUSTER": args.cluster, "TANDEM_MODEL": args.model,
              "TANDEM_MODEL_CACHE": args.model_cache}
    worker_env = dict(common)
    if "TANDEM_TORCH_THREADS" not in os.environ:  # workers share this machine's cores
        worker_env["TANDEM_TORCH_THREADS"] = str(max(1, (os.cpu_count() or 1) // max(1, workers)))
    python = [sys.executable, "-m"]
    group.spawn("scheduler", python + ["services.scheduler"], child_env({**common, "TANDEM_MODE": args.mode}))
    if args.mode == "disaggregated":
        for i in range(args.prefill):
            group.spawn(f"prefill-{i}", python + ["services.prefill"], child_env(worker_env))
    for i in range(args.decode):
        colocated = {"TANDEM_COLOCATED": "1" if args.mode == "colocated" else "0"}
        group.spawn(f"decode-{i}", python + ["services.decode"], child_env({**worker_env, **colocated}))
    group.spawn("gateway", python + ["services.gateway"],
                child_env({**common, "TANDEM_GRPC_PORT": str(args.grpc_port)}))
    return f"127.0.0.1:{args.grpc_port}"


def up_command(args) -> int:
    if args.prefill < 1 or args.decode < 1:
        print("error: --prefill and --decode must be at least 1", file=sys.stderr)
        return 2
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="tandem-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stopping: list[int] = []
    started = [False]

    def on_signal(signum, frame) -> None:
        first = not stopping
        stopping.append(signum)
        if first and not started[0]:
            raise KeyboardInterrupt  # still starting: unwind, and the ProcessGroup stops what runs

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        print("preparing the model (the first run converts the GGUF once) ...", flush=True)
        model_store.prepare(args.model, args.model_cache)
        with ProcessGroup(log_dir) as group:
            return _serve(args, group, log_dir, stopping, started)
    except KeyboardInterrupt:
        print("interrupted; every process stopped.", flush=True)
        return 130


def _serve(args, group: ProcessGroup, log_dir: Path, stopping: list, started: list) -> int:
    try:
        address = start_stack(args, group)
        print(f"starting {args.mode} stack, logs in {log_dir} ...", flush=True)
        wait_until_serving(address, group, READY_TIMEOUT_S)
    except (RuntimeError, TimeoutError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    pools = (f"{args.prefill} prefill, {args.decode} decode" if args.mode == "disaggregated"
             else f"{args.decode} colocated")
    print(f"tandem is ready: gRPC API on {address} ({args.mode}; {pools}). Ctrl-C stops it.", flush=True)
    if not args.no_demo:
        print(f"demo> {DEMO_PROMPT}", flush=True)
        try:
            print(summary(stream_generate(address, DEMO_PROMPT, 64, 0.0)), flush=True)
        except grpc.RpcError as err:
            print(f"demo request failed: {err.code().name}: {err.details()}", file=sys.stderr)
    started[0] = True
    while not stopping:
        if group.dead():
            name, code = group.dead()[0]
            print(f"error: {name} exited with code {code}; stopping the stack:\n{group.log_tail(name)}",
                  file=sys.stderr)
            return 1
        time.sleep(0.3)
    print("stopping ...", flush=True)
    group.stop()
    print("stopped.", flush=True)
    return 0
