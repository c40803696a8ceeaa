"""The control-plane bench's scale sections (see control_plane.py): a fleet of 1,000 mock
workers on one scheduler, and one gateway's stream capacity."""

import asyncio
import json
import os
import tempfile
import time
from pathlib import Path

from dynamo_peer import cpu_seconds
from stack import LOAD_GENERATOR, BenchStack, Worker
from stream_clients import GrpcClient, pct

from shared.api import tandem_pb2 as pb
from shared.api import tandem_pb2_grpc as pb_grpc
from shared.engine.timing_model import FEATURES, TimingModel

QUIET = {"TANDEM_LOG_LEVEL": "WARNING"}


def section_fleet(args) -> dict:
    per, processes = args.fleet_size // 4, 4
    fleet_env = {
        "TANDEM_ENGINE": "mock",
        "TANDEM_MOCK_SPEEDUP": "0",
        "TANDEM_MOCK_KV_BYTES_PER_TOKEN": "0",
        "TANDEM_MOCK_WORKERS": str(per),
        "TANDEM_KV_CACHE_MB": "64",
    }
    workers = [Worker("colocated", env=fleet_env) for _ in range(processes)]
    metrics = {"TANDEM_METRICS_PORT": str(_port())}
    stack = BenchStack(
        "cp-fleet",
        "colocated",
        workers,
        scheduler_env=metrics,
        common_env=QUIET,
        gateway_env=LOAD_GENERATOR,
        expect_workers=per * processes,
    )
    with stack:
        scheduler = stack.pid("scheduler")
        time.sleep(5)  # every worker heard at least once more
        used, window = cpu_seconds(scheduler), 20.0
        time.sleep(window)
        share = (cpu_seconds(scheduler) - used) / window
        status = _cluster_status(stack.address)
        placement = {
            level: asyncio.run(grpc_run(stack.address, args.n, level, 8)) for level in (1, 8)
        }
        routing = _routing_quantiles(int(metrics["TANDEM_METRICS_PORT"]))
    return {
        "workers": per * processes,
        "processes": processes,
        "heartbeat_interval_s": 0.5,
        "scheduler_cpu_share_idle": share,
        "cluster_status": status,
        "placement": placement,
        "routing": routing,
    }


async def grpc_run(address: str, n: int, concurrency: int, max_tokens: int) -> dict:
    from stream_clients import run

    async with GrpcClient(address) as client:
        return await run(client, n, concurrency, max_tokens, warmup=0)


def section_gateway(args) -> list[dict]:
    """One gateway, more and more concurrent streams: each a long greedy request on mock
    workers whose every step takes STEP_S (a timing model of that base alone), so a token's gap
    at the client is STEP_S plus what the control plane adds (and the client, and the mock
    workers' own jitter: everything shares the same cores). What the gateway itself adds is its
    tandem_gateway_token_wait_seconds histogram (a chunk's arrival to its answer going out). Ends
    once that passes 5 ms p99 (or at the last level)."""
    timing = Path(tempfile.mkdtemp()) / "fixed-step.json"
    TimingModel({**dict.fromkeys(FEATURES, 0.0), "base": STEP_S}, f"{STEP_S}s per step").save(
        timing
    )
    processes, per = 4, 8
    env = {
        "TANDEM_ENGINE": "mock",
        "TANDEM_MOCK_TIMING": str(timing),
        "TANDEM_MOCK_KV_BYTES_PER_TOKEN": "0",
        "TANDEM_MOCK_WORKERS": str(per),
        "TANDEM_MAX_NUM_SEQS": "64",
        "TANDEM_KV_CACHE_MB": "4096",
    }
    workers = [Worker("colocated", env=env) for _ in range(processes)]
    port = _port()
    # the gateway on a core of its own; NATS, the scheduler, the workers and this client (they
    # inherit this process's cores) on the others: what it adds is its own, not their jitter
    every = sorted(os.sched_getaffinity(0))
    gateway_core, others = every[0], set(every[1:]) or set(every)
    stack = BenchStack(
        "cp-gateway",
        "colocated",
        workers,
        common_env=QUIET,
        gateway_env={**LOAD_GENERATOR, "TANDEM_METRICS_PORT": str(port)},
        expect_workers=processes * per,
        gateway_cores=str(gateway_core),
    )
    rows = []
    os.sched_setaffinity(0, others)
    try:
        rows = _gateway_levels(args, stack, port)
    finally:
        os.sched_setaffinity(0, every)
    for row in rows:
        row["gateway_core"], row["other_cores"] = gateway_core, sorted(others)
    return rows


