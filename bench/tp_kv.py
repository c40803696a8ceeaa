"""KV transfer between tensor-parallel groups, matched and mismatched degrees, against a matched
TP=1 transfer of the same bytes and against the floor of a mismatched one, in one run.

    python bench/tp_kv.py [--tokens 4096] [--repeats 7]

The workers' own data path: each side's rank pools are shared regions mapped by its data-plane
helper process (HelperDataPlane, as a worker's), the pieces cut by the push connector per route
(prefill rank, decode rank, run of KV heads), UCX between the two helpers. A Qwen2.5-0.5B-shaped
KV (24 layers, 2 KV heads of 64, fp32: 24 KiB a token), one prompt of --tokens, segments of 1024
tokens, consecutive blocks on both sides. Timed from the first piece staged to the last landed.

In a block-major pool a rank's heads are a strided slice of a whole block, so a mismatched
transfer (2 -> 1: two senders, each piece scattered into its head range on landing; 1 -> 2: each
piece gathered from the sender's heads) copies every byte once more than a matched one. Its
floor: the matched TP=1 time of the same bytes plus one copy of them at the memory bandwidth
measured here (a contiguous copy of as many bytes). The bar: within 1.2x of that floor.
Writes bench/results/tp-kv.{json,md,png}.
"""

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.control.messages import KVDestination, KVLayout  # noqa: E402
from shared.dataplane.helper_plane import HelperDataPlane  # noqa: E402
from shared.engine.kv_cache import KVPool, bytes_per_token  # noqa: E402
from shared.kvtransfer.connector import connector  # noqa: E402
from shared.kvtransfer.plan import new_base_tag  # noqa: E402
from shared.parallel.heads import HeadSplit  # noqa: E402

OUT = ROOT / "bench" / "results"
LAYOUT = KVLayout("qwen2.5-0.5b-shape", "float32", 24, 2, 64, 16, pool_order="blocks")
PAIRS = ((1, 1), (2, 2), (2, 1), (1, 2))
SEGMENT = 1024


def pools_of(tp: int, blocks: int, seed: int | None) -> list[KVPool]:
    split = HeadSplit(LAYOUT.num_kv_heads * tp, LAYOUT.num_kv_heads, tp)
    layout = dataclasses.replace(LAYOUT, num_kv_heads=split.kv_per_rank)
    pools = []
    for rank in range(tp):
        pool = KVPool(layout, blocks, LAYOUT.block_size, "cpu", shared=True)
        if seed is not None:
            generator = torch.Generator().manual_seed(seed + rank)
            pool.kv.copy_(torch.randn(pool.kv.shape, generator=generator))
        pools.append(pool)
    return pools


async def one_transfer(sides, p: int, d: int, tokens: int, blocks: int) -> float:
    (send_plane, send_pools), (recv_plane, recv_pools) = sides
    table = list(range(blocks))
    where = KVDestination(
        ucx_address=recv_plane.address,
        base_tag=new_base_tag(int.from_bytes(os.urandom(5), "little")),
        block_ids=table,
        segment_tokens=SEGMENT,
        lease_s=30.0,
        prefill_tp=p,
        decode_tp=d,
    )
    receiver = connector("push", recv_plane, recv_pools).reserve(LAYOUT, tokens, where)
    receiver.start()
    sender = connector("push", send_plane, send_pools).sender(LAYOUT, tokens, where)
    started = time.perf_counter()
    for segment in sender.ready(tokens):  # every token computed: the transfer alone is timed
        staged = sender.stage(segment, table)
        sender.send(staged.direct)
        sender.send(sender.gather(staged))
    await sender.finish()
    await asyncio.wait_for(receiver.done.wait(), 60)
    elapsed = time.perf_counter() - started
    receiver.check(30.0)
    return elapsed


