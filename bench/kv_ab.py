"""KV transfer and TTFT, an old revision against a new one, alternating in one run (`make bench-kv-ab`).

A change to the KV path must not cost throughput or time to first token. This checks out both
revisions into temporary worktrees and runs each one's own `bench/kv.py` there, in turn: old,
new, new, old, ... (so drift of a shared machine falls on both alike), with the same arguments;
each run's kv.json stays in its worktree. The medians of each side, and new / old, go to
bench/results/kv-ab.{md,json,png}. Only what both revisions measure is compared ("ours": one run
of blocks each side; "ours, 4 runs": fragmented pools; TTFT with and without overlap).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
COMPARED = ("ours_gbps", "frag_gbps")  # transfer columns both revisions have
TTFT_KEYS = ("ttft_ms", "kv_exposed_ms")


def worktree(rev: str, into: Path) -> str:
    """A detached worktree of `rev` at `into`; its commit id."""
    commit = subprocess.check_output(["git", "rev-parse", rev], cwd=ROOT, text=True).strip()
    subprocess.check_call(["git", "worktree", "add", "-q", "--detach", str(into), commit], cwd=ROOT)
    return commit


def run_side(tree: Path, kv_args: list[str]) -> dict:
    """One run of that tree's bench/kv.py (its own code on sys.path first), its kv.json."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    started = time.monotonic()
    subprocess.check_call([sys.executable, "bench/kv.py", *kv_args], cwd=tree, env=env)
    result = json.loads((tree / "bench" / "results" / "kv.json").read_text())
    print(f"  {tree.name}: {time.monotonic() - started:.0f}s", flush=True)
    return result


def medians(runs: list[dict]) -> tuple[dict, dict]:
    """(layout, tokens) -> {column: median}; TTFT setting -> {key: median}."""
    cells: dict[tuple, dict[str, list[float]]] = {}
    for run in runs:
        for row in run["transfers"]:
            cell = cells.setdefault((row["layout"], row["tokens"]), {k: [] for k in COMPARED})
            for key in COMPARED:
                cell[key].append(row[key])
    ttft: dict[str, dict[str, list[float]]] = {}
    for run in runs:
        for row in run["ttft"]:
            cell = ttft.setdefault(row["setting"], {k: [] for k in TTFT_KEYS})
            for key in TTFT_KEYS:
                cell[key].append(row[key])

    def med(d):
        return {k: {c: statistics.median(v) for c, v in cols.items()} for k, cols in d.items()}

    return med(cells), med(ttft)


def compare(old: list[dict], new: list[dict]) -> dict:
    (old_t, old_f), (new_t, new_f) = medians(old), medians(new)
    transfers = []
    for layout, tokens in sorted(old_t.keys() & new_t.keys()):
        old_cell, new_cell = old_t[layout, tokens], new_t[layout, tokens]
        row = dict(layout=layout, tokens=tokens)
        for k in COMPARED:
            row[f"old_{k}"], row[f"new_{k}"] = old_cell[k], new_cell[k]
            row[f"{k}_new_vs_old"] = new_cell[k] / old_cell[k]
        transfers.append(row)
    ttft = [
        dict(
            setting=setting,
            **{f"old_{k}": old_f[setting][k] for k in TTFT_KEYS},
            **{f"new_{k}": new_f[setting][k] for k in TTFT_KEYS},
            ttft_new_vs_old=new_f[setting]["ttft_ms"] / old_f[setting]["ttft_ms"],
        )
        for setting in sorted(old_f.keys() & new_f.keys())
    ]
    return {"transfers": transfers, "ttft": ttft}


def write_markdown(result: dict, path: Path) -> None:
    lines = [
        "# KV transfer and TTFT: old against new, alternating",
        "",
        f"Command: `{result['command']}`; old {result['old']}, new {result['new']}; "
        f"{result['rounds']} rounds of `bench/kv.py {' '.join(result['kv_args'])}` each side, "
        f"in the order {', '.join(result['order'])}. Each cell the median over every run of that "
        f"side (this machine: {os.cpu_count()} cores). GB/s = 10^9 bytes/s.",
        "",
        "## Transfer between two processes on one host",
        "",
        "| KV | tokens | old ours | new ours | new / old | old, 4 runs | new, 4 runs | new / old |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["transfers"]:
        lines.append(
            f"| {r['layout']} | {r['tokens']} | {r['old_ours_gbps']:.2f} | {r['new_ours_gbps']:.2f} | "
            f"{r['ours_gbps_new_vs_old']:.2f} | {r['old_frag_gbps']:.2f} | "
            f"{r['new_frag_gbps']:.2f} | {r['frag_gbps_new_vs_old']:.2f} |"
        )
    lines += [
        "",
        "## Time to first token (disaggregated stack, max_tokens=1)",
        "",
        "| setting | old TTFT ms | new TTFT ms | new / old | old exposed ms | new exposed ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in result["ttft"]:
        lines.append(
            f"| {r['setting']} | {r['old_ttft_ms']:.1f} | {r['new_ttft_ms']:.1f} | "
            f"{r['ttft_new_vs_old']:.3f} | {r['old_kv_exposed_ms']:.1f} | {r['new_kv_exposed_ms']:.1f} |"
        )
    path.write_text("\n".join(lines) + "\n")


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layouts = sorted({r["layout"] for r in result["transfers"]})
    fig, axes = plt.subplots(1, len(layouts), figsize=(6 * len(layouts), 4.5), squeeze=False)
    for ax, layout in zip(axes[0], layouts):
        rows = [r for r in result["transfers"] if r["layout"] == layout]
        tokens = [r["tokens"] for r in rows]
        for key, label in (("ours_gbps", "one run"), ("frag_gbps", "4 runs")):
            ax.plot(tokens, [r[f"{key}_new_vs_old"] for r in rows], marker="o", label=label)
        ax.axhline(1.0, color="grey", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("new / old throughput")
        ax.set_title(layout)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="the revision to compare against")
    parser.add_argument("--new", default="HEAD")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--ttft-repeats", type=int, default=1)
    args = parser.parse_args()
    kv_args = ["--tokens", args.tokens, "--repeats", str(args.repeats)]
    kv_args += ["--ttft-repeats", str(args.ttft_repeats)]
    scratch = Path(tempfile.mkdtemp(prefix="tandem-kv-ab-"))
    trees = {"old": scratch / "old", "new": scratch / "new"}
    commits = {side: worktree(getattr(args, side), tree) for side, tree in trees.items()}
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    order = [side for i in range(args.rounds) for side in (("old", "new"), ("new", "old"))[i % 2]]
    try:
        for side in order:
            print(f"{side} ({commits[side][:10]})", flush=True)
            runs[side].append(run_side(trees[side], kv_args))
    finally:
        for tree in trees.values():
            subprocess.call(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
    result = dict(
        command="python bench/kv_ab.py " + " ".join(sys.argv[1:]),
        old=commits["old"][:10],
        new=commits["new"][:10],
        rounds=args.rounds,
        kv_args=kv_args,
        order=order,
        **compare(runs["old"], runs["new"]),
        runs=runs,
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "kv-ab.json").write_text(json.dumps(result, indent=1))
    write_markdown(result, RESULTS / "kv-ab.md")
    plot(result, RESULTS / "kv-ab.png")
    print((RESULTS / "kv-ab.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
