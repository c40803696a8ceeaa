"""Where a streamed token's CPU goes, process by process (issue 49: measure first).

    python bench/cp_profile.py [--clients 32] [-n 256] [--max-tokens 64]   (make bench-cp-profile)

Zero-time mock engines (as bench/control_plane.py: the control plane alone), `-n` streamed chat
completions over HTTP (a keep-alive pool), `--clients` at a time, colocated and disaggregated;
Dynamo 1.6.1's frontend and mocker through the same client where .venv-dynamo exists.

1. CPU per streamed token: each process's user + system time over the run (/proc/PID/stat,
   every thread), divided by the tokens the responses' usage reports; the client is this
   process (getrusage). Measured without a profiler attached. Then the same with requests of
   8 and of 256 tokens (as many tokens in all): each process's CPU split into a cost per
   request and a cost per token.
2. Where it goes: a run twice as long with py-spy sampling each Tandem process (`--rate` Hz,
   `--nonblocking`: the process is never stopped; `--gil`: only the thread holding the GIL, so a
   sample is CPU spent in Python or in native code called under the GIL, never a thread waiting
   for the GIL, a lock or a queue, which py-spy's default counts as busy), its samples folded by
   function: the most frequent leaf frames (self time) and the Tandem functions most often on
   the stack (inclusive). The samples agree with the CPU measured: a gateway's 915 samples at
   400 Hz are 2.29 s, its CPU over the run 2.12 s.

Writes bench/results/control-plane-profile.{json,md}. py-spy is looked for on PATH and in
.venv-profile (make bench-cp-profile installs it there).
"""

import argparse
import asyncio
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from control_plane import ZERO_TIME, _served_model, tandem_stack  # noqa: E402
from dynamo_peer import DynamoStack, available, cpu_seconds, dynamo_version  # noqa: E402
from stream_clients import HttpClient, run  # noqa: E402

from shared import model_store  # noqa: E402

OUT = ROOT / "bench" / "results"
TOP = 15
SPLIT_TOKENS = (8, 256)  # the request lengths each process's CPU is split by


def own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def measured(
    base_url: str, model: str, pids: dict[str, int], args, max_tokens: int | None = None
) -> dict:
    """One run of -n requests at --clients; each process's CPU microseconds per token."""
    max_tokens = max_tokens or args.max_tokens
    n = args.n * args.max_tokens // max_tokens  # as many tokens in all, whatever their length
    async with HttpClient(base_url, model, fresh=False) as client:
        await run(client, 3, 1, max_tokens, warmup=0)  # warm: connections, caches
        before = {name: cpu_seconds(pid) for name, pid in pids.items()}
        client_before = own_cpu_s()
        row = await run(client, n, args.clients, max_tokens, warmup=0)
        client_s = own_cpu_s() - client_before
        after = {name: cpu_seconds(pid) for name, pid in pids.items()}
    tokens = row["tokens_per_request"] * row["n"]
    per_token = {name: (after[name] - before[name]) / tokens * 1e6 for name in pids}
    per_token["client"] = client_s / tokens * 1e6
    return {"tokens": tokens, "tokens_per_s": row["tokens_per_s"], "us_per_token": per_token}


def py_spy() -> str | None:
    found = shutil.which("py-spy")
    local = ROOT / ".venv-profile" / "bin" / "py-spy"
    return found or (str(local) if local.exists() else None)


