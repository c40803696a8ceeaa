"""Overload (`make bench-overload`): at twice the sustainable rate, is overload refused, not queued?

One stack (auto mode; a prefill worker pinned to core 0, a decode worker to core 1, 1 thread
each), short prompts (32-96 tokens) and 64 output tokens:
  1. capacity: a closed loop of `--capacity-concurrency` streams for `--phase-s`: the completed
     requests per second it sustains, X;
  2. sustainable: Poisson arrivals at `--load` x X;
  3. overload: Poisson arrivals at twice that.
Reports, for 2 and 3, the E2E and TTFT percentiles of the admitted (completed) requests and how
many were refused (RESOURCE_EXHAUSTED, with their retry-after hints). The bar: p99 E2E at 2x
within 2x of its value at the sustainable rate. Writes bench/results/overload.{md,json}.
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


def specs(tokenizer, tag: str, count: int, seed: int) -> list:
    return list(request_specs(Workload(Uniform(32, 96), Fixed(64), tag=tag, seed=seed), tokenizer, count))


async def study(tokenizer, args) -> dict:
    workers = [Worker("prefill", "0", 1), Worker("decode", "1", 1)]
    out = {}
    with BenchStack("overload", "auto", workers) as stack:
        await run_workload(stack.address, specs(tokenizer, "warm", 8, 9), concurrency=8)
        closed = await run_workload(stack.address, specs(tokenizer, "capacity", 5000, 1),
                                    concurrency=args.capacity_concurrency, duration_s=args.phase_s, timeout_s=600)
        capacity = summarize(closed).request_throughput
        out["capacity"] = {"requests_per_s": capacity, "summary": summarize(closed).to_dict()}
        print(f"capacity: {capacity:.2f} requests/s", flush=True)
        for name, rate in (("sustainable", args.load * capacity), ("2x", 2 * args.load * capacity)):
            records = await run_workload(stack.address, specs(tokenizer, name, int(rate * args.phase_s * 2) + 10, 2),
                                         arrivals=poisson_arrivals(rate, 2), duration_s=args.phase_s, timeout_s=600)
            s = summarize(records)
            hints = [r.retry_after_ms for r in records if r.retry_after_ms]
            out[name] = {"rate": rate, "summary": s.to_dict(), "statuses": dict(Counter(r.status for r in records)),
                         "retry_after_ms": {"min": min(hints), "max": max(hints)} if hints else {}}
            print(f"{name}: rate {rate:.2f}/s, {s.completed} done, {s.failed} refused/failed, "
                  f"E2E p99 {s.e2e_ms.p99 or float('nan'):.0f} ms", flush=True)
    return out


def report(out: dict, args) -> None:
    base, over = out["sustainable"]["summary"], out["2x"]["summary"]
    if not (base["completed"] and over["completed"]):
        raise SystemExit(f"nothing completed: {out}")
    ratio = over["e2e_ms"]["p99"] / base["e2e_ms"]["p99"]
    lines = ["# Overload: refused, not queued without end", "",
             f"Command: `python bench/overload.py --phase-s {args.phase_s:.0f} --load {args.load}` "
             "(`make bench-overload`); one run, 2 cores.", "",
             f"Capacity (closed loop of {args.capacity_concurrency}): {out['capacity']['requests_per_s']:.2f} "
             "completed requests/s.", "",
             "| load | rate req/s | sent | completed | refused or failed | E2E p50 / p99 ms | TTFT p50 / p99 ms | retry-after hints ms |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name in ("sustainable", "2x"):
        s, hints = out[name]["summary"], out[name]["retry_after_ms"]
        lines.append(f"| {name} | {out[name]['rate']:.2f} | {s['requests']} | {s['completed']} | "
                     f"{s['failed']} {s['failures'] or ''} | {s['e2e_ms']['median']:.0f} / {s['e2e_ms']['p99']:.0f} | "
                     f"{s['ttft_ms']['median']:.0f} / {s['ttft_ms']['p99']:.0f} | "
                     + (f"{hints['min']}-{hints['max']}" if hints else "-") + " |")
    lines += ["", f"p99 E2E of admitted requests at 2x / at the sustainable rate: {ratio:.2f}x "
              f"(bar <= 2x: {'met' if ratio <= 2 else 'NOT met'})."]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "overload.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "overload.json").write_text(json.dumps({"args": vars(args), **out}, indent=1, default=str))
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=90.0)
    parser.add_argument("--load", type=float, default=0.8, help="the sustainable rate as a share of capacity")
    parser.add_argument("--capacity-concurrency", type=int, default=64)
    args = parser.parse_args()
    tokenizer = model_store.load_tokenizer(model_store.prepare("", "~/.cache/tandem/models"))
    report(asyncio.run(study(tokenizer, args)), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
