"""What the OpenAI-compatible HTTP front costs against gRPC (`make bench-http`).

One stack (auto mode; a prefill worker pinned to core 0, a decode worker to core 1, one thread
each), the same workload through each API: 64-token prompts, 32 greedy output tokens, at
concurrency 1 and 32. The runs alternate (gRPC, HTTP, HTTP, gRPC, ...) so a drift of the shared
machine falls on both alike. Reported per API and concurrency: TTFT and ITL p50/p99 as the
client saw them; the front's share of the TTFT (the client's TTFT less the gateway's own, from
its arrival to the first token out: the request's way in and the token's way out, without the
engine's noise); and the gateway's CPU time per generated token (user + system, over the run,
idle work included). The goal: HTTP adds at most 1 ms to the p50 TTFT and 10% to the gateway's
CPU per token. Writes bench/results/http_cost.{md,json}.
"""

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stack import BenchStack, Worker  # noqa: E402
from shared import model_store  # noqa: E402
from shared.benchmark.lengths import Fixed  # noqa: E402
from shared.benchmark.metrics import summarize  # noqa: E402
from shared.benchmark.runner import run_workload  # noqa: E402
from shared.benchmark.workload import Workload, request_specs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
WORKERS = [Worker("prefill", "0", 1), Worker("decode", "1", 1)]
APIS = ("grpc", "openai")


def gateway_pid(stack: BenchStack) -> int:
    return next(p.pid for name, p in stack.group.children if name == "gateway")


async def one_run(stack, tokenizer, api: str, concurrency: int, count: int, seed: int) -> dict:
    specs = list(
        request_specs(Workload(Fixed(64), Fixed(32), tag=api, seed=seed), tokenizer, count)
    )
    gateway = psutil.Process(gateway_pid(stack))
    before = gateway.cpu_times()
    address = stack.address if api == "grpc" else f"http://127.0.0.1:{stack.http_port}"
    records = await run_workload(address, specs, concurrency=concurrency, timeout_s=600, api=api)
    after = gateway.cpu_times()
    s = summarize(records)
    cpu_s = (after.user - before.user) + (after.system - before.system)
    tokens = sum(r.completion_tokens for r in records if r.ok)
    # the front's share of the TTFT, free of the engine's noise: what the client saw less what
    # the gateway measured (its arrival, after the request was read, to the first token out)
    front = [
        (r.chunk_times[0] - r.sent_at) * 1000 - r.timing["ttft_ms"]
        for r in records
        if r.ok and r.chunk_times and r.timing.get("ttft_ms")
    ]
    return {
        "api": api,
        "concurrency": concurrency,
        "completed": s.completed,
        "failed": s.failed,
        "ttft_ms": {"p50": s.ttft_ms.median, "p99": s.ttft_ms.p99},
        "itl_ms": {"p50": s.itl_ms.median, "p99": s.itl_ms.p99},
        "gateway_cpu_us_per_token": cpu_s / max(1, tokens) * 1e6,
        "front_ms": {"p50": statistics.median(front) if front else None},
        "tokens": tokens,
    }


async def measure(stack, tokenizer, rounds: int, counts: dict[int, int]) -> list[dict]:
    runs = []
    for concurrency, count in counts.items():
        await one_run(stack, tokenizer, "grpc", concurrency, 8, 99)  # warm-up
        await one_run(stack, tokenizer, "openai", concurrency, 8, 99)
        for r in range(rounds):
            order = APIS if r % 2 == 0 else APIS[::-1]
            for api in order:
                run = await one_run(stack, tokenizer, api, concurrency, count, seed=r)
                print(json.dumps(run), flush=True)
                runs.append(run)
    return runs


