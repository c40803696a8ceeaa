"""The control plane's own cost, against NVIDIA Dynamo's, on mock engines (issue 19).

    python bench/control_plane.py [--sections ttft,messages,fleet]   (make bench-control-plane)

ttft      TTFT, ITL, tokens/s and each process's CPU per streamed token with a zero-time mock
          engine (--mock-speedup 0, no KV bytes), colocated and disaggregated, at concurrency 1,
          8, 32 and 128: Tandem through its OpenAI-compatible HTTP front (a fresh connection per
          request, and keep-alive) and through gRPC; Dynamo 1.6.1's frontend + mocker (speedup
          1e6, --kv-transfer-bandwidth 0) through the same HTTP client, in the same run, one
          after the other, --rounds times (which goes first alternates; the report takes each
          cell's median over the rounds and shows the spread). Tokens are those the responses'
          usage reports; CPU is each server process's user + system time over the level's run
          (/proc), and the client's (this process, getrusage).
messages  NATS messages per generated token at 64 concurrent streams on one worker (the
          mock at the real engine's pace, --mock-speedup 1): nats-server's in_msgs over the run
          (every message: submits, assignments, acks, heartbeats, token batches).
fleet     1,000 mock workers (4 processes x 250, --mock-workers) on one scheduler: the
          scheduler's CPU share while they heartbeat, ClusterStatus size and time, placement
          (the scheduler's routing time, and TTFT through the gateway) at concurrency 1 and 8.

Writes bench/results/control-plane.{json,md}. Dynamo runs where .venv-dynamo exists.
"""

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from cp_scale import grpc_run, section_fleet, section_gateway  # noqa: E402
from dynamo_peer import DynamoStack, available, cpu_seconds, dynamo_version  # noqa: E402
from stack import LOAD_GENERATOR, BenchStack, Worker  # noqa: E402
from stream_clients import GrpcClient, HttpClient, run  # noqa: E402

from shared import model_store  # noqa: E402

OUT = ROOT / "bench" / "results"
LEVELS = (1, 8, 32, 128)
ZERO_TIME = {
    "TANDEM_ENGINE": "mock",
    "TANDEM_MOCK_SPEEDUP": "0",
    "TANDEM_MOCK_KV_BYTES_PER_TOKEN": "0",
}
QUIET = {"TANDEM_LOG_LEVEL": "WARNING"}


def tandem_stack(name: str, mode: str, mock: dict, workers: list[Worker] | None = None, **kw):
    if workers is None:
        roles = ["colocated"] if mode == "colocated" else ["prefill", "decode"]
        workers = [Worker(role) for role in roles]
    return BenchStack(
        name, mode, workers, common_env={**mock, **QUIET}, gateway_env=LOAD_GENERATOR, **kw
    )


async def tandem_levels(
    stack: BenchStack, model: str, n: int, max_tokens: int, pids: dict[str, int]
) -> list[dict]:
    rows = []
    fronts = [("http-fresh", True), ("http-keepalive", False), ("grpc", None)]
    for front, fresh in fronts:
        for level in LEVELS:
            if fresh is None:
                client = GrpcClient(stack.address)
            else:
                client = HttpClient(f"http://127.0.0.1:{stack.http_port}", model, fresh)
            async with client:
                row = await cpu_counted(run(client, n, level, max_tokens), pids)
            rows.append({"system": "tandem", "front": front, **row})
    return rows


async def dynamo_levels(
    base_url: str, model: str, n: int, max_tokens: int, pids: dict[str, int]
) -> list[dict]:
    rows = []
    for front, fresh in (("http-fresh", True), ("http-keepalive", False)):
        for level in LEVELS:
            async with HttpClient(base_url, model, fresh) as client:
                row = await cpu_counted(run(client, n, level, max_tokens), pids)
            rows.append({"system": f"dynamo {dynamo_version()}", "front": front, **row})
    return rows


