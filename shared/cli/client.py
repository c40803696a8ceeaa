"""`tandem generate` and `tandem status`: small gRPC clients of the gateway; and the wait for one
starting (`tandem up`, the benchmarks)."""

import os
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from shared.cli.processes import ProcessGroup

ASK_TIMEOUT_S = 2.0  # for each health or status question to a gateway starting
POLL_S = 0.3  # how often a gateway starting is asked
STATUS_TIMEOUT_S = 5.0  # `tandem status`'s default --timeout, and each look of `scale --wait`
FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
    pb.FINISH_REASON_TOOL_CALLS: "tool_calls",
}


def key_metadata(key: str | None = None) -> tuple:
    """gRPC metadata carrying an API key: `key`, else TANDEM_API_KEY's (none when neither is
    set). The key comes from the environment, never a flag: flags show in `ps`."""
    key = os.environ.get("TANDEM_API_KEY", "") if key is None else key
    return (("authorization", f"Bearer {key}"),) if key else ()


def stream_generate(
    address: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    chat: bool = True,
    out=sys.stdout,
    timeout: float | None = None,
    metadata: tuple = (),
) -> pb.GenerateResponse:
    """Streams the answer to `out` as it arrives; returns the last chunk (usage and timing)."""
    request = pb.GenerateRequest(
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=temperature)
    )
    if chat:
        request.messages.add(role="user", content=prompt)
    else:
        request.prompt = prompt
    last = None
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TandemStub(channel)
        for chunk in stub.Generate(request, timeout=timeout, metadata=metadata):
            out.write(chunk.text)
            out.flush()
            last = chunk
    out.write("\n")
    return last


def summary(last: pb.GenerateResponse) -> str:
    t = last.timing
    return (
        f"[{FINISH_NAMES.get(last.finish_reason, '?')}: {last.usage.prompt_tokens} prompt + "
        f"{last.usage.completion_tokens} generated tokens; ttft {t.ttft_ms:.0f} ms, total {t.total_ms:.0f} ms, "
        f"prefill {t.prefill_ms:.0f} ms on {t.prefill_worker}, KV transfer {t.kv_transfer_ms:.1f} ms, "
        f"decode on {t.decode_worker}]"
    )


def wait_until_serving(
    address: str, group: ProcessGroup, timeout: float, workers: int = 0, metadata=()
) -> None:
    """Until the gateway is SERVING and, when `workers` is given, that many workers have joined
    (in auto mode the gateway serves once a decode worker is up; a prefill worker may still load).
    `metadata`: an API key's, when the gateway requires one."""
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health, api = health_pb2_grpc.HealthStub(channel), pb_grpc.TandemStub(channel)
        while time.monotonic() < deadline:
            if group.dead():
                name, code = group.dead()[0]
                raise RuntimeError(f"{name} exited with code {code}:\n{group.log_tail(name)}")
            try:
                reply = health.Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=ASK_TIMEOUT_S
                )
                if reply.status == health_pb2.HealthCheckResponse.SERVING and (
                    not workers
                    or len(
                        api.ClusterStatus(
                            pb.ClusterStatusRequest(), timeout=ASK_TIMEOUT_S, metadata=metadata
                        ).workers
                    )
                    >= workers
                ):
                    return
            except grpc.RpcError:
                pass
            time.sleep(POLL_S)
    raise TimeoutError(f"the gateway did not report SERVING within {timeout:.0f}s")


def generate_command(args) -> int:
    try:
        last = stream_generate(
            args.address,
            args.prompt,
            args.max_tokens,
            args.temperature,
            chat=not args.raw,
            metadata=key_metadata(),
        )
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(summary(last), file=sys.stderr)
    return 0


HEADER = "WORKER ROLE HOST ZONE PID RUNNING QUEUED KV_BLOCKS LEAKED QUARANTINED SERVED KV_SENT "
HEADER += "KV_RECEIVED "
HEADER += "KV_FAILED KV_TRANSPORT"


def _row(w: pb.WorkerStatus) -> tuple[str, ...]:
    return (
        w.id,
        w.role,
        w.host,
        w.zone or "-",
        str(w.pid),
        str(w.running),
        str(w.queued),
        f"{w.kv_blocks_used}/{w.kv_blocks_total}",
        str(w.kv_blocks_leaked),
        str(w.kv_blocks_quarantined),
        str(w.requests_served),
        _bytes(w.kv_bytes_sent),
        _bytes(w.kv_bytes_received),
        str(w.kv_transfers_failed),
        w.kv_transport or "-",
    )


def status_table(response: pb.ClusterStatusResponse) -> str:
    rows = [tuple(h.replace("_", " ") for h in HEADER.split())]
    rows += [_row(w) for w in response.workers]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = [
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows
    ]
    workers = response.workers
    return (
        f"mode: {response.mode}\n" + "\n".join(lines) + _kernel_lines(workers) + _tp_lines(workers)
    )


def _kernel_lines(workers) -> str:
    """Per worker, the model it serves and the kernels its engine runs (too wide for columns)."""
    width = max((len(w.id) for w in workers), default=0)
    out = ""
    models, kernels = [w.model for w in workers], [w.kernels for w in workers]
    for title, values in (("models", models), ("kernels", kernels)):
        if any(values):
            out += f"\n\n{title}:\n" + "\n".join(
                f"  {w.id.ljust(width)}  {value or '-'}" for w, value in zip(workers, values)
            )
    return out


def _tp_lines(workers) -> str:
    """Per tensor-parallel worker (more than one rank): its degree and each rank's heads."""
    width = max((len(w.id) for w in workers), default=0)
    lines = [
        f"  {w.id.ljust(width)}  tp {w.tp}: " + "; ".join(w.tp_ranks) for w in workers if w.tp > 1
    ]
    return "\n\ntensor parallel:\n" + "\n".join(lines) if lines else ""


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def status_command(args) -> int:
    try:
        with grpc.insecure_channel(args.address) as channel:
            response = pb_grpc.TandemStub(channel).ClusterStatus(
                pb.ClusterStatusRequest(), timeout=args.timeout, metadata=key_metadata()
            )
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(status_table(response))
    return 0
