"""`tandem up` as a user starts it, measured from outside: do long prompts stall the streams?

    python bench/blackbox.py [--duration-s 120] [--rate 0.05]     (make bench-blackbox)

Starts `tandem up --mode disaggregated` (one prefill and one decode worker, nothing else set)
and, in the same run, the same with `--no-pin` (every worker on every core, the behaviour before
pools got cores of their own). Each stack runs 6 steady streams (a closed loop: prompts of 32-96
tokens, 32-96 output tokens) for `--duration-s` alone, then again while long prompts (uniform
1,000-4,000 tokens, 8 output tokens) arrive as a Poisson process at `--rate` per second. Reported:
the steady streams' ITL p50/p99 in each run and the ratio of p99 with long prompts to without
(issue 18's bar: <= 1.3x for the default). Writes bench/results/blackbox.{json,md}.
"""

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared import model_store  # noqa: E402
from shared.benchmark.lengths import Fixed, Uniform  # noqa: E402
from shared.benchmark.metrics import summarize  # noqa: E402
from shared.benchmark.runner import run_workload  # noqa: E402
from shared.benchmark.workload import Workload, poisson_arrivals, request_specs  # noqa: E402
from shared.cli.processes import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
VARIANTS = {"pinned (default)": [], "--no-pin": ["--no-pin"]}
STREAMS = 6


def specs(tokenizer, tag: str, prompt, output, count: int, seed: int) -> list:
    return list(request_specs(Workload(prompt, output, tag=tag, seed=seed), tokenizer, count))


async def one_run(address: str, tokenizer, args, rate: float, seed: int) -> dict:
    steady = specs(tokenizer, "steady", Uniform(32, 96), Uniform(32, 96), 4000, seed)
    runs = [
        run_workload(
            address, steady, concurrency=STREAMS, duration_s=args.duration_s, timeout_s=900
        )
    ]
    if rate:
        count = int(rate * args.duration_s * 3) + 5
        long = specs(tokenizer, "long", Uniform(1000, 4000), Fixed(8), count, seed + 1)
        arrivals = poisson_arrivals(rate, seed)
        runs.append(
            run_workload(
                address, long, arrivals=arrivals, duration_s=args.duration_s, timeout_s=900
            )
        )
    records = [r for done in await asyncio.gather(*runs) for r in done]
    s = summarize([r for r in records if r.tag == "steady"])
    long_done = sum(1 for r in records if r.tag == "long" and r.ok)
    return {
        "rate": rate,
        "itl_p50_ms": s.itl_ms.median,
        "itl_p99_ms": s.itl_ms.p99,
        "steady_done": s.completed,
        "long_done": long_done,
        "failed": sum(1 for r in records if not r.ok),
        "failures": sorted({f"{r.tag}: {r.status} {r.error}"[:160] for r in records if not r.ok}),
    }


def start(flags: list[str], port: int, cluster: str, log_dir: str) -> subprocess.Popen:
    tandem = Path(sys.executable).parent / "tandem"
    argv = [str(tandem), "up", "--mode", "disaggregated", "--no-demo", "--http-port", "-1"]
    argv += ["--grpc-port", str(port), "--cluster", cluster, "--log-dir", log_dir, *flags]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True)


def wait_ready(proc: subprocess.Popen) -> str:
    for line in proc.stdout:
        print("  " + line.rstrip(), flush=True)
        if line.startswith("tandem is ready"):
            return line.strip()
    raise RuntimeError(f"tandem up exited with {proc.wait()}")


async def measure(name: str, flags: list[str], tokenizer, args) -> dict:
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="blackbox-") as logs:
        proc = start(flags, port, f"bb{os.getpid()}{len(flags)}", logs)
        try:
            ready = wait_ready(proc)
            address = f"127.0.0.1:{port}"
            warm = specs(tokenizer, "warm", Fixed(64), Fixed(8), 4, 99)
            await run_workload(address, warm, concurrency=4)
            runs = []
            for index, rate in enumerate((0.0, args.rate)):
                runs.append(await one_run(address, tokenizer, args, rate, args.seed * 100 + index))
                print(f"[{name}] {runs[-1]}", flush=True)
        finally:
            os.killpg(proc.pid, signal.SIGINT)
            proc.wait(timeout=120)
    ratio = runs[1]["itl_p99_ms"] / runs[0]["itl_p99_ms"]
    return {"variant": name, "flags": flags, "ready": ready, "runs": runs, "p99_ratio": ratio}


def write(results: list[dict], args) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "blackbox.json").write_text(json.dumps({"args": vars(args), "results": results}) + "\n")
    lines = [
        "# `tandem up --mode disaggregated`, measured from outside (bench/blackbox.py)",
        "",
        f"{STREAMS} steady streams, {args.duration_s:.0f} s per run; long prompts (1,000-4,000 "
        f"tokens) at {args.rate}/s in the second run. `{' '.join(sys.argv)}`; "
        f"{os.cpu_count()} cores.",
        "",
        "| variant | cores | steady ITL p50 / p99 ms, alone | with long prompts | p99 ratio "
        "| steady done, alone / with | long done | failed |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        alone, loaded = r["runs"]
        cores = next((part for part in r["ready"].split("; ") if "core" in part), "?")
        lines.append(
            f"| {r['variant']} | {cores} | {alone['itl_p50_ms']:.0f} / {alone['itl_p99_ms']:.0f} "
            f"| {loaded['itl_p50_ms']:.0f} / {loaded['itl_p99_ms']:.0f} | {r['p99_ratio']:.2f}x "
            f"| {alone['steady_done']} / {loaded['steady_done']} | {loaded['long_done']} "
            f"| {alone['failed'] + loaded['failed']} |"
        )
    (OUT / "blackbox.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration-s", type=float, default=120.0)
    parser.add_argument("--rate", type=float, default=0.05, help="long prompts per second")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    tokenizer = model_store.load_tokenizer(model_store.prepare("", "~/.cache/tandem/models"))
    results = []
    for name, flags in VARIANTS.items():
        started = time.time()
        results.append(asyncio.run(measure(name, flags, tokenizer, args)))
        print(f"[{name}] {time.time() - started:.0f}s", flush=True)
    write(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