async def cpu_counted(running, pids: dict[str, int]) -> dict:
    """The run's row with `cpu_us_per_token`: each process's CPU microseconds per token the
    responses' usage reported (the client: this process)."""
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    client_before = _own_cpu_s()
    row = await running
    client_s = _own_cpu_s() - client_before
    tokens = max(row["tokens_per_request"] * row["n"], 1)
    used = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    row["cpu_us_per_token"] = {name: s / tokens * 1e6 for name, s in used.items()}
    row["cpu_us_per_token"]["client"] = client_s / tokens * 1e6
    return row


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def section_ttft(args, model_dir: Path) -> list[dict]:
    """Every level, front and path, `--rounds` times: Tandem and Dynamo one after the other in
    each round, which goes first alternating (the machine's speed drifts within a run; a cell's
    median over rounds is the figure, its spread is reported)."""
    rows = []
    for round_ in range(args.rounds):
        for mode in ("colocated", "disaggregated"):
            path = "aggregated" if mode == "colocated" else "disaggregated"
            systems = (
                [_tandem_rows, _dynamo_rows] if round_ % 2 == 0 else [_dynamo_rows, _tandem_rows]
            )
            for measure in systems:
                found = measure(mode, args, model_dir)
                rows += [{"path": path, "round": round_, **row} for row in found]
            print(json.dumps(rows[-1]), flush=True)
    return rows


def _tandem_rows(mode: str, args, model_dir: Path) -> list[dict]:
    with tandem_stack(f"cp-{mode}", mode, ZERO_TIME) as stack:
        model = _served_model(stack.http_port)
        pids = {name: p.pid for name, p in stack.group.children}
        return asyncio.run(tandem_levels(stack, model, args.n, args.max_tokens, pids))


def _dynamo_rows(mode: str, args, model_dir: Path) -> list[dict]:
    if not available():
        return []
    with DynamoStack(model_dir, mode != "colocated") as dynamo:
        levels = dynamo_levels(
            dynamo.base_url, dynamo.model, args.n, args.max_tokens, dynamo.pids()
        )
        return asyncio.run(levels)


def section_messages(args) -> dict:
    paced = {"TANDEM_ENGINE": "mock", "TANDEM_MOCK_SPEEDUP": "1"}
    streams, max_tokens = 64, 256
    with tandem_stack("cp-messages", "colocated", paced) as stack:
        before = stack.varz()["in_msgs"]
        started = time.perf_counter()
        result = asyncio.run(grpc_run(stack.address, 2 * streams, streams, max_tokens))
        after = stack.varz()["in_msgs"]
        wall = time.perf_counter() - started
    tokens = result["tokens_per_request"] * result["n"]
    return {
        "streams_per_worker": streams,
        "requests": result["n"],
        "max_tokens": max_tokens,
        "tokens": tokens,
        "nats_messages": after - before,
        "messages_per_token": (after - before) / tokens,
        "seconds": wall,
        "itl_ms_p50": result["itl_ms_p50"],
        "itl_ms_p99": result["itl_ms_p99"],
    }


def _served_model(http_port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/v1/models", timeout=5) as r:
        return json.load(r)["data"][0]["id"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="ttft,messages,fleet,gateway")
    parser.add_argument("-n", type=int, default=200, help="requests per level")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="ttft: Tandem and Dynamo rounds")
    parser.add_argument("--fleet-size", type=int, default=1000)
    parser.add_argument("--gateway-levels", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--gateway-tokens", type=int, default=200)
    args = parser.parse_args()
    model_dir = model_store.prepare("", os.path.expanduser("~/.cache/tandem/models"))
    results = {"machine": {"cores": os.cpu_count()}, "args": vars(args)}
    sections = args.sections.split(",")
    if "ttft" in sections:
        results["ttft"] = section_ttft(args, model_dir)
    if "messages" in sections:
        results["messages"] = section_messages(args)
    if "fleet" in sections:
        results["fleet"] = section_fleet(args)
    if "gateway" in sections:
        results["gateway"] = section_gateway(args)
    OUT.mkdir(parents=True, exist_ok=True)
    name = "control-plane" if len(sections) == 4 else "control-plane-" + "-".join(sections)
    (OUT / f"{name}.json").write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
