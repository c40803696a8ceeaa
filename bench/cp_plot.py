"""bench/results/control-plane.png: the control-plane bench's TTFT section as a plot (cp_report
writes it with the table): tokens/s and TTFT p50 by concurrency, Tandem against Dynamo, for
each path (aggregated, disaggregated) and HTTP front (keep-alive solid, fresh connections
dashed). Each point is its cell's median over the rounds (cp_report.by_cell)."""

from pathlib import Path

FRONTS = {"http-keepalive": "-", "http-fresh": "--"}
COLOURS = {"tandem": "tab:blue", "dynamo": "tab:orange"}


def plot(cells: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = sorted({c["path"] for c in cells})
    fig, axes = plt.subplots(2, len(paths), figsize=(6 * len(paths), 8), squeeze=False)
    for column, name in enumerate(paths):
        for row, (figure, label) in enumerate(
            (("tokens_per_s", "tokens/s"), ("ttft_ms_p50", "TTFT p50 (ms)"))
        ):
            ax = axes[row][column]
            for system, front, points in _series(cells, name, figure):
                colour = COLOURS["tandem" if system == "tandem" else "dynamo"]
                levels, values = zip(*points)
                ax.plot(levels, values, FRONTS[front], marker="o", color=colour)
                ax.plot([], [], FRONTS[front], color=colour, label=f"{system}, {front}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log" if figure == "ttft_ms_p50" else "linear")
            ax.set_xlabel("concurrent clients")
            ax.set_ylabel(label)
            ax.set_title(f"{name}: {label}")
            ax.legend(fontsize=7)
    fig.suptitle("Zero-time mock engines, 2 cores: Tandem against Dynamo (bench/control_plane.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _series(cells: list[dict], path: str, figure: str):
    """(system, front, [(concurrency, value), ...]) of one path's HTTP cells, by concurrency."""
    found: dict[tuple[str, str], list] = {}
    for c in cells:
        value = c.get(figure)
        if c["path"] == path and c["front"] in FRONTS and value and value == value:  # not NaN
            found.setdefault((c["system"], c["front"]), []).append((c["concurrency"], value))
    return [(system, front, sorted(points)) for (system, front), points in sorted(found.items())]
