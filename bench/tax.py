"""The prefill-tax study (`make bench-tax`): do long prompts stall everyone else's tokens?

One machine, the same model and the same cores for every setup:
  colocated      one colocated worker, 2 threads, on every core;
  disaggregated  a prefill worker pinned to core 0 and a decode worker pinned to core 1, 1 thread
                 each (two devices' stand-in), every prompt through the prefill worker;
  auto           the same two workers, conditional disaggregation (short prompts prefilled on the
                 decode worker, long ones on the prefill worker).
NATS, the scheduler, the gateway and this load generator float on both cores in every setup.

Workload: 8 steady streams (a closed loop of 8: prompts of 32-96 tokens, outputs of 1/2 to 3/2
of `--steady-output` tokens)
run for `--duration-s`; in the interference runs, long prompts (uniform 1,000-4,000 tokens,
`--long-output` tokens) arrive at the same time as a Poisson process at each `--rates` value.
Each setup first runs the steady streams alone (the no-interference run), then sends one
2,000-token prompt alone (its prefill speed).

SLOs (goodput): from the no-interference runs, the slowest setup's figures, so every setup can
meet them without interference: steady TTFT <= 3 x TTFT p90, every ITL of a request <= 1.5 x ITL
p99; a long prompt of L tokens: TTFT <= 3 x L x the slowest setup's alone prefill time per token.

Writes docs/prefill-tax.{md,json} and docs/prefill-tax-*.png.
"""

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.stack import BenchStack, Worker  # noqa: E402
from shared import model_store  # noqa: E402
from shared.benchmark.lengths import Fixed, Uniform  # noqa: E402
from shared.benchmark.metrics import request_metrics, summarize  # noqa: E402
from shared.benchmark.runner import run_workload  # noqa: E402
from shared.benchmark.workload import Workload, poisson_arrivals, request_specs  # noqa: E402

DOCS = Path(__file__).resolve().parent.parent / "docs"
SETUPS = {
    "colocated": ("colocated", [Worker("colocated", "", 2)]),
    "disaggregated": ("disaggregated", [Worker("prefill", "0", 1), Worker("decode", "1", 1)]),
    "auto": ("auto", [Worker("prefill", "0", 1), Worker("decode", "1", 1)]),
}
WORKER_ENV = {"TANDEM_MAX_MODEL_LEN": "8192"}


def specs(tokenizer, tag: str, prompt, output, count: int, seed: int) -> list:
    return list(request_specs(Workload(prompt, output, tag=tag, seed=seed), tokenizer, count))


async def one_run(address: str, tokenizer, args, rate: float, seed: int) -> list:
    # Output lengths vary around --steady-output, so the 8 streams do not finish (and send their
    # next prompts) in lockstep.
    out = Uniform(args.steady_output // 2, args.steady_output * 3 // 2)
    steady = specs(tokenizer, "steady", Uniform(32, 96), out, 4000, seed)
    runs = [run_workload(address, steady, concurrency=8, duration_s=args.duration_s, timeout_s=900)]
    if rate:
        long = specs(
            tokenizer,
            "long",
            Uniform(1000, 4000),
            Fixed(args.long_output),
            int(rate * args.duration_s * 3) + 5,
            seed,
        )
        runs.append(
            run_workload(
                address,
                long,
                arrivals=poisson_arrivals(rate, seed),
                duration_s=args.duration_s,
                timeout_s=900,
            )
        )
    return [r for records in await asyncio.gather(*runs) for r in records]


async def alone_speed(address: str, tokenizer, seed: int) -> float:
    """Milliseconds of TTFT per prompt token for one 2,000-token prompt with nothing else running."""
    [record] = await run_workload(
        address, specs(tokenizer, "alone", Fixed(2000), Fixed(1), 1, seed), timeout_s=900
    )
    if not record.ok:
        raise RuntimeError(f"the 2,000-token prompt alone failed: {record.status} {record.error}")
    return request_metrics(record).ttft_ms / record.prompt_tokens


async def study_setup(name: str, tokenizer, args) -> dict:
    mode, workers = SETUPS[name]
    out = {"setup": name, "runs": {}}
    with BenchStack(f"tax-{name}", mode, workers, common_env=WORKER_ENV) as stack:
        print(f"[{name}] stack up at {stack.address}; warming up", flush=True)
        await run_workload(
            stack.address, specs(tokenizer, "warm", Fixed(64), Fixed(8), 4, 99), concurrency=4
        )
        for i, rate in enumerate([0.0] + args.rates):
            started = time.time()
            # New prompts for every run: no run may hit a prefix cached by an earlier one.
            records = await one_run(stack.address, tokenizer, args, rate, seed=args.seed * 1000 + i)
            out["runs"][str(rate)] = [record_row(r) for r in records]
            s = summarize([r for r in records if r.tag == "steady"])
            print(
                f"[{name}] rate {rate}: steady ITL p50 {s.itl_ms.median or 0:.0f} p99 {s.itl_ms.p99 or 0:.0f} ms, "
                f"{s.completed} done, {len(records) - s.requests} long, "
                f"{sum(r.timing.get('cached_tokens', 0) for r in records)} prompt tokens from a prefix cache; "
                f"{time.time() - started:.0f}s",
                flush=True,
            )
        out["alone_ms_per_token"] = await alone_speed(
            stack.address, tokenizer, args.seed * 1000 + 999
        )
    return out


def record_row(r) -> dict:
    m = request_metrics(r) if r.ok else None
    return {
        "tag": r.tag,
        "ok": r.ok,
        "status": r.status,
        "prompt_tokens": r.prompt_tokens or r.prompt_len,
        "ttft_ms": m.ttft_ms if m else None,
        "max_itl_ms": m.max_itl_ms if m else None,
        "itl_ms": m.itl_ms if m else [],
        "e2e_ms": m.e2e_ms if m else None,
        "path": r.timing.get("path", ""),
        "cached_tokens": r.timing.get("cached_tokens", 0),
        "sent_at": r.sent_at,
        "server": {
            k: r.timing.get(k) for k in ("queue_ms", "prefill_ms", "kv_transfer_ms", "ttft_ms")
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--setups", default="colocated,disaggregated,auto")
    parser.add_argument(
        "--rates", default="0.03,0.06", help="long prompts per second, comma-separated"
    )
    parser.add_argument("--duration-s", type=float, default=150.0)
    parser.add_argument("--steady-output", type=int, default=64)
    parser.add_argument("--long-output", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default=str(DOCS / "prefill-tax"))
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the other setups' runs from an earlier --out JSON (rerun some setups only)",
    )
    args = parser.parse_args()
    args.rates = [float(r) for r in args.rates.split(",") if r]
    tokenizer = model_store.load_tokenizer(model_store.prepare("", "~/.cache/tandem/models"))
    results = {"args": {k: v for k, v in vars(args).items()}, "setups": {}}
    if args.merge:
        earlier = json.loads(Path(args.out + ".json").read_text())
        results["setups"] = earlier["setups"]
        results["args"]["merged"] = (
            f"{args.setups} rerun; the others from an earlier run ({earlier['args']['setups']})"
        )
    for name in args.setups.split(","):
        results["setups"][name] = asyncio.run(study_setup(name, tokenizer, args))
        Path(args.out + ".json").write_text(json.dumps(results))
    from bench.tax_report import write_report

    write_report(results, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