def _gateway_levels(args, stack: BenchStack, port: int) -> list[dict]:
    rows = []
    with stack:
        gateway = stack.pid("gateway")
        wait = "tandem_gateway_token_wait_seconds"
        for streams in args.gateway_levels:
            used, started = cpu_seconds(gateway), time.perf_counter()
            before = _buckets(port, wait)
            row = asyncio.run(_streams(stack.address, streams, args.gateway_tokens))
            wall = time.perf_counter() - started
            row["gateway_wait"] = _quantiles(_buckets(port, wait), before)
            row["gateway_cores"] = (cpu_seconds(gateway) - used) / wall
            row["tokens_per_gateway_core"] = row["tokens_per_s"] / max(row["gateway_cores"], 1e-9)
            row["gateway_cpu_us_per_token"] = 1e6 / row["tokens_per_gateway_core"]
            row["step_s"] = STEP_S
            rows.append(row)
            print(json.dumps(row), flush=True)
            if row["gateway_wait"]["p99_at_most_ms"] > 5:
                break
    return rows


STEP_S = 0.01  # issue 49: one gateway at 64 streams paced at 10 ms a step


async def _streams(address: str, streams: int, max_tokens: int) -> dict:
    """`streams` requests at once, each of max_tokens tokens; ITL past the first 8 tokens of
    each (all streams running by then)."""
    async with GrpcClient(address) as client:
        started = time.perf_counter()
        done = await asyncio.gather(*(client.one(i, max_tokens) for i in range(streams)))
        wall = time.perf_counter() - started
    gaps = [(b - a) * 1e3 for t in done for a, b in zip(t.times[8:], t.times[9:])]
    tokens = sum(t.tokens for t in done)
    return {
        "streams": streams,
        "answered": sum(1 for t in done if t.tokens == max_tokens),
        "tokens_per_s": tokens / wall,
        "itl_ms_p50": pct(gaps, 50),
        "itl_ms_p99": pct(gaps, 99),
        "added_itl_ms_p50": pct(gaps, 50) - STEP_S * 1e3,
        "added_itl_ms_p99": pct(gaps, 99) - STEP_S * 1e3,
    }


def _port() -> int:
    from shared.cli.processes import free_port

    return free_port()


def _cluster_status(address: str) -> dict:
    import grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.TandemStub(channel)
        times, reply = [], None
        for _ in range(5):
            started = time.perf_counter()
            reply = stub.ClusterStatus(pb.ClusterStatusRequest(), timeout=30)
            times.append(time.perf_counter() - started)
    times.sort()
    return {"workers": len(reply.workers), "bytes": reply.ByteSize(), "ms_median": times[2] * 1e3}


def _buckets(port: int, name: str) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets (upper bound, count) from a service's /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    buckets = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket"):
            bound = line.split('le="')[1].split('"')[0]
            buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
    return buckets


def _quantiles(buckets: list[tuple[float, float]], before=()) -> dict:
    """p50 and p99 as bucket bounds (they lie below them), of what was counted since `before`."""
    old = dict(before)
    counts = [(b, c - old.get(b, 0.0)) for b, c in buckets]
    total = counts[-1][1] if counts else 0
    bound = lambda q: next((b for b, c in counts if c >= q * total), float("inf"))  # noqa: E731
    return {"count": total, "p50_at_most_ms": bound(0.5) * 1e3, "p99_at_most_ms": bound(0.99) * 1e3}


def _routing_quantiles(port: int) -> dict:
    """The scheduler's routing time histogram, as bucket bounds (p50 and p99 lie below them)."""
    return _quantiles(_buckets(port, "tandem_scheduler_routing_seconds"))
