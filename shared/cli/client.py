"""`tandem generate` and `tandem status`: small gRPC clients of the gateway."""

import sys

import grpc

from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc

STATUS_TIMEOUT_S = 5.0  # `tandem status`'s default --timeout, and each look of `scale --wait`
FINISH_NAMES = {
    pb.FINISH_REASON_STOP: "stop",
    pb.FINISH_REASON_LENGTH: "length",
    pb.FINISH_REASON_CANCELLED: "cancelled",
}


def stream_generate(
    address: str,
    prompt: str,
    max_tokens: int,
    temperature: float,
    chat: bool = True,
    out=sys.stdout,
    timeout: float | None = None,
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
        for chunk in pb_grpc.TandemStub(channel).Generate(request, timeout=timeout):
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


def generate_command(args) -> int:
    try:
        last = stream_generate(
            args.address, args.prompt, args.max_tokens, args.temperature, chat=not args.raw
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
    return f"mode: {response.mode}\n" + "\n".join(lines) + _kernel_lines(response.workers)


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
                pb.ClusterStatusRequest(), timeout=args.timeout
            )
    except grpc.RpcError as err:
        print(f"error: {err.code().name}: {err.details()}", file=sys.stderr)
        return 1
    print(status_table(response))
    return 0
