"""aiperf on `tandem up` defaults (`make bench-aiperf`): is a lone busy client served, and is it
still served while another floods? (issue 45)

`tandem up` with its defaults (bench/tandem_up.py); NVIDIA's aiperf (its own venv, .venv-aiperf)
against the OpenAI chat endpoint from 127.0.0.1: streamed, --concurrency 64, --request-count 256,
synthetic prompts of 128 tokens, 32 output tokens (ignore_eos), the model's own tokenizer from
tandem's model cache. Two runs on the same stack:
  1. solo: aiperf alone;
  2. flooded: the same aiperf while a second client on 127.0.0.2 (aiperf cannot bind a source
     address, so bench/http_flood.py) keeps --flood-concurrency streamed requests of the same
     shape in flight.
Read from aiperf's per-request export (profile_export.jsonl): each request's outcome (refused or
failed: any HTTP error or transport error), completed requests per second (completed / from the
first request's start to the last one's end), TTFT. Bars (issue 45): no request refused or
failed, alone or flooded; flooded, aiperf's completed rate at least half its solo rate.
Writes bench/results/aiperf-front-door.{md,json,png}.
"""

import argparse
import asyncio
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.http_flood import Flood  # noqa: E402
from bench.stream_clients import HttpClient, pct  # noqa: E402
from bench.tandem_up import ROOT, TandemUp  # noqa: E402
from shared import model_store  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
FIRST, FLOODER = "127.0.0.1", "127.0.0.2"
RATE_BAR = 0.5
# aiperf 0.13.0 in offline mode looks a local tokenizer folder up as a hub id and fails; given a
# folder, it loads it without the network anyway
HUB_OFFLINE = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")


def aiperf_argv(args, base_url: str, model: str, tokenizer: str, artifacts: Path) -> list[str]:
    return [
        str(args.aiperf),
        "profile",
        *("--model", model, "--url", base_url, "--endpoint-type", "chat", "--streaming"),
        *("--tokenizer", tokenizer, "--use-server-token-count"),
        *("--concurrency", str(args.concurrency), "--request-count", str(args.requests)),
        *("--isl", str(args.input_tokens), "--isl-stddev", "0", "--osl", str(args.output_tokens)),
        *("--extra-inputs", "ignore_eos:true", "--random-seed", "1"),
        *("--ui", "none", "--no-gpu-telemetry", "--artifact-dir", str(artifacts)),
    ]


async def run_aiperf(args, stack: TandemUp, model: str, name: str) -> dict:
    artifacts = args.work / name
    tokenizer = model_store.prepare(args.model, args.model_cache)
    env = {k: v for k, v in os.environ.items() if k not in HUB_OFFLINE}
    with open(args.work / f"{name}.log", "wb") as log:
        aiperf = await asyncio.create_subprocess_exec(
            *aiperf_argv(args, stack.base_url, model, str(tokenizer), artifacts),
            env=env,
            stdout=log,
            stderr=log,
        )
        rc = await asyncio.wait_for(aiperf.wait(), args.aiperf_timeout_s)
    records = artifacts / "profile_export.jsonl"
    if not records.exists():
        tail = (args.work / f"{name}.log").read_text(errors="replace")[-3000:]
        raise RuntimeError(f"aiperf ({rc}) wrote no records:\n{tail}")
    return {"aiperf_rc": rc, **summarize(records, artifacts / "profile_export_aiperf.json")}


def summarize(records: Path, summary: Path) -> dict:
    rows = [json.loads(line) for line in records.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["metadata"].get("benchmark_phase") == "profiling"]
    outcomes = Counter(_outcome(r) for r in rows)
    starts = [r["metadata"]["request_start_ns"] for r in rows]
    ends = [r["metadata"]["request_end_ns"] for r in rows]
    span_s = (max(ends) - min(starts)) / 1e9 if rows else float("nan")
    ttft = [r["metrics"]["time_to_first_token"]["value"] for r in rows if "error" not in r]
    errors = Counter(r["error"].get("message", "")[:160] for r in rows if "error" in r)
    aiperf = json.loads(summary.read_text()) if summary.exists() else {}
    return {
        "requests": len(rows),
        "outcomes": dict(outcomes),
        "completed": outcomes["ok"],
        "refused_or_failed": len(rows) - outcomes["ok"],
        "completed_per_s": outcomes["ok"] / span_s if rows else 0.0,
        "span_s": span_s,
        "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99)},
        "aiperf_request_throughput": aiperf.get("request_throughput", {}).get("avg"),
        "errors": dict(errors.most_common(5)),
        "ttft_all_ms": ttft,
    }


def _outcome(row: dict) -> str:
    if "error" not in row:
        return "ok"
    error = row["error"]
    return str(error.get("code") or error.get("type") or "error")


async def flooded(args, stack: TandemUp, model: str) -> dict:
    flood = Flood(stack.base_url, model, FLOODER, args.input_tokens, args.output_tokens)
    stop = asyncio.Event()
    flooding = asyncio.create_task(flood.run(args.flood_concurrency, args.flood_backoff_s, stop))
    await asyncio.sleep(args.settle_s)  # the flood at full strength before aiperf starts
    started = time.monotonic()
    try:
        first = await run_aiperf(args, stack, model, "flooded")
    finally:
        ended = time.monotonic()
        stop.set()
        await flooding
    return {**first, "flooder": flood.report(started, ended)}


