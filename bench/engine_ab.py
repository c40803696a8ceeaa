"""Engine A/B: decode and prefill throughput of two commits, in one run, alternating.

    python bench/engine_ab.py --old /path/to/old-tree [--new .] [--rounds 3]

Each round runs, in each tree (the first tree alternating from round to round): the Tandem half of
`make bench-decode` (bench/decode_series.py's tandem_rates: fp32 and bf16 decode tokens/s at 1, 8
and 32 streams of one prompt, T = 64) and `python bench/prefill.py --quick` (prompt tokens/s at
512, 1k and 2k tokens, with the fp32 GEMM peak measured in the same process). vLLM-CPU, which
`make bench-decode` also runs, is left out: its figures do not depend on Tandem's code. Each
figure is the median of the rounds; new/old is the ratio. Each run also decodes the prompt greedily
(48 tokens, fp32 and bf16): the table says whether every run of both trees gave the same tokens. Writes
bench/results/engine-ab.{json,md,png}.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
STREAMS = "1,8,32"

# Runs in the tree under test (its own bench/ and shared/): the decode half of decode_series.
DECODE = """
import json, sys
sys.path[:0] = ['.', 'bench']
import engine as eb
from decode_series import PROMPT, tandem_rates
from shared import model_store
model_dir = model_store.prepare('', '~/.cache/tandem/models')
ids = eb.chat_ids(model_store.load_tokenizer(model_dir), PROMPT)
out = {}
for dtype, torch_dtype in (('fp32', 'float32'), ('bf16', 'bfloat16')):
    bench = eb.EngineBench(model_store.load_model(model_dir, 'cpu', torch_dtype), dtype)
    out[dtype] = tandem_rates(bench, ids, [int(s) for s in sys.argv[1].split(',')], 64)
    out[dtype]['greedy'] = bench.run([ids], 48)['outputs'][0]
print('TANDEM_RESULT ' + json.dumps(out))
"""


def run_decode(tree: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", DECODE, STREAMS],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("TANDEM_RESULT ")), None)
    if line is None:
        raise SystemExit(f"decode in {tree} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    rates = json.loads(line.removeprefix("TANDEM_RESULT "))
    greedy = {f"greedy {d}": r.pop("greedy") for d, r in rates.items()}
    return {f"decode {d} x{n}": r[n]["tokens_per_s"] for d, r in rates.items() for n in r} | greedy


def run_prefill(tree: Path, out: Path) -> dict:
    done = subprocess.run(
        [sys.executable, "bench/prefill.py", "--quick", "--out", str(out)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if done.returncode != 0:
        raise SystemExit(f"prefill in {tree} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    result = json.loads((out / "prefill.json").read_text())
    peak = result["machine"]["gemm_gflops"]
    rows = {f"prefill {n}": row["tokens_per_s"] for n, row in result["tandem"].items()}
    return rows | {"GEMM peak GFLOP/s": peak}


def table(result: dict) -> str:
    lines = [
        "# Engine A/B: old and new, alternating, in one run",
        "",
        f"old `{result['old']}`, new `{result['new']}`; {result['rounds']} rounds, medians; "
        "decode tokens/s (Tandem's half of `make bench-decode`), prefill prompt tokens/s "
        "(`bench/prefill.py --quick`).",
        "",
        "| figure | old | new | new/old |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, row in result["figures"].items():
        lines.append(f"| {name} | {row['old']:.1f} | {row['new']:.1f} | {row['ratio']:.3f} |")
    lines.append("")
    for name, row in result["greedy"].items():
        same = "identical" if row["identical"] else "DIFFERENT"
        lines.append(f"{name} ({row['tokens']} tokens, every run of both): {same}.")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in result["figures"] if not n.startswith("GEMM")]
    ratios = [result["figures"][n]["ratio"] for n in names]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.barh(names, ratios, color="tab:blue")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.axvline(0.97, color="tab:red", linestyle="--", linewidth=0.8, label="-3%")
    ax.set_xlim(0.85, 1.15)
    ax.set_xlabel("new / old (median of rounds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", type=Path, required=True, help="the old commit's tree")
    p.add_argument("--new", type=Path, default=ROOT)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    scratch = Path("/tmp/engine-ab")
    for i in range(args.rounds):
        order = ["old", "new"] if i % 2 == 0 else ["new", "old"]
        for side in order:
            figures = run_decode(trees[side]) | run_prefill(trees[side], scratch / f"{side}{i}")
            runs[side].append(figures)
            print(f"round {i + 1} {side}: {json.dumps(figures)}", flush=True)
    figures, greedy = {}, {}
    for name in [n for n in runs["old"][0] if n.startswith("greedy")]:
        outputs = {tuple(r[name]) for side in runs.values() for r in side}
        greedy[name] = {"identical": len(outputs) == 1, "tokens": len(runs["old"][0][name])}
    for name in [n for n in runs["old"][0] if not n.startswith("greedy")]:
        old = statistics.median(r[name] for r in runs["old"])
        new = statistics.median(r[name] for r in runs["new"])
        figures[name] = {"old": old, "new": new, "ratio": new / old}
    commit = lambda tree: subprocess.run(  # noqa: E731
        ["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True
    ).stdout.strip()
    result = {
        "old": commit(trees["old"]),
        "new": commit(trees["new"]),
        "rounds": args.rounds,
        "figures": figures,
        "greedy": greedy,
        "runs": runs,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "engine-ab.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "engine-ab.md").write_text(table(result))
    plot(result, args.out / "engine-ab.png")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
