"""The prefill-tax study's report: tables, SLOs, goodput, the bars, and plots (see bench/tax.py)."""

import json
import sys
from pathlib import Path

import numpy as np


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def rows_of(setup: dict, rate: str, tag: str) -> list[dict]:
    return [r for r in setup["runs"][rate] if r["tag"] == tag]


def steady_itl(setup: dict, rate: str) -> list[float]:
    return [v for r in rows_of(setup, rate, "steady") if r["ok"] for v in r["itl_ms"]]


def ttfts(setup: dict, rate: str, tag: str) -> list[float]:
    return [r["ttft_ms"] for r in rows_of(setup, rate, tag) if r["ok"] and r["ttft_ms"] is not None]


def slos(results: dict) -> dict:
    """From the no-interference runs, the slowest setup's figures (every setup can meet them)."""
    setups = results["setups"].values()
    return {
        "steady_ttft_ms": 3 * max(pct(ttfts(s, "0.0", "steady"), 90) for s in setups),
        "itl_ms": 1.5 * max(pct(steady_itl(s, "0.0"), 99) for s in setups),
        "long_ttft_ms_per_token": 3 * max(s["alone_ms_per_token"] for s in setups),
    }


def meets(row: dict, slo: dict) -> bool:
    if not row["ok"]:
        return False
    if row["tag"] == "steady":
        ttft_ok = row["ttft_ms"] <= slo["steady_ttft_ms"]
    else:
        ttft_ok = row["ttft_ms"] <= slo["long_ttft_ms_per_token"] * row["prompt_tokens"]
    return ttft_ok and (row["max_itl_ms"] is None or row["max_itl_ms"] <= slo["itl_ms"])


def goodput(setup: dict, rate: str, slo: dict, duration_s: float) -> float:
    return sum(meets(r, slo) for r in setup["runs"][rate]) / duration_s


def attainment(setup: dict, rate: str, tag: str, slo: dict) -> str:
    """Share of a class's requests (sent, not only completed) that met the SLO."""
    rows = rows_of(setup, rate, tag)
    return f"{sum(meets(r, slo) for r in rows)}/{len(rows)}" if rows else "-"


