"""The front-door benchmark's verdicts, table and plot (bench/front_door.py's results)."""

import os
from collections import Counter
from pathlib import Path

from bench.stream_clients import pct

RATIO_BAR = 2.0
RSS_BAR_MIB = 256.0
TURNED_AWAY_S = 1.0  # a stalled connection closed sooner was refused, not timed out


def _attacks(out: dict) -> dict:
    return {k: v for k, v in out["phases"].items() if k != "unloaded"}


def rss_growth(out: dict) -> dict:
    """Per attack phase and over all: peak RSS less the RSS before the first attack (MiB)."""
    base = out["phases"]["unloaded"]["rss_mib"][-1][1]
    growth = {k: max(m for _, m in p["rss_mib"]) - base for k, p in _attacks(out).items()}
    return {"baseline_mib": base, "phases": growth, "max": max(growth.values(), default=0.0)}


def half_open_summary(connections: list[dict], args) -> dict:
    stalled = [c for c in connections if not c["how"].startswith("connect failed")]
    closed = [c for c in stalled if c["closed_after_s"] is not None]
    timed_out = [c["closed_after_s"] for c in closed if c["closed_after_s"] >= TURNED_AWAY_S]
    held = [c["held_s"] for c in stalled]
    return {
        "stalled": len(stalled),
        "connect_failed": len(connections) - len(stalled),
        "closed_by_gateway": len(closed),
        "turned_away": len(closed) - len(timed_out),
        "closed_after_s": {"p50": pct(timed_out, 50), "max": max(timed_out, default=None)},
        "open_at_end": len(stalled) - len(closed),
        "longest_held_s": max(held, default=0.0),
        "answers": dict(Counter(c["answer"] or "(none)" for c in closed)),
        "bar_s": args.stall_timeout_s + args.close_grace_s,
    }


def attack_summary(attack: dict) -> dict:
    """Per body kind: statuses and latency percentiles."""
    out = {}
    for kind, r in attack.items():
        if isinstance(r, dict) and "statuses" in r:
            lat = r["latencies_ms"]
            out[kind] = {"statuses": r["statuses"], "p50_ms": pct(lat, 50), "p99_ms": pct(lat, 99)}
    return out


def _bar(value: str, bar: str, ok: bool) -> dict:
    return {"value": value, "bar": bar, "pass": bool(ok)}


def verdicts(out: dict, args) -> dict:
    base = out["phases"]["unloaded"]
    bars = {}
    for kind, p in _attacks(out).items():
        for metric in ("ttft_ms", "itl_ms"):
            ratio = p[metric]["p99"] / base[metric]["p99"]
            bars[f"{kind}: {metric[:-3].upper()} p99 ratio"] = _bar(
                f"{ratio:.2f}", f"<= {RATIO_BAR}", ratio <= RATIO_BAR
            )
        bars[f"{kind}: normal client's failures"] = _bar(
            str(sum(p["failures"].values())), "0", not p["failures"]
        )
    growth = rss_growth(out)["max"]
    bars["gateway RSS growth under attack (MiB)"] = _bar(
        f"{growth:.0f}", f"< {RSS_BAR_MIB:.0f}", growth < RSS_BAR_MIB
    )
    deep = [s for p in _attacks(out).values() for s in p["attack"]["deep_json"].values()]
    bars["deeply nested JSON"] = _bar(", ".join(deep), "400", deep and set(deep) == {"400"})
    if "half_open" in out["phases"]:
        h = half_open_summary(out["phases"]["half_open"]["attack"]["connections"], args)
        bars["stalled connections: longest held (s)"] = _bar(
            f"{h['longest_held_s']:.1f}", f"<= {h['bar_s']:.0f}", h["longest_held_s"] <= h["bar_s"]
        )
    restarts = len(out["gateway_pids"]) - 1
    bars["gateway restarts"] = _bar(str(restarts), "0", restarts == 0)
    return bars


def _row(kind: str, p: dict, base: dict, growth: dict, args) -> str:
    t, i = p["ttft_ms"], p["itl_ms"]
    ratios = f"{t['p99'] / base['ttft_ms']['p99']:.2f} | {i['p99'] / base['itl_ms']['p99']:.2f}"
    attack = attack_summary(p.get("attack", {}))
    outcomes = "; ".join(f"{k}: {v['statuses']}" for k, v in attack.items()) or "-"
    if "connections" in p.get("attack", {}):
        h = half_open_summary(p["attack"]["connections"], args)
        outcomes = (
            f"{h['stalled']} stalled, {h['closed_by_gateway']} closed by the gateway "
            f"({h['turned_away']} at once), {h['open_at_end']} open at the end"
        )
    deep = ", ".join(p.get("attack", {}).get("deep_json", {}).values()) or "-"
    rss = f"{growth[kind]:+.0f}" if kind in growth else "-"
    return (
        f"| {kind} | {p['requests']} | {sum(p['failures'].values())} | {t['p50']:.0f} / "
        f"{t['p99']:.0f} | {i['p50']:.1f} / {i['p99']:.1f} | {ratios} | {rss} | {outcomes} | "
        f"{deep} |"
    )


