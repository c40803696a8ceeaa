"""PNG plots of a run: latency CDFs (TTFT, TPOT, ITL, E2E) and TTFT against prompt length.

matplotlib is an optional dependency (the `bench` extra); it is imported only here, when a plot
is asked for.
"""

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from shared.benchmark.client import RequestRecord
from shared.benchmark.metrics import request_metrics

INSTALL_HINT = "the plots need matplotlib: pip install -e '.[bench]' (or pass --no-plots)"


class MatplotlibMissing(ImportError):
    pass


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise MatplotlibMissing(INSTALL_HINT) from None
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    return plt


def latency_values(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    per = [request_metrics(r) for r in records if r.ok]
    return {
        "TTFT": [m.ttft_ms for m in per if m.ttft_ms is not None],
        "TPOT": [m.tpot_ms for m in per if m.tpot_ms is not None],
        "ITL": [v for m in per for v in m.itl_ms],
        "E2E": [m.e2e_ms for m in per],
    }


def write_plots(out_dir: Path, stem: str, records: Sequence[RequestRecord]) -> list[Path]:
    plt = pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{stem}-latency-cdf.png", out_dir / f"{stem}-ttft-vs-prompt.png"]
    _cdfs(plt, latency_values(records), stem).savefig(paths[0], dpi=110)
    _ttft_scatter(plt, records, stem).savefig(paths[1], dpi=110)
    plt.close("all")
    return paths


def _cdfs(plt, values: dict[str, list[float]], title: str):
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, data) in zip(axes.flat, values.items()):
        if data:
            xs = np.sort(data)
            ax.step(xs, np.arange(1, len(xs) + 1) / len(xs), where="post")
            for q, style in ((50, ":"), (99, "--")):
                ax.axvline(np.percentile(xs, q), color="grey", linestyle=style, label=f"p{q}")
            ax.legend(loc="lower right")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
        ax.set(
            title=name,
            xlabel="ms",
            ylabel="fraction of " + ("tokens" if name == "ITL" else "requests"),
        )
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: latency CDFs (completed requests)")
    fig.tight_layout()
    return fig


def _ttft_scatter(plt, records: Sequence[RequestRecord], title: str):
    fig, ax = plt.subplots(figsize=(7, 5))
    done = [(r, request_metrics(r)) for r in records if r.ok and r.chunk_times]
    for tag in sorted({r.tag for r, _ in done}):
        points = [(r.prompt_tokens or r.prompt_len, m.ttft_ms) for r, m in done if r.tag == tag]
        ax.scatter(*zip(*points), s=12, alpha=0.7, label=tag or None)
    if len({r.tag for r, _ in done}) > 1:
        ax.legend()
    ax.set(title=f"{title}: TTFT against prompt length", xlabel="prompt tokens", ylabel="TTFT (ms)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig
