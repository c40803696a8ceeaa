"""What the control plane cannot go below on this machine, measured without Tandem (issue 19).

    python bench/cp_floor.py   ->  bench/results/control-plane-floor.{json,md}

nats      a bare nats-py request/reply round trip between two processes through nats-server
          (two hops, an echo, no work): every NATS hop of a request costs at least half of it.
grpc      grpc.aio's server takes its calls one at a time (one request_call outstanding, each
          completed through its poller thread and two turns of the event loop): the delay from
          a client's call to the server's handler, 32 calls at a time on one channel, while the
          server's event loop is busy with other work (32 tasks, each spinning `load` us every
          4 ms) to a given share.
"""

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import grpc
import nats

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.cli.processes import free_port, nats_server_binary  # noqa: E402

OUT = ROOT / "bench" / "results"
LOADS_US = (0, 25, 50, 75, 100)  # per task per 4 ms: up to ~80% of the loop


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p / 100 * len(ordered)))]


# -- NATS ---------------------------------------------------------------------------------------


async def echo(url: str) -> None:
    nc = await nats.connect(url)

    async def answer(msg) -> None:
        await msg.respond(msg.data)

    await nc.subscribe("floor.echo", cb=answer)
    await asyncio.Event().wait()


async def nats_rtt(url: str, n: int) -> dict:
    nc = await nats.connect(url)
    times = []
    for i in range(n + 100):
        started = time.perf_counter()
        await nc.request("floor.echo", b"x" * 200, timeout=5)
        if i >= 100:  # warmed up
            times.append((time.perf_counter() - started) * 1e3)
    await nc.close()
    return {"n": n, "rtt_ms_p50": pct(times, 50), "rtt_ms_p90": pct(times, 90)}


def section_nats(n: int) -> dict:
    port = free_port()
    server = subprocess.Popen(
        [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL
    )
    url = f"nats://127.0.0.1:{port}"
    time.sleep(0.5)
    responder = subprocess.Popen([sys.executable, __file__, "--echo", url])
    try:
        time.sleep(1.5)
        return asyncio.run(nats_rtt(url, n))
    finally:
        for proc in (responder, server):
            proc.terminate()
            proc.wait()


# -- gRPC ---------------------------------------------------------------------------------------


def spin(us: float) -> None:
    until = time.perf_counter() + us / 1e6
    while time.perf_counter() < until:
        pass


async def grpc_server(port: int, load_us: float) -> None:
    """Each call answers 16 messages (the handler's entry time, and the loop's busy share)."""
    busy = [0.0]
    began = time.perf_counter()

    async def task() -> None:
        while True:
            spin(load_us)
            busy[0] += load_us / 1e6
            await asyncio.sleep(0.004)

    async def handler(request, context):
        entered = time.monotonic()
        for _ in range(16):
            await asyncio.sleep(0.002)
            share = busy[0] / (time.perf_counter() - began)
            yield f"{entered} {share:.3f}".encode()

    load = [asyncio.create_task(task()) for _ in range(32)]
    method = grpc.unary_stream_rpc_method_handler(handler)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("floor.F", {"S": method}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()
    del load


async def grpc_delays(port: int, calls: int) -> dict:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await channel.channel_ready()
        method = channel.unary_stream("/floor.F/S")
        delays, shares = [], []

        async def one() -> None:
            started, first = time.monotonic(), True
            async for answer in method(b""):  # read to the end, as a streaming client does
                if first:
                    entered, share = answer.split()
                    delays.append((float(entered) - started) * 1e3)
                    shares.append(float(share))
                    first = False

        async def client() -> None:
            for _ in range(calls):
                await one()

        await asyncio.gather(*(client() for _ in range(32)))
    return {
        "loop_busy": round(pct(shares, 50), 2),
        "accept_ms_p50": pct(delays, 50),
        "accept_ms_p90": pct(delays, 90),
    }


def section_grpc(calls: int) -> list[dict]:
    rows = []
    for load_us in LOADS_US:
        port = free_port()
        server = subprocess.Popen([sys.executable, __file__, "--grpc", str(port), str(load_us)])
        try:
            time.sleep(2)
            rows.append({"load_us": load_us, **asyncio.run(grpc_delays(port, calls))})
        finally:
            server.terminate()
            server.wait()
    return rows


# -- report -------------------------------------------------------------------------------------


def report(found: dict) -> str:
    nats_row = found["nats"]
    lines = [
        "# What the control plane cannot go below here (no Tandem code involved)",
        "",
        "From `control-plane-floor.json` (`python bench/cp_floor.py`).",
        "",
        f"A bare nats-py request/reply through nats-server, two processes: round trip p50 "
        f"**{nats_row['rtt_ms_p50']:.2f} ms**, p90 {nats_row['rtt_ms_p90']:.2f} ms "
        f"({nats_row['n']} requests): one NATS hop costs about half of it.",
        "",
        "grpc.aio accepting 32 concurrent calls on one channel (each streaming 16 answers, read to "
        "the end) while other tasks keep its event loop busy:",
        "",
        "| other tasks' share of the loop (grpc's own work on top) | call -> handler p50 (ms) "
        "| p90 (ms) |",
        "|---|---|---|",
    ]
    for row in found["grpc"]:
        lines.append(
            f"| {row['loop_busy']:.2f} | {row['accept_ms_p50']:.1f} | {row['accept_ms_p90']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--echo", help=argparse.SUPPRESS)
    parser.add_argument("--grpc", nargs=2, help=argparse.SUPPRESS)
    parser.add_argument("-n", type=int, default=2000, help="NATS round trips")
    parser.add_argument("--calls", type=int, default=15, help="gRPC calls per client")
    args = parser.parse_args()
    if args.echo:
        return asyncio.run(echo(args.echo))
    if args.grpc:
        return asyncio.run(grpc_server(int(args.grpc[0]), float(args.grpc[1])))
    found = {"nats": section_nats(args.n), "grpc": section_grpc(args.calls)}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "control-plane-floor.json").write_text(json.dumps(found, indent=2) + "\n")
    (OUT / "control-plane-floor.md").write_text(report(found))
    print(report(found))


if __name__ == "__main__":
    main()
