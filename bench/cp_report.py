"""bench/results/control-plane.md from the control-plane bench's JSON files.

python bench/cp_report.py [results JSON ...]   (default: every control-plane*.json there)
"""

import json
import math
import statistics
import sys
from pathlib import Path

from cp_plot import plot

OUT = Path(__file__).resolve().parent / "results"


CELL = ("path", "system", "front", "concurrency")
TTFT_LEVELS = (1, 8, 32)  # issue 49's TTFT bar: Tandem / Dynamo TTFT p50 at most
TTFT_BAR = {"aggregated": 1.0, "disaggregated": 1.3}
THROUGHPUT_LEVELS = (32, 128)  # issue 49: tokens/s at least Dynamo's
ENGINE_TOKENS_PER_S = 47_000  # the engine alone on an H200 (bench/results/gpu-check.md)
CPU_GOAL_US = 60.0  # issue 49's goal: CPU per token across Tandem's processes, client excluded
FIGURES = (
    "ttft_ms_p50",
    "ttft_ms_p99",
    "gateway_ttft_ms_p50",
    "itl_ms_p50",
    "itl_ms_p99",
    "req_per_s",
    "tokens_per_s",
)


def by_cell(rows: list[dict]) -> list[dict]:
    """One row per cell (path, system, front, concurrency): each figure's median over the
    rounds it was measured in, and each round's TTFT p50 (`rounds`: round -> ms)."""
    cells: dict[tuple, list[dict]] = {}
    for r in rows:
        cells.setdefault(tuple(r[k] for k in CELL), []).append(r)
    merged = []
    for key, found in cells.items():
        row = dict(zip(CELL, key))
        for name in FIGURES:
            values = [x[name] for x in found if not math.isnan(x.get(name, math.nan))]
            row[name] = statistics.median(values) if values else math.nan
        row["rounds"] = {x.get("round", 0): x["ttft_ms_p50"] for x in found}
        row["cpu"] = _cpu(found)
        merged.append(row)
    return merged


def _cpu(found: list[dict]) -> dict[str, float]:
    """Each process's CPU microseconds per token, the median over the rounds that counted it."""
    names = {n for x in found for n in x.get("cpu_us_per_token", {})}
    return {
        n: statistics.median(
            x["cpu_us_per_token"][n] for x in found if n in x.get("cpu_us_per_token", {})
        )
        for n in sorted(names)
    }


def servers_cpu(row: dict) -> float:
    """CPU microseconds per token of every process but the client (nan: not measured)."""
    cpu = row.get("cpu") or {}
    return sum(v for n, v in cpu.items() if n != "client") if cpu else math.nan


def _spread(values, digits: int = 1) -> str:
    values = list(values)
    return f" ({min(values):.{digits}f}-{max(values):.{digits}f})" if len(values) > 1 else ""


