"""Front door (`make bench-front-door`): can a hostile client hold the gateway shut? (issue 45)

`tandem up` with its defaults (bench/tandem_up.py), driven over its OpenAI HTTP API. A normal
client on 127.0.0.1 streams short chat requests one after another (max_tokens 32, greedy, a fresh
connection each), timed as it sees them: TTFT and ITL (the gaps between content chunks). Phases:
  0. unloaded: the normal client alone;
  1. half_open: the normal client while 1,000 connections from 127.0.0.2 send part of a request
     and stall (each one the gateway closes is replaced); per connection, when it was closed;
  2. message_flood: ... while 3 concurrent requests of 36,000 empty messages (< 1 MiB each) come
     from 127.0.0.2, again as each is answered;
  3. big_bodies: ... while 40 concurrent 1 MiB bodies come from 127.0.0.2 (39 of ~4,000 short
     messages, one of 4 huge text messages), again as each is answered.
`--gateway-cpus 0 --attacker-cpus 0` pins the gateway and the attacking process to core 0, away
from the workers' cores: on a small machine the attacker must run beside the stack, and so its
own CPU is taken from the gateway's share, as a remote attacker's would be, not from a worker's.
In every attack phase two deeply nested JSON bodies (100,000 '[') come from 127.0.0.3, and the
gateway's resident memory (VmRSS) is sampled throughout. The attacker runs in a process of its
own (bench/front_door_attacks.py, bench/half_open.py).
Bars (issue 45): in each attack phase the normal client's TTFT p99 and ITL p99 within 2x of the
unloaded ones, none of its requests failed; the gateway's peak RSS under attack less than
256 MiB above its RSS before the first attack; every deeply nested body answered 400; no stalled
connection held open longer than --stall-timeout-s (the gateway's, 30 s by default) plus
--close-grace-s; the gateway never restarted. Writes bench/results/front-door.{md,json,png}.
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import front_door_attacks  # noqa: E402
from bench.front_door_report import plot, report, verdicts  # noqa: E402
from bench.stream_clients import HttpClient, pct  # noqa: E402
from bench.tandem_up import TandemUp, cpu_seconds, rss_mib  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PHASES = ("unloaded", "half_open", "message_flood", "big_bodies")
NORMAL, ATTACKER, DEEP = "127.0.0.1", "127.0.0.2", "127.0.0.3"
MAX_TOKENS = 32
RSS_EVERY_S = 0.25
RESULT_TIMEOUT_S = 180.0  # for the attacker's report once told to stop


async def probe(client: HttpClient, seconds: float, first: int) -> dict:
    """The normal client: one streamed request after another for `seconds`."""
    ttft, itl, failures, index = [], [], Counter(), first
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        index += 1
        try:
            timed = await client.one(index, MAX_TOKENS)
        except Exception as err:  # any failure is the normal client's, counted, not raised
            failures[f"{type(err).__name__}: {str(err)[:80]}"] += 1
            continue
        if timed.times:
            ttft.append((timed.times[0] - timed.sent) * 1000)
            itl += [(b - a) * 1000 for a, b in zip(timed.times, timed.times[1:])]
    return {
        "requests": index - first,
        "failures": dict(failures),
        "ttft_ms": {"p50": pct(ttft, 50), "p99": pct(ttft, 99), "n": len(ttft)},
        "itl_ms": {"p50": pct(itl, 50), "p99": pct(itl, 99), "n": len(itl)},
    }


async def sample_rss(stack: TandemUp, samples: list, stop: asyncio.Event) -> None:
    """(seconds since the study began, the gateway's RSS in MiB), every RSS_EVERY_S."""
    pid = stack.gateway_pid()
    while not stop.is_set():
        mib = rss_mib(pid)
        if mib != mib:  # NaN: the gateway is gone (a restart is a new pid)
            pid = stack.gateway_pid()
            continue
        samples.append((time.monotonic() - stack.started, mib))
        await asyncio.sleep(RSS_EVERY_S)


def attacker_config(stack: TandemUp, model: str, args) -> dict:
    return {
        "base_url": stack.base_url,
        "host": "127.0.0.1",
        "port": stack.http_port,
        "source": ATTACKER,
        "deep_source": DEEP,
        "model": model,
        "count": args.half_open,
        "connect_timeout_s": front_door_attacks.CONNECT_TIMEOUT_S,
        "flood_messages": args.flood_messages,
        "flood_workers": args.flood_workers,
        "tiny_messages": args.tiny_messages,
        "big_workers": args.big_workers,
        "deep_after_s": args.settle_s,
    }


def phase_seconds(kind: str, args) -> float:
    """Long enough, in the half-open phase, that a connection never closed outlives the bar."""
    if kind == "half_open":
        return max(args.phase_s, args.stall_timeout_s + args.close_grace_s + 5)
    return args.phase_s


def cores_used(before: dict, after: dict, since: float) -> dict[str, float]:
    """Each process kind's CPU over the probe, in cores (CPU seconds per second)."""
    wall = time.monotonic() - since
    return {k: round((after[k] - before.get(k, 0.0)) / wall, 2) for k in after}


async def attacked(stack, client, kind: str, config: dict, args, first: int) -> dict:
    """The normal client's figures while `kind` runs in a process of its own, and its report."""
    spawn = multiprocessing.get_context("spawn")
    stop, results = spawn.Event(), spawn.Queue()
    attacker = spawn.Process(target=front_door_attacks.run, args=(kind, config, stop, results))
    attacker.start()
    if args.attacker_cpus:  # the attacker's CPU taken from the gateway's cores, not a worker's
        os.sched_setaffinity(attacker.pid, _cpus(args.attacker_cpus))
    try:
        await asyncio.sleep(args.settle_s)  # the attack under way before the first probe
        extra = {"attacker": attacker.pid, "normal client": os.getpid()}
        before, wall = cpu_seconds(stack.process.pid, extra), time.monotonic()
        figures = await probe(client, phase_seconds(kind, args), first)
        figures["cores"] = cores_used(before, cpu_seconds(stack.process.pid, extra), wall)
        stop.set()
        figures["attack"] = await asyncio.to_thread(results.get, True, RESULT_TIMEOUT_S)
    finally:
        stop.set()
        attacker.join(30)
        if attacker.is_alive():
            attacker.kill()
    return figures


async def run_phase(stack, client, kind: str, config: dict, args, first: int) -> dict:
    samples, done = [], asyncio.Event()
    sampler = asyncio.create_task(sample_rss(stack, samples, done))
    await asyncio.sleep(RSS_EVERY_S)  # a sample before anything starts
    started = time.monotonic() - stack.started
    if kind == "unloaded":
        extra = {"normal client": os.getpid()}
        before, wall = cpu_seconds(stack.process.pid, extra), time.monotonic()
        figures = await probe(client, args.phase_s, first)
        figures["cores"] = cores_used(before, cpu_seconds(stack.process.pid, extra), wall)
    else:
        figures = await attacked(stack, client, kind, config, args, first)
    done.set()
    await sampler
    figures.update(phase=kind, started_s=started, rss_mib=samples)
    print(f"{kind}: {json.dumps({k: figures[k] for k in ('ttft_ms', 'itl_ms', 'failures')})}")
    return figures


async def study(stack: TandemUp, args) -> dict:
    model = stack.model()
    config = attacker_config(stack, model, args)
    out = {"model": model, "phases": {}, "pinned": [args.gateway_cpus, args.attacker_cpus]}
    if args.gateway_cpus:  # as deployed: the gateway on cores of its own, not a worker's
        os.sched_setaffinity(stack.gateway_pid(), _cpus(args.gateway_cpus))
    async with HttpClient(stack.base_url, model, fresh=True, source=NORMAL) as client:
        for i in range(3):  # warm-up
            await client.one(-1 - i, MAX_TOKENS)
        for n, kind in enumerate(args.phases):
            out["phases"][kind] = await run_phase(stack, client, kind, config, args, n * 100000)
            await asyncio.sleep(args.cooldown_s)  # the gateway lets go of the last phase's work
    out["gateway_pids"] = stack.gateway_pids
    return out


def _cpus(text: str) -> set[int]:
    """ "0-2,5" -> {0, 1, 2, 5}"""
    cpus = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return cpus


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase-s", type=float, default=45.0, help="the normal client's time")
    parser.add_argument("--settle-s", type=float, default=5.0, help="attack before the probe")
    parser.add_argument("--cooldown-s", type=float, default=5.0, help="pause between phases")
    parser.add_argument("--half-open", type=int, default=1000, help="stalled connections held")
    parser.add_argument("--flood-messages", type=int, default=36000)
    parser.add_argument("--flood-workers", type=int, default=3)
    parser.add_argument("--tiny-messages", type=int, default=4000)
    parser.add_argument("--big-workers", type=int, default=40)
    parser.add_argument("--stall-timeout-s", type=float, default=30.0, help="the gateway's")
    parser.add_argument("--close-grace-s", type=float, default=5.0)
    parser.add_argument("--phases", nargs="+", choices=PHASES, default=list(PHASES))
    parser.add_argument(
        "--gateway-cpus",
        default="",
        help="cores to pin the gateway to, e.g. 0 or 0-1 (default: where the OS puts it)",
    )
    parser.add_argument(
        "--attacker-cpus",
        default="",
        help="cores to pin the attacking process to (default: where the OS puts it)",
    )
    parser.add_argument("--results", type=Path, default=RESULTS, help="where the report goes")
    args = parser.parse_args(argv)
    if args.phases[0] != "unloaded":
        parser.error("the first phase must be unloaded: the others are measured against it")
    return args


def main(argv=None) -> int:
    args = parse(argv)
    with TandemUp("front-door") as stack:
        out = asyncio.run(study(stack, args))
        out["launcher_log_tail"] = stack.log()[-2000:]
    out["args"] = {k: str(v) for k, v in vars(args).items()}
    out["bars"] = verdicts(out, args)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "front-door.json").write_text(json.dumps(out, indent=1) + "\n")
    text = report(out, args)
    (args.results / "front-door.md").write_text(text)
    plot(out, args, args.results / "front-door.png")
    print(text)
    return 0 if all(b["pass"] for b in out["bars"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