async def profiled(base_url: str, model: str, pids: dict[str, int], args, spy: str) -> dict:
    """The same run with py-spy on each process; each one's folded samples."""
    folder = Path(tempfile.mkdtemp(prefix="tandem-cp-profile-"))
    recorders = {
        name: subprocess.Popen(
            [spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--nonblocking", "--gil"]
            + ["--format", "raw", "--output", str(folder / f"{name}.txt"), "--duration", "600"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for name, pid in pids.items()
    }
    await asyncio.sleep(1.0)  # attached
    async with HttpClient(base_url, model, fresh=False) as client:
        await run(client, 2 * args.n, args.clients, args.max_tokens, warmup=0)
    for recorder in recorders.values():
        recorder.send_signal(2)  # SIGINT: py-spy writes what it sampled and exits
    for recorder in recorders.values():
        recorder.wait(60)
    return {name: fold(folder / f"{name}.txt") for name in pids}


def fold(path: Path) -> dict:
    """py-spy's raw output (a stack per line, `frame;frame;... count`) as the top leaf frames
    and the top Tandem frames anywhere on the stack, each a share of the samples."""
    leaves, ours, total = Counter(), Counter(), 0
    if not path.exists():
        return {"samples": 0, "self": [], "inclusive": []}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        frames = [f for f in stack.split(";") if f]
        n = int(count)
        total += n
        if frames:
            leaves[_short(frames[-1])] += n
        for frame in {_short(f) for f in frames if _ours(f)}:
            ours[frame] += n

    def top(counter: Counter) -> list:
        return [[frame, n / total] for frame, n in counter.most_common(TOP)] if total else []

    return {"samples": total, "self": top(leaves), "inclusive": top(ours)}


def _ours(frame: str) -> bool:
    """A frame of Tandem's code (py-spy names files relative to the process's path, or whole)."""
    path = frame.partition(" (")[2]
    return path.startswith(("services/", "shared/")) or "/services/" in path or "/shared/" in path


def _short(frame: str) -> str:
    """`function (path/to/file.py:line)` as `function (file.py)`, the path cut to its last two
    parts (the line dropped: a function counts once)."""
    name, _, where = frame.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    return f"{name} ({'/'.join(path.split('/')[-2:])})"


def tandem(mode: str, args, spy: str | None) -> dict:
    with tandem_stack(f"cpp-{mode}", mode, ZERO_TIME) as stack:
        model = _served_model(stack.http_port)
        pids = {name: p.pid for name, p in stack.group.children}
        base = f"http://127.0.0.1:{stack.http_port}"
        out = asyncio.run(measured(base, model, pids, args))
        short, long = (asyncio.run(measured(base, model, pids, args, t)) for t in SPLIT_TOKENS)
        out["split"] = split(short, long)
        if spy:
            out["profile"] = asyncio.run(profiled(base, model, pids, args, spy))
    return out


def split(short: dict, long: dict) -> dict:
    """Each process's CPU as a cost per request plus a cost per token, from runs of requests
    of SPLIT_TOKENS[0] and SPLIT_TOKENS[1] tokens: us/token = per_token + per_request / length,
    solved from the two."""
    a, b = SPLIT_TOKENS
    out = {}
    for name in short["us_per_token"]:
        x, y = short["us_per_token"][name], long["us_per_token"][name]
        per_request = (x - y) / (1 / a - 1 / b)
        out[name] = {"per_request_us": per_request, "per_token_us": y - per_request / b}
    return out


def dynamo(mode: str, model_dir: Path, args) -> dict | None:
    if not available():
        return None
    with DynamoStack(model_dir, mode != "colocated") as stack:
        return asyncio.run(measured(stack.base_url, stack.model, stack.pids(), args))


def report(results: dict) -> str:
    lines = [
        "# Where a streamed token's CPU goes (zero-time mock engines)",
        "",
        f"`python bench/cp_profile.py {results['args']}` · {results['cores']} CPUs · "
        f"{results['n']} requests of {results['max_tokens']} tokens, {results['clients']} at a "
        "time, HTTP streaming (keep-alive). CPU is each process's user + system time over the "
        "run per token its responses' usage reports; measured without the profiler.",
        "",
        "| path | system | tokens/s | " + " | ".join(["process", "CPU µs per token"]) + " |",
        "| --- | --- | ---: | --- | ---: |",
    ]
    for mode, systems in results["modes"].items():
        for system, row in systems.items():
            if row is None:
                continue
            servers = sum(v for k, v in row["us_per_token"].items() if k != "client")
            cells = [*sorted(row["us_per_token"].items()), ("all but the client", servers)]
            for i, (name, us) in enumerate(cells):
                head = [mode, system, f"{row['tokens_per_s']:.0f}"] if i == 0 else ["", "", ""]
                lines.append("| " + " | ".join(head + [name, f"{us:.0f}"]) + " |")
    lines += [
        "",
        f"## Per request and per token (Tandem; runs of {SPLIT_TOKENS[0]}- and "
        f"{SPLIT_TOKENS[1]}-token requests, as many tokens in all)",
        "",
        "CPU µs per token = per token + per request / the request's length, solved from the "
        "two runs.",
        "",
        "| path | process | µs per request | µs per token | at "
        f"{results['max_tokens']} tokens a request: share per request |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    for mode, systems in results["modes"].items():
        for name, cost in sorted(((systems.get("tandem") or {}).get("split") or {}).items()):
            fixed = cost["per_request_us"] / results["max_tokens"]
            share = fixed / max(fixed + cost["per_token_us"], 1e-9)
            lines.append(
                f"| {mode} | {name} | {cost['per_request_us']:.0f} | "
                f"{cost['per_token_us']:.0f} | {share:.0%} |"
            )
    for mode, systems in results["modes"].items():
        profile = (systems.get("tandem") or {}).get("profile") or {}
        for name, folded in profile.items():
            if not folded["samples"]:
                continue
            lines += ["", f"## {mode}: {name} ({folded['samples']} samples)", ""]
            lines += ["| self (leaf frame) | share | Tandem frame on the stack | share |"]
            lines += ["| --- | ---: | --- | ---: |"]
            for i in range(max(len(folded["self"]), len(folded["inclusive"]))):
                a = folded["self"][i] if i < len(folded["self"]) else ["", None]
                b = folded["inclusive"][i] if i < len(folded["inclusive"]) else ["", None]
                cells = [f"`{a[0]}`", _pct(a[1]), f"`{b[0]}`" if b[0] else "", _pct(b[1])]
                lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pct(share: float | None) -> str:
    return "" if share is None else f"{100 * share:.1f}%"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("-n", type=int, default=256, help="requests per run")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rate", type=int, default=500, help="py-spy samples per second")
    parser.add_argument("--modes", default="colocated,disaggregated")
    args = parser.parse_args()
    model_dir = model_store.prepare("", os.path.expanduser("~/.cache/tandem/models"))
    spy = py_spy()
    results = {
        "args": " ".join(sys.argv[1:]) or "(defaults)",
        "cores": len(os.sched_getaffinity(0)),
        "n": args.n,
        "clients": args.clients,
        "max_tokens": args.max_tokens,
        "py_spy": spy,
        "modes": {},
    }
    for mode in args.modes.split(","):
        path = "aggregated" if mode == "colocated" else "disaggregated"
        results["modes"][path] = {
            "tandem": tandem(mode, args, spy),
            f"dynamo {dynamo_version()}" if available() else "dynamo": dynamo(
                mode, model_dir, args
            ),
        }
        print(json.dumps(results["modes"][path], indent=1)[:3000], flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "control-plane-profile.json").write_text(json.dumps(results, indent=1) + "\n")
    text = report(results)
    (OUT / "control-plane-profile.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