def ttft_table(rows: list[dict]) -> list[str]:
    lines = [
        "| path | system | front | conc | TTFT p50 (rounds' range) | TTFT p99 | gateway's TTFT p50 | "
        "ITL p50 | ITL p99 | req/s | tokens/s | server CPU µs/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        inside = r.get("gateway_ttft_ms_p50", float("nan"))
        lines.append(
            f"| {r['path']} | {r['system']} | {r['front']} | {r['concurrency']} | "
            f"{r['ttft_ms_p50']:.2f}{_spread(r['rounds'].values())} | {r['ttft_ms_p99']:.2f} | "
            f"{'' if inside != inside else f'{inside:.2f}'} | {r['itl_ms_p50']:.3f} | "
            f"{r['itl_ms_p99']:.2f} | {r['req_per_s']:.0f} | {r.get('tokens_per_s', 0):.0f} | "
            f"{_num(servers_cpu(r))} |"
        )
    return lines


def _num(value: float, digits: int = 0) -> str:
    return "" if value != value else f"{value:.{digits}f}"


def cpu_table(rows: list[dict]) -> list[str]:
    """CPU per token by process, at 32 and 128 clients over keep-alive HTTP."""
    lines = [
        "| path | system | conc | process: CPU µs per token | all but the client |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r["front"] != "http-keepalive" or r["concurrency"] < 32 or not r.get("cpu"):
            continue
        each = ", ".join(f"{n} {v:.0f}" for n, v in r["cpu"].items())
        lines.append(
            f"| {r['path']} | {r['system']} | {r['concurrency']} | {each} | {servers_cpu(r):.0f} |"
        )
    return lines


def _peer(rows: list[dict], r: dict) -> dict | None:
    """Dynamo's row to set beside Tandem's: the same front (HTTP, fresh or keep-alive), and for
    gRPC (Dynamo has none) Dynamo's best front at that level."""
    same = [
        p
        for p in rows
        if p["system"].startswith("dynamo")
        and p["path"] == r["path"]
        and p["concurrency"] == r["concurrency"]
    ]
    exact = [p for p in same if p["front"] == r["front"]]
    return (exact or sorted(same, key=lambda p: p["ttft_ms_p50"]) or [None])[0]


def _stalled(rows: list[dict], peer: dict) -> bool:
    """Dynamo's keep-alive row is one stall per request (over 5x its fresh connections' TTFT,
    as at concurrency 1: ~43 ms against ~2-4), not a figure to beat."""
    fresh = [
        p
        for p in rows
        if p["system"] == peer["system"]
        and p["front"] == "http-fresh"
        and p["path"] == peer["path"]
        and p["concurrency"] == peer["concurrency"]
    ]
    return (
        peer["front"] == "http-keepalive"
        and bool(fresh)
        and (peer["ttft_ms_p50"] > 5 * fresh[0]["ttft_ms_p50"])
    )


def ratios(rows: list[dict]) -> list[str]:
    """Tandem's TTFT p50 over Dynamo's, front for front (gRPC: over Dynamo's best), of the
    rounds' medians; the range of the ratio within each round beside it."""
    lines = [
        "| path | conc | Tandem front | Dynamo front | Tandem / Dynamo TTFT p50 (rounds' range) "
        "| bar |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        peer = _peer(rows, r) if r["system"] == "tandem" else None
        if peer is None:
            continue
        ratio = r["ttft_ms_p50"] / peer["ttft_ms_p50"]
        each = [r["rounds"][k] / peer["rounds"][k] for k in r["rounds"] if k in peer["rounds"]]
        if r["concurrency"] not in TTFT_LEVELS:
            continue
        bar = TTFT_BAR[r["path"]]
        verdict = "met" if ratio <= bar else "NOT met"
        if _stalled(rows, peer):
            verdict = "not counted: Dynamo's keep-alive stalls (~40 ms a request)"
        lines.append(
            f"| {r['path']} | {r['concurrency']} | {r['front']} | {peer['front']} | "
            f"{ratio:.2f}{_spread(each, 2)} | <= {bar} {verdict} |"
        )
    return lines


def throughput(rows: list[dict]) -> list[str]:
    """Issue 49's throughput bar: Tandem's tokens/s at 32 and 128 clients at least Dynamo's,
    front for front; and its CPU goal: 60 µs a token across its processes."""
    lines = [
        "| path | conc | front | Tandem tokens/s | Dynamo tokens/s | Tandem / Dynamo (bar >= 1) "
        "| Tandem server CPU µs/token (goal <= 60) | Dynamo's |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["system"] != "tandem" or r["concurrency"] not in THROUGHPUT_LEVELS:
            continue
        peer = _peer(rows, r)
        if peer is None or peer["front"] != r["front"]:
            continue
        ratio = r["tokens_per_s"] / peer["tokens_per_s"]
        cpu, theirs = servers_cpu(r), servers_cpu(peer)
        lines.append(
            f"| {r['path']} | {r['concurrency']} | {r['front']} | {r['tokens_per_s']:.0f} | "
            f"{peer['tokens_per_s']:.0f} | {ratio:.2f} {'met' if ratio >= 1 else 'NOT met'} | "
            f"{_num(cpu)} {'met' if cpu <= CPU_GOAL_US else 'NOT met'} | {_num(theirs)} |"
        )
    return lines


def render(results: dict) -> list[str]:
    lines = []
    if "ttft" in results:
        cells = by_cell(results["ttft"])
        rounds = len({r.get("round", 0) for r in results["ttft"]})
        lines += [
            "## TTFT and ITL, zero-time mock engines (ms)",
            "",
            f"Each figure is its cell's median over {rounds} round(s); Tandem and Dynamo measured "
            "one after the other in each round.",
            "",
            *ttft_table(cells),
        ]
        lines += [
            "",
            "Time to first token (issue 49: at or below Dynamo's aggregated, at most 1.3x "
            "disaggregated, at 1, 8 and 32 clients):",
            "",
            *ratios(cells),
            "",
            "Throughput and CPU (issue 49: tokens/s at least Dynamo's at 32 and 128 clients; "
            "the goal, at most 60 µs of CPU per token across Tandem's processes, the client "
            "excluded):",
            "",
            *throughput(cells),
            "",
            "CPU per token by process (keep-alive HTTP):",
            "",
            *cpu_table(cells),
            "",
        ]
    if "messages" in results:
        m = results["messages"]
        lines += [
            "## NATS messages per generated token",
            "",
            f"{m['streams_per_worker']} concurrent streams on one worker, {m['requests']} requests "
            f"of {m['max_tokens']} tokens, mock at the real engine's pace: {m['nats_messages']} "
            f"messages for {m['tokens']:.0f} tokens = **{m['messages_per_token']:.3f} per token** "
            "(every message nats-server received, heartbeats included; bar <= 0.1).",
            "",
        ]
    if "fleet" in results:
        f, s = results["fleet"], results["fleet"]["cluster_status"]
        lines += [
            f"## {f['workers']} mock workers on one scheduler",
            "",
            f"{f['processes']} processes of {f['workers'] // f['processes']} workers, "
            f"heartbeat every {f['heartbeat_interval_s']} s, all on the same 2 cores.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| scheduler CPU while they heartbeat (idle) | {f['scheduler_cpu_share_idle']:.0%} of a core |",
            f"| ClusterStatus | {s['workers']} workers, {s['bytes'] / 1024:.0f} KiB, {s['ms_median']:.0f} ms (median of 5) |",
            f"| routing time (scheduler histogram) | p50 <= {f['routing']['p50_at_most_ms']:g} ms, p99 <= {f['routing']['p99_at_most_ms']:g} ms |",
            *[
                f"| TTFT through the gateway at concurrency {c} | p50 {p['ttft_ms_p50']:.1f} ms, p99 {p['ttft_ms_p99']:.1f} ms |"
                for c, p in f["placement"].items()
            ],
            "",
        ]
    if "gateway" in results:
        step_ms = 1000 * results["gateway"][0].get("step_s", 0.02) if results["gateway"] else 0
        lines += [
            f"## One gateway's streams (mock steps of {step_ms:g} ms each)",
            "",
            "Gateway processes an engine of 47,000 tokens/s (the H200's, bench/results/gpu-check.md) "
            "would need at this cost: 47,000 x its CPU per token.",
            "",
            "| streams | tokens/s | ITL p50 | ITL p99 | added ITL p99 (client) | gateway's own p50 / p99 (token wait) | gateway cores | tokens/s per gateway core | gateway CPU µs/token | gateways for 47,000 tokens/s |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in results["gateway"]:
            per_token = 1e6 / r["tokens_per_gateway_core"]
            lines.append(
                f"| {r['streams']} | {r['tokens_per_s']:.0f} | {r['itl_ms_p50']:.1f} | "
                f"{r['itl_ms_p99']:.1f} | {r['added_itl_ms_p99']:.1f} | {_wait(r)} | "
                f"{r['gateway_cores']:.2f} | "
                f"{r['tokens_per_gateway_core']:.0f} | {per_token:.0f} | "
                f"{ENGINE_TOKENS_PER_S * per_token / 1e6:.1f} |"
            )
        lines.append("")
    return lines


def _wait(row: dict) -> str:
    w = row.get("gateway_wait")
    return f"<= {w['p50_at_most_ms']:g} / <= {w['p99_at_most_ms']:g} ms" if w else "-"


def main(paths: list[str]) -> int:
    found = sorted(OUT.glob("control-plane*.json"))
    others = ("control-plane-floor.json", "control-plane-profile.json")  # reports of their own
    files = [Path(p) for p in paths] or [p for p in found if p.name not in others]
    lines = ["# The control plane on mock engines, against NVIDIA Dynamo", ""]
    for path in files:
        results = json.loads(path.read_text())
        lines += [f"From `{path.name}` (`python bench/control_plane.py {_args(results)}`).", ""]
        lines += render(results)
        if "ttft" in results:
            plot(by_cell(results["ttft"]), OUT / "control-plane.png")
            lines += ["Plotted in `control-plane.png`.", ""]
    (OUT / "control-plane.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


def _args(results: dict) -> str:
    a = results.get("args", {})
    rounds = f" --rounds {a['rounds']}" if "ttft" in a.get("sections", "") and "rounds" in a else ""
    return f"--sections {a.get('sections', '')} -n {a.get('n', '')}{rounds}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