def table(results: dict, slo: dict) -> tuple[str, dict]:
    duration = results["args"]["duration_s"]
    lines = [
        "| setup | long prompts/s | steady ITL p50 ms | steady ITL p99 ms | ITL p99 / no-interference | "
        "steady TTFT p50 / p90 ms | long TTFT p50 / p90 ms | long done | failed | paths | "
        "met SLO: steady | met SLO: long | goodput req/s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    figures = {}
    for name, s in results["setups"].items():
        base = pct(steady_itl(s, "0.0"), 99)
        for rate in s["runs"]:
            itl = steady_itl(s, rate)
            st, lt = ttfts(s, rate, "steady"), ttfts(s, rate, "long")
            rows = s["runs"][rate]
            paths = {}
            for r in rows:
                paths[r["path"] or "-"] = paths.get(r["path"] or "-", 0) + 1
            f = figures.setdefault(name, {})[rate] = {
                "itl_p50": pct(itl, 50),
                "itl_p99": pct(itl, 99),
                "itl_ratio": pct(itl, 99) / base,
                "goodput": goodput(s, rate, slo, duration),
            }
            lines.append(
                f"| {name} | {rate} | {f['itl_p50']:.0f} | {f['itl_p99']:.0f} | {f['itl_ratio']:.2f}x | "
                f"{pct(st, 50):.0f} / {pct(st, 90):.0f} | "
                + (f"{pct(lt, 50):.0f} / {pct(lt, 90):.0f}" if lt else "-")
                + f" | {len(lt)}/{len(rows_of(s, rate, 'long'))} | {sum(not r['ok'] for r in rows)} | "
                f"{', '.join(f'{k} {v}' for k, v in sorted(paths.items()))} | "
                f"{attainment(s, rate, 'steady', slo)} | {attainment(s, rate, 'long', slo)} | {f['goodput']:.3f} |"
            )
    return "\n".join(lines), figures


def bars(figures: dict, rates: list[str]) -> list[str]:
    out = []
    if "disaggregated" in figures:
        worst = max(figures["disaggregated"][r]["itl_ratio"] for r in rates)
        colo = (
            max(figures["colocated"][r]["itl_ratio"] for r in rates)
            if "colocated" in figures
            else float("nan")
        )
        out.append(
            f"- disaggregated: steady ITL p99 with long prompts / without, worst rate: {worst:.2f}x "
            f"(bar <= 1.3x: {'met' if worst <= 1.3 else 'NOT met'}); colocated beside it: {colo:.2f}x"
        )
    if {"auto", "colocated", "disaggregated"} <= figures.keys():
        ok = all(
            figures["auto"][r]["goodput"]
            >= max(figures["colocated"][r]["goodput"], figures["disaggregated"][r]["goodput"])
            for r in rates
        )
        detail = "; ".join(
            f"rate {r}: auto {figures['auto'][r]['goodput']:.3f}, colocated "
            f"{figures['colocated'][r]['goodput']:.3f}, disaggregated "
            f"{figures['disaggregated'][r]['goodput']:.3f}"
            for r in rates
        )
        out.append(
            f"- goodput, auto >= the better of colocated and disaggregated at every rate: "
            f"{'met' if ok else 'NOT met'} ({detail})"
        )
    return out


def plots(results: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(next(iter(results["setups"].values()))["runs"])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    for name, s in results["setups"].items():
        for rate, style in ((rates[0], ":"), (rates[-1], "-")):
            itl = np.sort(steady_itl(s, rate))
            axes[0].plot(itl, np.linspace(0, 1, len(itl)), style, label=f"{name}, long/s {rate}")
        for rate in rates[1:]:
            rows = [r for r in s["runs"][rate] if r["ok"]]
            axes[1].scatter(
                [r["prompt_tokens"] for r in rows],
                [r["ttft_ms"] / 1000 for r in rows],
                s=10,
                label=f"{name}, long/s {rate}",
            )
    axes[0].set(
        xscale="log",
        xlabel="steady streams' inter-token latency (ms)",
        ylabel="CDF",
        title="ITL of the steady streams (dotted: no long prompts)",
    )
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="prompt tokens",
        ylabel="TTFT (s)",
        title="TTFT against prompt length",
    )
    for ax in axes:
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=110)
    plt.close(fig)


def write_report(results: dict, out: Path) -> None:
    slo = slos(results)
    text, figures = table(results, slo)
    rates = [r for r in next(iter(figures.values())) if r != "0.0"]
    a = results["args"]
    md = [
        "# The prefill tax: colocated, disaggregated and auto on one 2-core machine",
        "",
        f"Command: `python bench/tax.py --setups {a['setups']} --rates {','.join(map(str, a['rates']))} "
        f"--duration-s {a['duration_s']:.0f} --steady-output {a['steady_output']} "
        f"--long-output {a['long_output']} --seed {a['seed']}` (`make bench-tax`); one run.",
        *(["", f"Merged: {a['merged']}."] if a.get("merged") else []),
        "",
        "Workload and setups: see bench/tax.py. Rate 0.0 is the no-interference run.",
        "",
        text,
        "",
        f"SLOs (from the no-interference runs, slowest setup): steady TTFT <= {slo['steady_ttft_ms']:.0f} ms, "
        f"every ITL <= {slo['itl_ms']:.0f} ms, long prompt TTFT <= {slo['long_ttft_ms_per_token']:.1f} ms per "
        f"prompt token.",
        "",
        "Bars:",
        *bars(figures, rates),
        "",
        f"![ITL and TTFT]({out.name}.png)",
    ]
    Path(f"{out}.md").write_text("\n".join(md) + "\n")
    results["slo"], results["figures"] = slo, figures
    Path(f"{out}.json").write_text(json.dumps(results))
    plots(results, out)
    print("\n".join(md))


if __name__ == "__main__":  # re-render from a saved JSON
    path = Path(sys.argv[1])
    write_report(json.loads(path.read_text()), path.with_suffix(""))
