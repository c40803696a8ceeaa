"""Overload (`make bench-overload`): at twice the sustainable rate, is overload refused, not queued?

Short prompts (32-96 tokens) and 64 output tokens, on a prefill worker pinned to core 0 and a
decode worker pinned to core 1 (auto mode, 1 thread each). Two stacks, started one after the other:
  1. calibration (no latency target): a closed loop of `--capacity-concurrency` streams for
     `--phase-s` gives the completed requests per second it sustains, X; Poisson arrivals at
     `--load` x X give the median inter-token latency there, and the ITL target is
     `--itl-slack` x that (the operator's ITL SLO, set the way the prefill-tax study sets its SLOs);
  2. under test (the scheduler's `--max-itl-ms` at that target): Poisson arrivals at `--load` x X
     (sustainable), then at twice that (overload).
Reports, for both phases under test, the E2E and TTFT percentiles of the admitted (completed)
requests and how many were refused (RESOURCE_EXHAUSTED, with their retry-after hints). The bar:
p99 E2E at 2x within 2x of its value at the sustainable rate. Writes bench/results/overload.{md,json}.
"""

import argparse
import asyncio
import json
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stack import BenchStack, Worker  # noqa: E402
from shared import model_store  # noqa: E402
from shared.benchmark.lengths import Fixed, Uniform  # noqa: E402
from shared.benchmark.metrics import summarize  # noqa: E402
from shared.benchmark.runner import run_workload  # noqa: E402
from shared.benchmark.workload import Workload, poisson_arrivals, request_specs  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


WORKERS = [Worker("prefill", "0", 1), Worker("decode", "1", 1)]


def specs(tokenizer, tag: str, count: int, seed: int) -> list:
    return list(
        request_specs(Workload(Uniform(32, 96), Fixed(64), tag=tag, seed=seed), tokenizer, count)
    )


async def poisson_phase(address: str, tokenizer, name: str, rate: float, phase_s: float) -> dict:
    records = await run_workload(
        address,
        specs(tokenizer, name, int(rate * phase_s * 2) + 10, 2),
        arrivals=poisson_arrivals(rate, 2),
        duration_s=phase_s,
        timeout_s=600,
    )
    s = summarize(records)
    hints = [r.retry_after_ms for r in records if r.retry_after_ms]
    print(
        f"{name}: rate {rate:.2f}/s, {s.completed} done, {s.failed} refused/failed, "
        f"E2E p99 {s.e2e_ms.p99 or float('nan'):.0f} ms, ITL p50 {s.itl_ms.median or float('nan'):.0f} ms",
        flush=True,
    )
    return {
        "rate": rate,
        "summary": s.to_dict(),
        "statuses": dict(Counter(r.status for r in records)),
        "retry_after_ms": {"min": min(hints), "max": max(hints)} if hints else {},
    }


async def calibrate(tokenizer, args) -> dict:
    with BenchStack("overload-calibration", "auto", WORKERS) as stack:
        await run_workload(stack.address, specs(tokenizer, "warm", 8, 9), concurrency=8)
        closed = await run_workload(
            stack.address,
            specs(tokenizer, "capacity", 5000, 1),
            concurrency=args.capacity_concurrency,
            duration_s=args.phase_s,
            timeout_s=600,
        )
        capacity = summarize(closed).request_throughput
        print(f"capacity: {capacity:.2f} requests/s", flush=True)
        base = await poisson_phase(
            stack.address, tokenizer, "calibration", args.load * capacity, args.phase_s
        )
    target = args.itl_slack * base["summary"]["itl_ms"]["median"]
    return {
        "capacity": {"requests_per_s": capacity, "summary": summarize(closed).to_dict()},
        "calibration": base,
        "max_itl_ms": round(target, 1),
    }


async def study(tokenizer, args) -> dict:
    out = await calibrate(tokenizer, args)
    rate = args.load * out["capacity"]["requests_per_s"]
    with BenchStack(
        "overload", "auto", WORKERS, scheduler_env={"TANDEM_MAX_ITL_MS": str(out["max_itl_ms"])}
    ) as stack:
        await run_workload(stack.address, specs(tokenizer, "warm", 8, 9), concurrency=8)
        for name, r in (("sustainable", rate), ("2x", 2 * rate)):
            out[name] = await poisson_phase(stack.address, tokenizer, name, r, args.phase_s)
    return out


def report(out: dict, args) -> None:
    base, over = out["sustainable"]["summary"], out["2x"]["summary"]
    if not (base["completed"] and over["completed"]):
        raise SystemExit(f"nothing completed: {out}")
    ratio = over["e2e_ms"]["p99"] / base["e2e_ms"]["p99"]
    lines = [
        "# Overload: refused, not queued without end",
        "",
        f"Command: `python bench/overload.py --phase-s {args.phase_s:.0f} --load {args.load} "
        f"--itl-slack {args.itl_slack}` (`make bench-overload`); one run, 2 cores.",
        "",
        f"Calibration stack: capacity (closed loop of {args.capacity_concurrency}) "
        f"{out['capacity']['requests_per_s']:.2f} completed requests/s; at {args.load} x that, ITL p50 "
        f"{out['calibration']['summary']['itl_ms']['median']:.0f} ms and E2E p99 "
        f"{out['calibration']['summary']['e2e_ms']['p99']:.0f} ms with no latency target.",
        "",
        f"Stack under test: scheduler `--max-itl-ms {out['max_itl_ms']}` ({args.itl_slack} x that ITL p50).",
        "",
        "| load | rate req/s | sent | completed | refused or failed | E2E p50 / p99 ms | TTFT p50 / p99 ms | ITL p50 / p99 ms | retry-after hints ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("sustainable", "2x"):
        s, hints = out[name]["summary"], out[name]["retry_after_ms"]
        lines.append(
            f"| {name} | {out[name]['rate']:.2f} | {s['requests']} | {s['completed']} | "
            f"{s['failed']} {s['failures'] or ''} | {s['e2e_ms']['median']:.0f} / {s['e2e_ms']['p99']:.0f} | "
            f"{s['ttft_ms']['median']:.0f} / {s['ttft_ms']['p99']:.0f} | "
            f"{s['itl_ms']['median']:.0f} / {s['itl_ms']['p99']:.0f} | "
            + (f"{hints['min']}-{hints['max']}" if hints else "-")
            + " |"
        )
    lines += [
        "",
        f"p99 E2E of admitted requests at 2x / at the sustainable rate: {ratio:.2f}x "
        f"(bar <= 2x: {'met' if ratio <= 2 else 'NOT met'}).",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "overload.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "overload.json").write_text(
        json.dumps({"args": vars(args), **out}, indent=1, default=str)
    )
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=90.0)
    parser.add_argument(
        "--load", type=float, default=0.8, help="the sustainable rate as a share of capacity"
    )
    parser.add_argument("--capacity-concurrency", type=int, default=64)
    parser.add_argument(
        "--itl-slack",
        type=float,
        default=1.5,
        help="the ITL target as a multiple of the calibration ITL p50",
    )
    args = parser.parse_args()
    tokenizer = model_store.load_tokenizer(model_store.prepare("", "~/.cache/tandem/models"))
    report(asyncio.run(study(tokenizer, args)), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
