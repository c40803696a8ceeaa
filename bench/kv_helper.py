"""KV throughput with UCX in a data-plane helper process against UCX in the worker's process
(`python bench/kv_helper.py`): what containing UCX's crashes costs.

The same transfer as bench/kv.py's "ours" (TransferPlan + KVSender + KVReceiver between two
processes of this host, one run of blocks each side, and four runs), for the default model's KV
and a Llama-3-8B-shaped one, with both peers' data plane in-process and then both in helper
processes (shared.dataplane.helper_plane), in alternating rounds so that a noisy moment of this
shared machine hits both alike. Writes bench/results/kv_helper.{json,md}.
"""

import argparse
import json
import math
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import kv  # noqa: E402  (bench/kv.py: the transfer itself)

from harness.kv_peer import KVPeer  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PLANES = {"inprocess": False, "helper": True}


def measure(layout, lengths, repeats, segment, helper: bool, rng) -> dict:
    """Seconds per transfer (median of `repeats`) by (tokens, runs) for one kind of plane."""
    out = {}
    with (
        KVPeer(layout, kv.prefill_blocks(0), seed=1, helper=helper) as prefill,
        KVPeer(layout, kv.decode_blocks(0), helper=helper) as decode,
    ):
        for tokens in lengths:
            kv.ours(prefill, decode, tokens, segment, rng, 1)  # warm: endpoints, first touch
            for runs in (1, 4):
                times = [
                    kv.ours(prefill, decode, tokens, segment, rng, runs) for _ in range(repeats)
                ]
                out[(tokens, runs)] = kv.median(times)
    return out


def table(lengths, repeats, rounds, segment) -> list[dict]:
    rows = []
    rng = random.Random(0)
    for name, layout in kv.LAYOUTS.items():
        for round_ in range(1, rounds + 1):
            got = {
                plane: measure(layout, lengths, repeats, segment, helper, rng)
                for plane, helper in PLANES.items()
            }
            for tokens in lengths:
                nbytes = tokens * kv.bytes_per_token(layout)
                for runs in (1, 4):
                    row = dict(layout=name, round=round_, tokens=tokens, runs=runs)
                    for plane in PLANES:
                        row[f"{plane}_gbps"] = nbytes / got[plane][(tokens, runs)] / 1e9
                    row["helper_vs_inprocess"] = row["helper_gbps"] / row["inprocess_gbps"]
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    return rows


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def write_markdown(rows: list[dict], path: Path, command: str) -> None:
    ratios = [r["helper_vs_inprocess"] for r in rows]
    lines = [
        "# KV throughput: UCX in a data-plane helper process against UCX in-process",
        "",
        f"Command: `{command}` (2 cores, shared machine). GB/s, median of the repeats per cell;",
        "the two planes measured in alternating rounds of one run. runs = runs of consecutive",
        "blocks on each side (4: the prefill side's pieces are gathered, by the helper there).",
        "",
        "| KV | round | tokens | runs | in-process | helper | helper / in-process |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['layout']} | {r['round']} | {r['tokens']} | {r['runs']} | "
            f"{r['inprocess_gbps']:.2f} | {r['helper_gbps']:.2f} | {r['helper_vs_inprocess']:.2f} |"
        )
    lines += [
        "",
        f"Geometric mean of helper / in-process: {geomean(ratios):.2f} "
        f"(range {min(ratios):.2f}-{max(ratios):.2f}, {len(ratios)} cells).",
    ]
    path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--segment-tokens", type=int, default=1024)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    lengths = [int(t) for t in args.tokens.split(",")]
    rows = table(lengths, args.repeats, args.rounds, args.segment_tokens)
    RESULTS.mkdir(exist_ok=True)
    command = "python bench/kv_helper.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (RESULTS / "kv_helper.json").write_text(
        json.dumps({"command": command.strip(), "rows": rows}, indent=1)
    )
    write_markdown(rows, RESULTS / "kv_helper.md", command.strip())
    print(f"wrote {RESULTS}/kv_helper.json, kv_helper.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
