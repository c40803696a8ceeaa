"""`tandem bench`: the serving benchmark against a running gateway (shared.benchmark does the work)."""

import argparse
import asyncio
import itertools
import math
import os
import sys
import time
from pathlib import Path

from shared import model_store
from shared.benchmark import plots, report
from shared.benchmark.client import GatewayUnreachable, probe
from shared.benchmark.lengths import parse_lengths, parse_output_lengths
from shared.benchmark.metrics import summarize
from shared.benchmark.progress import Progress
from shared.benchmark.prompts import PromptError
from shared.benchmark.runner import run_workload
from shared.benchmark.slo import SLO, SLO_HELP
from shared.benchmark.workload import Workload, poisson_arrivals, request_specs

DEFAULT_REQUESTS = 100
DEFAULT_ADDRESS = {"grpc": "127.0.0.1:50051", "openai": "http://127.0.0.1:8000"}
LENGTHS_HELP = "fixed:N, uniform:A-B (inclusive) or file:PATH (one length a line, or 'prompt_len output_len' pairs)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default="",
        help="the gateway: host:port for gRPC (default 127.0.0.1:50051), the HTTP API's base "
        "URL for openai (default http://127.0.0.1:8000)",
    )
    p.add_argument(
        "--api",
        choices=("grpc", "openai"),
        default="grpc",
        help="drive the gRPC API (default) or the OpenAI-compatible HTTP API (/v1/completions)",
    )
    _load_arguments(p)
    _workload_arguments(p)
    _run_arguments(p)
    p.set_defaults(run=bench_command)


def _load_arguments(p: argparse.ArgumentParser) -> None:
    """How many requests, how fast."""
    p.add_argument(
        "--rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (seeded exponential gaps); default inf: all at once",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=None,
        help="at most C requests in flight; without --rate, a closed loop keeping C busy",
    )
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"requests to send (default {DEFAULT_REQUESTS}; unlimited when only --duration is given)",
    )
    p.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop sending new requests after this many seconds (those in flight finish)",
    )


def _workload_arguments(p: argparse.ArgumentParser) -> None:
    """What each request asks."""
    p.add_argument(
        "--prompt-len",
        default="fixed:256",
        help=f"prompt tokens: {LENGTHS_HELP} (default fixed:256)",
    )
    p.add_argument(
        "--output-len",
        default=None,
        help="output tokens, generated exactly (ignore_eos, greedy): same forms (default fixed:64, "
        "or the second column when --prompt-len names a pair file)",
    )
    p.add_argument(
        "--shared-prefix-tokens",
        type=int,
        default=0,
        help="each prompt starts with one of --num-prefixes prefixes of this many tokens",
    )
    p.add_argument(
        "--num-prefixes", type=int, default=1, help="distinct shared prefixes (default 1)"
    )
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds lengths, prompts, prefixes and arrivals (default 0)",
    )
    p.add_argument(
        "--priority", type=int, default=0, help="GenerateRequest.priority of every request"
    )


def _run_arguments(p: argparse.ArgumentParser) -> None:
    """Judging, waiting, the tokenizer, and where the results go."""
    p.add_argument("--slo", default="", help=SLO_HELP)
    p.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="per-request deadline in seconds (default 600)",
    )
    p.add_argument(
        "--connect-timeout",
        type=float,
        default=10.0,
        help="seconds to wait for the gateway to answer at all (default 10)",
    )
    p.add_argument(
        "--model",
        default="",
        help="the served model, for its tokenizer (default SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--model-cache",
        default=os.environ.get("TANDEM_MODEL_CACHE", "~/.cache/tandem/models"),
        help="where converted GGUF models are cached (env TANDEM_MODEL_CACHE)",
    )
    p.add_argument("--out-dir", default="bench/results/serving", help="results directory")
    p.add_argument(
        "--warmup", type=int, default=0, help="requests sent first and left out of the results"
    )
    p.add_argument(
        "--label", default="", help="the run's name in the results (default: the start time)"
    )
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots")