def check_heads(send_pools, recv_pools, p: int, d: int, blocks: int) -> bool:
    """Each decode rank holds exactly its heads of the prefill group's KV."""
    whole = torch.cat([pool.kv[:blocks] for pool in send_pools], dim=-2)
    if p > LAYOUT.num_kv_heads:  # replicated heads: one copy of each
        whole = whole[..., :: p // LAYOUT.num_kv_heads, :]
    split = HeadSplit(LAYOUT.num_kv_heads * d, LAYOUT.num_kv_heads, d)
    return all(
        torch.equal(pool.kv[:blocks], whole[..., slice(*split.kv_heads(rank)), :])
        for rank, pool in enumerate(recv_pools)
    )


async def measure_pair(p: int, d: int, tokens: int, repeats: int) -> dict:
    blocks = -(-tokens // LAYOUT.block_size)
    send_pools, recv_pools = pools_of(p, blocks, seed=p * 10 + d), pools_of(d, blocks, None)
    async with (
        HelperDataPlane([pool.region for pool in send_pools]) as send_plane,
        HelperDataPlane([pool.region for pool in recv_pools]) as recv_plane,
    ):
        sides = ((send_plane, send_pools), (recv_plane, recv_pools))
        await one_transfer(sides, p, d, tokens, blocks)  # warm: endpoints, pages
        ok = check_heads(send_pools, recv_pools, p, d, blocks)
        times = [await one_transfer(sides, p, d, tokens, blocks) for _ in range(repeats)]
        transports = recv_plane.transports() or send_plane.transports()
    nbytes = tokens * bytes_per_token(LAYOUT)
    return {
        "prefill_tp": p,
        "decode_tp": d,
        "bytes": nbytes,
        "bytes_per_decode_rank": nbytes // d * max(1, d // LAYOUT.num_kv_heads),
        "seconds": statistics.median(times),
        "all_seconds": times,
        "gbps": nbytes / statistics.median(times) / 1e9,
        "heads_exact": ok,
        "transports": transports,
    }


def copy_bandwidth(nbytes: int, repeats: int) -> float:
    """Bytes per second of one contiguous copy of `nbytes` (pages touched first)."""
    src = numpy.ones(nbytes, dtype=numpy.uint8)
    dst = numpy.zeros(nbytes, dtype=numpy.uint8)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        numpy.copyto(dst, src)
        times.append(time.perf_counter() - started)
    return nbytes / statistics.median(times)


def finish(result: dict) -> None:
    matched = next(r for r in result["rows"] if (r["prefill_tp"], r["decode_tp"]) == (1, 1))
    copy_s = matched["bytes"] / result["copy_bytes_per_s"]
    result["floor_mismatched_s"] = matched["seconds"] + copy_s
    for row in result["rows"]:
        row["vs_tp1"] = row["seconds"] / matched["seconds"]
        mismatched = row["prefill_tp"] != row["decode_tp"]
        row["vs_floor"] = row["seconds"] / result["floor_mismatched_s"] if mismatched else None


def table(result: dict) -> str:
    lines = [
        "# KV transfer between tensor-parallel groups (the workers' helper data plane)",
        "",
        f"`python bench/tp_kv.py` · {result['tokens']} tokens of a Qwen2.5-0.5B-shaped KV "
        f"({result['rows'][0]['bytes'] / 2**20:.0f} MiB), median of {result['repeats']}; "
        f"{os.cpu_count()} CPUs; transports {result['rows'][0]['transports'] or '?'}.",
        f"Memory copy bandwidth measured here: {result['copy_bytes_per_s'] / 1e9:.2f} GB/s; "
        f"floor of a mismatched transfer = matched TP=1 time + one copy = "
        f"{result['floor_mismatched_s'] * 1e3:.1f} ms.",
        "",
        "| prefill TP -> decode TP | ms | GB/s | bytes per decode rank | vs TP=1 | vs floor | "
        "heads exact |",
        "| --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in result["rows"]:
        floor = f"{r['vs_floor']:.2f}" if r["vs_floor"] is not None else "-"
        lines.append(
            f"| {r['prefill_tp']} -> {r['decode_tp']} | {r['seconds'] * 1e3:.1f} | "
            f"{r['gbps']:.2f} | {r['bytes_per_decode_rank'] / 2**20:.0f} MiB | "
            f"{r['vs_tp1']:.2f} | {floor} | {r['heads_exact']} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    names = [f"{r['prefill_tp']}->{r['decode_tp']}" for r in rows]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.bar(names, [r["seconds"] * 1e3 for r in rows], color="tab:blue", label="measured")
    ax.axhline(rows[0]["seconds"] * 1e3, color="black", linewidth=0.8, label="matched TP=1")
    floor = result["floor_mismatched_s"] * 1e3
    ax.axhline(floor, color="tab:red", linestyle="--", linewidth=0.8, label="mismatched floor")
    ax.axhline(1.2 * floor, color="tab:red", linestyle=":", linewidth=0.8, label="1.2x floor")
    ax.set_ylabel("ms per transfer")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def run(args) -> dict:
    rows = [await measure_pair(p, d, args.tokens, args.repeats) for p, d in PAIRS]
    for row in rows:
        print(json.dumps({k: v for k, v in row.items() if k != "all_seconds"}), flush=True)
    nbytes = rows[0]["bytes"]
    result = {"tokens": args.tokens, "repeats": args.repeats, "rows": rows}
    result["copy_bytes_per_s"] = copy_bandwidth(nbytes, args.repeats)
    finish(result)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    result = asyncio.run(run(args))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp-kv.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "tp-kv.md").write_text(table(result))
    plot(result, args.out / "tp-kv.png")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
