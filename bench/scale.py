"""Scaling under load (`make bench-scale`): a decode worker joins a saturated stack, then leaves.

`tandem up --prefill 1 --decode 1` (auto mode, 1 torch thread a worker) serves a closed loop of
`--concurrency` streams (short prompts, prefilled on the decode worker) for the whole run:
  phase 1: one decode worker;  `tandem scale decode=2 --wait`;
  phase 2: two decode workers; `tandem scale decode=1 --wait` (the newest drains and exits);
  phase 3: one decode worker again.
Token throughput is counted per phase from the client's token arrival times; every request must
complete (zero failed). Writes bench/results/scale.{md,json}.
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
from shared.benchmark.runner import run_workload  # noqa: E402
from shared.benchmark.workload import Workload, request_specs  # noqa: E402
from shared.cli.processes import free_port  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def tandem(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "shared.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode:
        raise RuntimeError(out.stdout + out.stderr)
    return out.stdout


def launch(port: int, sock: Path, log_dir: str) -> subprocess.Popen:
    env = {**os.environ, "TANDEM_TORCH_THREADS": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shared.cli.main",
            "up",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--no-demo",
            "--grpc-port",
            str(port),
            "--http-port",
            "-1",
            "--log-dir",
            log_dir,
            "--control-socket",
            str(sock),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("control socket"):
            return proc
    raise RuntimeError("tandem up did not start:\n" + "".join(lines))


def tokens_between(records, start: float, end: float) -> int:
    return sum(
        n for r in records for t, n in zip(r.chunk_times, r.chunk_tokens) if start <= t < end
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--phase-s", type=float, default=60.0)
    parser.add_argument("--warmup-s", type=float, default=15.0)
    args = parser.parse_args()
    tokenizer = model_store.load_tokenizer(model_store.prepare("", "~/.cache/tandem/models"))
    port, sock = free_port(), Path(tempfile.mkdtemp()) / "control.sock"
    specs = list(
        request_specs(Workload(Uniform(32, 96), Fixed(64), tag="scale", seed=3), tokenizer, 8000)
    )
    proc = launch(port, sock, tempfile.mkdtemp(prefix="tandem-bench-scale-"))
    try:
        records, marks = asyncio.run(run(f"127.0.0.1:{port}", sock, specs, args))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=120)
    report(records, marks, args)
    return 0


async def run(address: str, sock: Path, specs: list, args):
    """The load runs until phase 3 ends; then it stops sending and the streams in flight finish."""
    stop_at = {}
    load = asyncio.create_task(
        run_workload(address, _Lazy(specs, stop_at), concurrency=args.concurrency, timeout_s=600)
    )
    clock, marks = time.perf_counter, {}
    await asyncio.sleep(args.warmup_s)
    for phase, command in (
        ("1 decode worker", "decode=2"),
        ("2 decode workers", "decode=1"),
        ("1 decode worker again", None),
    ):
        start = clock()
        await asyncio.sleep(args.phase_s)
        marks[phase] = (start, clock())
        if command:
            started = clock()
            await asyncio.to_thread(
                tandem, "scale", command, "--wait", "--control-socket", str(sock)
            )
            marks[f"scale {command}"] = (started, clock())
    stop_at["end"] = True
    records = await load
    if len(records) >= len(specs):
        raise RuntimeError("the load ran out of requests before the end: give it more")
    return records, marks


class _Lazy:
    """The specs, until told to stop (then the closed loop sends nothing more)."""

    def __init__(self, specs: list, stop: dict):
        self.specs, self.stop = specs, stop

    def __iter__(self):
        for spec in self.specs:
            if "end" in self.stop:
                return
            yield spec


def report(records, marks: dict, args) -> None:
    failed = [r for r in records if not r.ok]
    rows = []
    for phase, (start, end) in marks.items():
        tokens = tokens_between(records, start, end)
        rows.append(
            {
                "phase": phase,
                "seconds": end - start,
                "tokens": tokens,
                "tokens_per_s": tokens / (end - start),
            }
        )
    base = rows[0]["tokens_per_s"]
    lines = [
        "# Scaling a saturated embedded stack under load",
        "",
        f"Command: `python bench/scale.py --concurrency {args.concurrency} --phase-s {args.phase_s:.0f}` "
        "(`make bench-scale`); one run, 2 cores, 1 torch thread a worker, auto mode.",
        "",
        "| phase | seconds | output tokens | tokens/s | vs phase 1 |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {r['phase']} | {r['seconds']:.1f} | {r['tokens']} | {r['tokens_per_s']:.1f} | "
        f"{r['tokens_per_s'] / base:.2f}x |"
        for r in rows
    ]
    lines += [
        "",
        f"Requests: {len(records)} sent, {len(records) - len(failed)} completed, {len(failed)} failed"
        + (f" ({sorted({r.status for r in failed})})" if failed else "")
        + ".",
    ]
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "scale.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "scale.json").write_text(
        json.dumps(
            {"args": vars(args), "phases": rows, "requests": len(records), "failed": len(failed)},
            indent=1,
        )
    )
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