async def study(args, stack: TandemUp) -> dict:
    model = stack.model()
    async with HttpClient(stack.base_url, model, fresh=False, source=FIRST) as warm:
        for i in range(2):
            await warm.one(-1 - i, args.output_tokens)
    solo = await run_aiperf(args, stack, model, "solo")
    print(f"solo: {_brief(solo)}", flush=True)
    flood = await flooded(args, stack, model)
    print(f"flooded: {_brief(flood)}; flooder {flood['flooder']}", flush=True)
    return {"model": model, "solo": solo, "flooded": flood, "gateway_pids": stack.gateway_pids}


def _brief(run: dict) -> str:
    return (
        f"{run['completed']}/{run['requests']} completed, {run['outcomes']}, "
        f"{run['completed_per_s']:.2f} completed/s"
    )


def verdicts(out: dict) -> dict:
    solo, flood = out["solo"], out["flooded"]
    ratio = flood["completed_per_s"] / solo["completed_per_s"] if solo["completed_per_s"] else 0
    out["rate_ratio"] = ratio
    return {
        "solo: refused or failed": (solo["refused_or_failed"], "0", solo["refused_or_failed"] == 0),
        "flooded: refused or failed": (
            flood["refused_or_failed"],
            "0",
            flood["refused_or_failed"] == 0,
        ),
        "flooded / solo completed rate": (f"{ratio:.2f}", f">= {RATE_BAR}", ratio >= RATE_BAR),
        "gateway restarts": (len(out["gateway_pids"]) - 1, "0", len(out["gateway_pids"]) == 1),
    }


def report(out: dict, args) -> str:
    lines = [
        "# aiperf on `tandem up` defaults, alone and beside a flood (issue 45)",
        "",
        f"`python bench/aiperf_front_door.py` (`make bench-aiperf`); model {out['model']}; aiperf "
        f"from {FIRST}: chat, streamed, concurrency {args.concurrency}, {args.requests} requests, "
        f"{args.input_tokens} tokens in, {args.output_tokens} out. Flooder from {FLOODER}: "
        f"{args.flood_concurrency} streamed requests of the same shape in flight.",
        "",
        "| run | requests | completed | refused or failed | outcomes | completed/s | "
        "aiperf request_throughput | TTFT p50 / p99 (ms) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name in ("solo", "flooded"):
        r = out[name]
        lines.append(
            f"| {name} | {r['requests']} | {r['completed']} | {r['refused_or_failed']} | "
            f"{r['outcomes']} | {r['completed_per_s']:.2f} | "
            f"{r['aiperf_request_throughput'] or float('nan'):.2f} | "
            f"{r['ttft_ms']['p50']:.0f} / {r['ttft_ms']['p99']:.0f} |"
        )
    flooder = out["flooded"]["flooder"]
    lines += [
        "",
        f"Flooder while aiperf ran: {flooder['completed_per_s']:.2f} completed/s; its outcomes "
        f"over the whole flood: {flooder['statuses']}.",
    ]
    for name in ("solo", "flooded"):
        if out[name]["errors"]:
            lines.append(f"\n{name}: most frequent errors: {out[name]['errors']}")
    lines += ["", "| bar | value | target | verdict |", "| --- | --- | --- | --- |"]
    for bar, (value, target, ok) in out["bars"].items():
        lines.append(f"| {bar} | {value} | {target} | {'PASS' if ok else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rate, ttft) = plt.subplots(1, 2, figsize=(11, 4.2))
    names = ["aiperf solo", "aiperf flooded", "flooder"]
    values = [
        out["solo"]["completed_per_s"],
        out["flooded"]["completed_per_s"],
        out["flooded"]["flooder"]["completed_per_s"],
    ]
    rate.bar(names, values, color=["tab:blue", "tab:orange", "tab:gray"])
    rate.axhline(RATE_BAR * values[0], color="red", linestyle="--", label="bar: half of solo")
    rate.set(ylabel="completed requests / s", title="completed requests per second")
    rate.legend()
    series = [out[n]["ttft_all_ms"] or [float("nan")] for n in ("solo", "flooded")]
    ttft.boxplot(series, tick_labels=["solo", "flooded"])
    ttft.set(ylabel="ms", title="aiperf's TTFT (completed requests)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--aiperf", type=Path, default=ROOT / ".venv-aiperf" / "bin" / "aiperf")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--input-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--flood-concurrency", type=int, default=256)
    parser.add_argument("--flood-backoff-s", type=float, default=0.1, help="after a refusal")
    parser.add_argument("--settle-s", type=float, default=5.0, help="flood before aiperf")
    parser.add_argument("--aiperf-timeout-s", type=float, default=1800.0, help="each run")
    parser.add_argument("--model", default="", help="as `tandem up --model` (default: its own)")
    parser.add_argument(
        "--model-cache", default=os.environ.get("TANDEM_MODEL_CACHE", "~/.cache/tandem/models")
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the report goes")
    args = parser.parse_args(argv)
    if not args.aiperf.exists():
        parser.error(f"no aiperf at {args.aiperf}: `make bench-aiperf` installs it")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    up_args = ("--model", args.model, "--model-cache", args.model_cache)
    with TandemUp("aiperf", extra_args=up_args) as stack:
        args.work = stack.dir  # aiperf's artifacts and logs, beside the stack's
        out = asyncio.run(study(args, stack))
    out["args"] = {k: str(v) for k, v in vars(args).items()}
    out["bars"] = verdicts(out)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "aiperf-front-door.json").write_text(json.dumps(out, indent=1) + "\n")
    text = report(out, args)
    (args.results / "aiperf-front-door.md").write_text(text)
    plot(out, args.results / "aiperf-front-door.png")
    print(text)
    return 0 if all(ok for _, _, ok in out["bars"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