def combine(runs: list[dict]) -> dict:
    """Per (api, concurrency): the median over rounds of each figure."""
    out = {}
    for key in sorted({(r["api"], r["concurrency"]) for r in runs}):
        mine = [r for r in runs if (r["api"], r["concurrency"]) == key]

        def med(path, mine=mine):
            values = [r[path[0]][path[1]] if len(path) == 2 else r[path[0]] for r in mine]
            return statistics.median(v for v in values if v is not None)

        out[f"{key[0]}@{key[1]}"] = {
            "ttft_p50_ms": med(("ttft_ms", "p50")),
            "ttft_p99_ms": med(("ttft_ms", "p99")),
            "itl_p50_ms": med(("itl_ms", "p50")),
            "itl_p99_ms": med(("itl_ms", "p99")),
            "gateway_cpu_us_per_token": med(("gateway_cpu_us_per_token",)),
            "front_p50_ms": med(("front_ms", "p50")),
            "failed": sum(r["failed"] for r in mine),
        }
    return out


def spread_of(runs: list[dict]) -> dict[int, float]:
    out = {}
    for c in {r["concurrency"] for r in runs}:
        p50s = [r["ttft_ms"]["p50"] for r in runs if r["concurrency"] == c]
        out[c] = max(p50s) - min(p50s)
    return out


def table(combined: dict, concurrencies, spread: dict) -> str:
    """`spread`: by concurrency, the range of the runs' p50 TTFTs (both APIs)."""
    lines = [
        "| concurrency | API | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | ITL p99 (ms) | front's share of TTFT, p50 (ms) | gateway CPU per token (µs) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    verdicts = []
    for c in concurrencies:
        g, h = combined[f"grpc@{c}"], combined[f"openai@{c}"]
        for api, row in (("gRPC", g), ("OpenAI HTTP", h)):
            lines.append(
                f"| {c} | {api} | {row['ttft_p50_ms']:.1f} | {row['ttft_p99_ms']:.1f} | "
                f"{row['itl_p50_ms']:.1f} | {row['itl_p99_ms']:.1f} | {row['front_p50_ms']:.2f} | "
                f"{row['gateway_cpu_us_per_token']:.0f} |"
            )
        added = h["front_p50_ms"] - g["front_p50_ms"]
        cpu = h["gateway_cpu_us_per_token"] / g["gateway_cpu_us_per_token"] - 1
        verdicts.append(
            f"- concurrency {c}: HTTP adds {added:+.2f} ms to the front's share of the p50 TTFT "
            f"(goal <= 1 ms: {'met' if added <= 1 else 'NOT met'}; the whole p50 TTFT moved "
            f"{h['ttft_p50_ms'] - g['ttft_p50_ms']:+.1f} ms, where the engine's time and its "
            f"run-to-run spread of {spread[c]:.0f} ms dominate) and "
            f"{cpu:+.0%} gateway CPU per token (goal <= 10%: {'met' if cpu <= 0.10 else 'NOT met'})"
        )
    return "\n".join(lines + [""] + verdicts) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4, help="runs per API and concurrency")
    parser.add_argument("--requests-1", type=int, default=24, help="requests per run at c=1")
    parser.add_argument("--requests-32", type=int, default=96, help="requests per run at c=32")
    args = parser.parse_args()
    counts = {1: args.requests_1, 32: args.requests_32}
    tokenizer = model_store.load_tokenizer(model_store.prepare("", "~/.cache/tandem/models"))
    with BenchStack("http-cost", "auto", WORKERS) as stack:
        runs = asyncio.run(measure(stack, tokenizer, args.rounds, counts))
    combined = combine(runs)
    RESULTS.mkdir(exist_ok=True)
    text = (
        "# The HTTP front's cost against gRPC\n\n`python bench/http_cost.py` (`make bench-http`): "
        f"{args.rounds} alternating runs per API and concurrency, medians shown.\n\n"
        + table(combined, counts, spread_of(runs))
    )
    (RESULTS / "http_cost.md").write_text(text)
    (RESULTS / "http_cost.json").write_text(
        json.dumps({"config": vars(args), "combined": combined, "runs": runs}, indent=2) + "\n"
    )
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
