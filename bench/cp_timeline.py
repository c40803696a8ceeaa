"""One request's path through every process, from the kernel's own clock (issue 49: the hops to
the first token at 1 client).

    sudo python bench/cp_timeline.py [colocated|disaggregated] [--requests 8] [--show 5]
        [--max-tokens 4] [--window-ms 8]

Starts a zero-time mock stack (as bench/control_plane.py), warms it up, then records with the
kernel's tracefs (root; /sys/kernel/tracing) the syscalls that move messages (sendto, recvfrom,
writev, read, write), each epoll sleep and wake-up, and the scheduler's wake-ups and switches,
while `--requests` streamed chat completions run one after another (keep-alive, greedy). No
profiler is attached: each event costs the traced process about a microsecond. Prints request
`--show`'s events from its client's send on for `--window-ms`, in microseconds, each named by its
process and thread, and keeps the raw trace in a temporary file (its path is printed).

Reading it: a process's `recvfrom` of a message to its next `sendto` is its own time; a
`WAKE` to that thread's first event is the wake-up's latency; the NATS server's reads and writes
are its hops.
"""

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from control_plane import ZERO_TIME, _served_model, tandem_stack  # noqa: E402
from stream_clients import HttpClient, run  # noqa: E402

TRACEFS = Path("/sys/kernel/tracing")
EVENTS = (
    "syscalls/sys_enter_sendto",
    "syscalls/sys_exit_recvfrom",
    "syscalls/sys_enter_writev",
    "syscalls/sys_exit_read",
    "syscalls/sys_enter_write",
    "syscalls/sys_enter_epoll_wait",
    "syscalls/sys_exit_epoll_wait",
    "syscalls/sys_enter_epoll_pwait",
    "syscalls/sys_exit_epoll_pwait",
    "sched/sched_wakeup",
    "sched/sched_switch",
)
LINE = re.compile(r"\s*(.+?)-(\d+)\s+\[(\d+)\] \S+\s+([\d.]+): (.*)")


def _write(name: str, value: str) -> None:
    (TRACEFS / name).write_text(value)


def _threads(pids: dict[str, int]) -> dict[int, str]:
    """Every thread of the stack's processes and this one: tid -> "process:thread name"."""
    named = {}
    for process, pid in pids.items():
        for tid in os.listdir(f"/proc/{pid}/task"):
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            named[int(tid)] = f"{process}:{comm}"
    return named


async def _requests(base_url: str, model: str, n: int, max_tokens: int) -> list[float]:
    """Each request's TTFT (ms), one after another on one connection."""
    body = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ttfts = []
    async with aiohttp.ClientSession() as session:
        for i in range(n):
            messages = [{"role": "user", "content": f"timeline {i}"}]
            started, first = time.perf_counter(), None
            url = base_url + "/v1/chat/completions"
            async with session.post(url, json={**body, "messages": messages}) as reply:
                async for line in reply.content:
                    if first is None and b'"content"' in line:
                        first = time.perf_counter()
            ttfts.append(((first or time.perf_counter()) - started) * 1000)
    return ttfts


def _event(rest: str, threads: dict[int, str]) -> str | None:
    """An event as the timeline shows it; None for one of no interest."""
    if rest.startswith("sched_wakeup"):
        tid = int(re.search(r"pid=(\d+)", rest).group(1))
        return f"WAKE {threads[tid]}/{tid}" if tid in threads else None
    if rest.startswith("sched_switch"):
        prev = int(re.search(r"prev_pid=(\d+)", rest).group(1))
        nxt = int(re.search(r"next_pid=(\d+)", rest).group(1))
        if prev not in threads and nxt not in threads:
            return None
        state = re.search(r"prev_state=(\S+)", rest).group(1)
        return f"SWITCH {threads.get(prev, '-')}/{prev} {state} -> {threads.get(nxt, '-')}/{nxt}"
    if "epoll_wait(" in rest or "epoll_pwait(" in rest:
        return None if "timeout: 0)" in rest else "epoll sleep"
    if "epoll_wait ->" in rest or "epoll_pwait ->" in rest:
        return None if rest.endswith("0x0") else "epoll wake"
    return rest[:90]


def timeline(trace: str, threads: dict[int, str], show: int, window_s: float) -> list[str]:
    """Request `show`'s events (from its client's send), each µs after it."""
    events = []
    for line in trace.splitlines():
        m = LINE.match(line)
        if not m:
            continue
        comm, tid, cpu, at, rest = m.groups()
        who = threads.get(int(tid))
        shown = _event(rest, threads)
        if shown is None or (who is None and not rest.startswith("sched_")):
            continue
        events.append((float(at), cpu, who or comm, shown))
    sends = [i for i, e in enumerate(events) if e[2].startswith("client") and "sendto" in e[3]]
    if len(sends) <= show:
        return [f"only {len(sends)} requests were traced"]
    start = events[sends[show]][0]
    return [
        f"{(at - start) * 1e6:8.0f} cpu{cpu} {who:28s} {what}"
        for at, cpu, who, what in events[sends[show] :]
        if at - start <= window_s
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", nargs="?", default="colocated")
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--show", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--window-ms", type=float, default=8.0)
    args = parser.parse_args()
    if not (TRACEFS / "trace").exists() or not os.access(TRACEFS / "trace", os.W_OK):
        print(f"needs root and tracefs at {TRACEFS}", file=sys.stderr)
        return 2
    with tandem_stack("timeline", args.mode, ZERO_TIME) as stack:
        pids = {name: proc.pid for name, proc in stack.group.children}
        model = _served_model(stack.http_port)
        base_url = f"http://127.0.0.1:{stack.http_port}"
        asyncio.run(_warm(base_url, model))
        _write("trace", "")
        _write("buffer_size_kb", "20000")
        for event in EVENTS:
            _write(f"events/{event}/enable", "1")
        _write("tracing_on", "1")
        try:
            ttfts = asyncio.run(_requests(base_url, model, args.requests, args.max_tokens))
        finally:
            _write("tracing_on", "0")
            for event in EVENTS:
                _write(f"events/{event}/enable", "0")
        threads = _threads({**pids, "client": os.getpid()})
        trace = (TRACEFS / "trace").read_text()
    with tempfile.NamedTemporaryFile("w", prefix="tandem-timeline-", delete=False) as raw:
        raw.write(trace)
    print("raw trace:", raw.name)
    print("TTFT ms:", " ".join(f"{t:.2f}" for t in ttfts))
    print("\n".join(timeline(trace, threads, args.show, args.window_ms / 1000)))
    return 0


async def _warm(base_url: str, model: str) -> None:
    async with HttpClient(base_url, model, False) as client:
        await run(client, 64, 4, 8, warmup=0)


if __name__ == "__main__":
    sys.exit(main())