def _pinning(args) -> str:
    if not (args.gateway_cpus or args.attacker_cpus):
        return "Nothing pinned but the workers (`tandem up` gives each worker cores of its own)."
    return (
        f"Gateway pinned to cores {args.gateway_cpus or 'any'}, the attacking process to "
        f"{args.attacker_cpus or 'any'} (`--gateway-cpus`, `--attacker-cpus`): on a machine that "
        "also runs the workers, an attacker's own CPU taken from the gateway's cores, as a remote "
        "attacker's would be, not from a worker's."
    )


def _cores_table(out: dict) -> list[str]:
    """Where the machine's CPU went while the normal client was measured, in cores."""
    names = sorted({n for p in out["phases"].values() for n in p.get("cores", {})})
    lines = [
        "CPU used while the normal client was measured, in cores (CPU seconds per second; the "
        f"machine has {os.cpu_count()}):",
        "",
        "| phase | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for kind, p in out["phases"].items():
        cores = p.get("cores", {})
        lines.append(f"| {kind} | " + " | ".join(f"{cores.get(n, 0):.2f}" for n in names) + " |")
    return lines


def report(out: dict, args) -> str:
    base, growth = out["phases"]["unloaded"], rss_growth(out)
    lines = [
        "# Front door: a normal client while another holds the gateway (issue 45)",
        "",
        f"`python bench/front_door.py` (`make bench-front-door`) on `tandem up` defaults; "
        f"model {out['model']}; phases of {args.phase_s:.0f} s. Normal client: 127.0.0.1, one "
        f"streamed chat request at a time, max_tokens {32}. Attacker: 127.0.0.2; deep JSON: "
        f"127.0.0.3. Gateway RSS before the first attack: {growth['baseline_mib']:.0f} MiB. "
        + _pinning(args),
        "",
        "| phase | normal requests | failed | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | "
        "TTFT p99 ratio | ITL p99 ratio | gateway RSS growth (MiB) | attack statuses | deep JSON |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [_row(k, p, base, growth["phases"], args) for k, p in out["phases"].items()]
    if "half_open" in out["phases"]:
        lines += ["", _half_open_text(out["phases"]["half_open"]["attack"]["connections"], args)]
    lines += [
        "",
        "| attack | body | statuses | latency p50 / p99 (ms) |",
        "| --- | --- | --- | --- |",
    ]
    for kind, p in _attacks(out).items():
        for body, a in attack_summary(p["attack"]).items():
            lines.append(
                f"| {kind} | {body} | {a['statuses']} | {a['p50_ms']:.0f} / {a['p99_ms']:.0f} |"
            )
    lines += ["", *_cores_table(out)]
    lines += ["", "| bar | value | target | verdict |", "| --- | --- | --- | --- |"]
    for name, b in out["bars"].items():
        lines.append(f"| {name} | {b['value']} | {b['bar']} | {'PASS' if b['pass'] else 'FAIL'} |")
    return "\n".join(lines) + "\n"


def _half_open_text(connections: list[dict], args) -> str:
    h = half_open_summary(connections, args)
    closed = h["closed_after_s"]
    timing = (
        f"closed {closed['p50']:.1f} s (p50) / {closed['max']:.1f} s (max) after their last byte"
        if closed["max"] is not None
        else "none closed after waiting"
    )
    return (
        f"Stalled connections: {h['stalled']} held ({h['connect_failed']} failed to connect); "
        f"{h['closed_by_gateway']} closed by the gateway, {h['turned_away']} of them at once "
        f"(< {TURNED_AWAY_S:.0f} s), the others {timing}; {h['open_at_end']} still open at the end; "
        f"longest held {h['longest_held_s']:.1f} s (bar <= {h['bar_s']:.0f} s); the gateway's "
        f"answers: {h['answers']}."
    )


def plot(out: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (lat, rss, close) = plt.subplots(1, 3, figsize=(16, 4.5))
    kinds = list(out["phases"])
    base = out["phases"]["unloaded"]
    for n, (metric, label) in enumerate((("ttft_ms", "TTFT p99"), ("itl_ms", "ITL p99"))):
        values = [out["phases"][k][metric]["p99"] / base[metric]["p99"] for k in kinds]
        lat.bar([x + n * 0.4 for x in range(len(kinds))], values, 0.4, label=label)
    lat.axhline(RATIO_BAR, color="red", linestyle="--", label="bar")
    lat.set_xticks([x + 0.2 for x in range(len(kinds))], kinds, rotation=15)
    lat.set(ylabel="ratio to unloaded", title="normal client's p99 / unloaded")
    lat.legend()
    for kind in kinds:
        samples = out["phases"][kind]["rss_mib"]
        rss.plot([t for t, _ in samples], [m for _, m in samples], label=kind)
    rss.set(xlabel="s", ylabel="MiB", title="gateway RSS")
    rss.legend()
    if "half_open" in out["phases"]:
        conns = out["phases"]["half_open"]["attack"]["connections"]
        closed = [c["held_s"] for c in conns if c["closed_after_s"] is not None]
        still = [c["held_s"] for c in conns if c["how"] == "open"]
        close.hist([closed, still], bins=40, stacked=True, label=["closed", "open at the end"])
        close.axvline(args.stall_timeout_s + args.close_grace_s, color="red", linestyle="--")
        close.legend()
    close.set(
        xlabel="s since the last byte sent", ylabel="connections", title="stalled connections"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