def bench_command(args) -> int:
    args.label = args.label or time.strftime("serving-%Y%m%d-%H%M%S")
    args.address = args.address or DEFAULT_ADDRESS[args.api]
    try:
        workload, slo = workload_of(args), SLO.parse(args.slo)
        check_limits(args)
    except ValueError as err:  # LengthSpecError, SLOError and the checks below
        print(f"error: {err}", file=sys.stderr)
        return 2
    try:
        records, cluster = asyncio.run(run(args, workload))
    except GatewayUnreachable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except (PromptError, model_store.ModelNotFound) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: no results written", file=sys.stderr)
        return 130
    summary = summarize(records, slo)
    print(report.table(summary, args.label))
    write_results(args, records, summary, {**config_of(args), "cluster": cluster})
    return 0


def workload_of(args) -> Workload:
    prompt = parse_lengths(args.prompt_len, column=0)
    return Workload(
        prompt,
        parse_output_lengths(args.output_len, prompt, default="fixed:64"),
        args.shared_prefix_tokens,
        args.num_prefixes,
        args.priority,
        tag="",
        seed=args.seed,
    )


def check_limits(args) -> None:
    if args.concurrency is not None and args.concurrency < 1:
        raise ValueError("--concurrency must be at least 1")
    if not args.rate > 0:
        raise ValueError("--rate must be > 0 (or inf)")
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError("--num-requests must be at least 1")
    if args.duration is not None and not args.duration > 0:
        raise ValueError("--duration must be > 0 seconds")
    if (
        args.duration is not None
        and args.num_requests is None
        and math.isinf(args.rate)
        and args.concurrency is None
    ):
        raise ValueError("--duration needs --rate or --concurrency (else it sends without limit)")
    if args.warmup < 0:
        raise ValueError("--warmup must be >= 0")


async def run(args, workload: Workload):
    """Warm-up, then the measured run; returns the measured records and the cluster's description."""
    # fails fast, before the tokenizer loads (the HTTP API's is probed as the run starts)
    cluster = await probe(args.address, args.connect_timeout) if args.api == "grpc" else {}
    tokenizer = await asyncio.to_thread(
        model_store.load_tokenizer,
        await asyncio.to_thread(model_store.prepare, args.model, args.model_cache),
    )
    count = args.num_requests or (None if args.duration else DEFAULT_REQUESTS)
    specs = request_specs(workload, tokenizer, None if count is None else args.warmup + count)
    if count is not None:  # built up front, so no prompt is tokenized while requests stream
        print(f"building {args.warmup + count} prompts...", file=sys.stderr)
        specs = iter(await asyncio.to_thread(list, specs))
    if args.warmup:
        await drive(args, list(itertools.islice(specs, args.warmup)), args.warmup, None, "warmup")
    records = await drive(args, specs, count, args.duration, args.label)
    return records, cluster


async def drive(args, specs, total: int | None, duration: float | None, label: str):
    progress = Progress(total, duration, label=label)
    arrivals = None if math.isinf(args.rate) else poisson_arrivals(args.rate, args.seed)
    try:
        return await run_workload(
            args.address,
            specs,
            arrivals=arrivals,
            concurrency=args.concurrency,
            duration_s=duration,
            timeout_s=args.request_timeout,
            progress=progress,
            connect_timeout_s=args.connect_timeout,
            api=args.api,
        )
    finally:
        progress.close()


def config_of(args) -> dict:
    skip = {"run", "command"}
    config = {k: v for k, v in vars(args).items() if k not in skip}
    config["rate"] = None if math.isinf(args.rate) else args.rate  # JSON has no inf
    return config


def write_results(args, records, summary, config: dict) -> None:
    out_dir, stem = Path(args.out_dir), report.file_stem(args.label)
    written = [report.write_json(out_dir / f"{stem}.json", args.label, config, records, summary)]
    if not args.no_plots:
        try:
            written += plots.write_plots(out_dir, stem, records)
        except plots.MatplotlibMissing as err:
            print(f"warning: {err}", file=sys.stderr)
    print("results: " + ", ".join(str(p) for p in written))
