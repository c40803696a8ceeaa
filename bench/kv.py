"""KV data plane benchmark (`make bench-kv`): our transfer against its peers, in one run.

Part 1, transfer throughput: for prompts of 128 to 16,384 tokens of the default model's KV and
of a synthetic Llama-3-8B-shaped KV (32 layers, 8 KV heads, head_dim 128, bf16: 128 KiB a
token, as the real one), between two processes of this host:
  - ours: TransferPlan + KVSender + KVReceiver, the push connector, from one run of prefill blocks
    into one of decode blocks, and from 4 runs into 4 runs; the staged connector (a message per
    segment) on the same 4-run pools (harness.kv_peer runs each side);
  - bare ucxx: one send of one buffer of the same size, same data plane settings;
  - memcpy: torch copy of the same bytes inside one process (the same-host physical limit);
  - NATS: the same bytes published in 1 MiB chunks through a local nats-server.
Part 2, time to first token: an embedded stack (1 prefill, 1 decode worker) answers a
4,096-token prompt with max_tokens=1, with layer-chunked overlap (segments of 512 tokens) and
without (one segment, sent after the whole prompt is computed); kv_exposed_ms is the part of
the transfer after the prefill finished, i.e. what the transfer adds to TTFT.

Writes bench/results/kv.{md,json,png}.
"""

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harness.kv_peer import KVPeer  # noqa: E402
from shared.control.messages import KVLayout  # noqa: E402
from shared.engine.kv_cache import bytes_per_token  # noqa: E402
from shared.kvtransfer.plan import new_base_tag  # noqa: E402

RESULTS = Path(__file__).parent / "results"
BS = 16
LAYOUTS = {
    "SmolLM2-135M (fp32)": KVLayout("SmolLM2-135M-Instruct", "float32", 30, 3, 64, BS),
    "Llama-3-8B-shaped (bf16)": KVLayout("synthetic-llama-3-8b", "bfloat16", 32, 8, 128, BS),
}


def median(values: list[float]) -> float:
    return statistics.median(values)


def ours(
    prefill: KVPeer,
    decode: KVPeer,
    tokens: int,
    segment: int,
    rng: random.Random,
    runs: int,
    pools: tuple[int, int] | None = None,  # the peers' pool blocks, if not this bench's
    how: str = "push",  # the connector (shared.kvtransfer.connector)
) -> float:
    n = -(-tokens // BS)
    src_blocks, dst_blocks = pools or (prefill_blocks(tokens), decode_blocks(tokens))
    src = fragmented(n, src_blocks, rng, runs)
    dst = fragmented(n, dst_blocks, rng, runs)
    dest = dict(
        ucx_address=decode.call("address")["address"],
        base_tag=new_base_tag(rng.getrandbits(39)),
        block_ids=dst,
        skip_tokens=0,
        segment_tokens=segment,
        lease_s=60.0,
        connector=how,
    )
    decode.call("receive", prompt_len=tokens, destination=dest)
    sent = prefill.call(
        "send", prompt_len=tokens, src_table=src, destination=dest, timeout_s=60.0, wait_s=120
    )
    landed = decode.call("wait", base_tag=dest["base_tag"], timeout_s=60.0, wait_s=120)
    assert sent["ok"] and landed["complete"], (sent, landed)
    return landed["last_landed"] - sent["started"]


def fragmented(n: int, num_blocks: int, rng: random.Random, runs: int = 4) -> list[int]:
    """n blocks in `runs` consecutive runs separated by random gaps: what the block allocator
    hands out (consecutive runs when it can), in a fresh pool (1 run) or one with churn."""
    runs = max(1, min(runs, n, num_blocks - n + 1))
    cuts = sorted(rng.sample(range(1, n), runs - 1)) if runs > 1 else []
    sizes = [b - a for a, b in zip([0] + cuts, cuts + [n])]
    spare = num_blocks - n
    gaps = sorted(rng.sample(range(1, spare + 1), runs - 1)) if runs > 1 else []
    gaps = [b - a for a, b in zip([0] + gaps, gaps)]  # each at least 1 block
    out, pos = [], rng.randrange(0, spare - sum(gaps) + 1)
    for size, gap in zip(sizes, gaps + [0]):
        out += range(pos, pos + size)
        pos += size + gap
    return out


def bare(prefill: KVPeer, decode: KVPeer, nbytes: int, rng: random.Random) -> float:
    tag = new_base_tag(rng.getrandbits(39))
    decode.call("receive_bare", tag=tag, nbytes=nbytes)
    sent = prefill.call(
        "send_bare", address=decode.call("address")["address"], tag=tag, nbytes=nbytes, wait_s=120
    )
    landed = decode.call("wait_bare", tag=tag, timeout_s=60.0, wait_s=120)
    return landed["landed"] - sent["started"]


def memcpy(nbytes: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(2)  # touched: no page faults in the copy
    started = time.perf_counter()
    dst.copy_(src)
    return time.perf_counter() - started


async def nats_push(url: str, nbytes: int, chunk: int = 1 << 20, window: int = 32 << 20) -> float:
    """The same bytes through NATS in 1 MiB messages, with the flow control a real sender needs:
    the receiver acknowledges every 8 MiB and the sender keeps at most `window` bytes unacknowledged
    (without it nats-server cuts the receiver off as a slow consumer)."""
    import nats

    sender, receiver = await nats.connect(url), await nats.connect(url)
    got, acked, done = [0], [0], asyncio.Event()
    progress = asyncio.Event()

    async def on_chunk(msg):
        got[0] += len(msg.data)
        if got[0] >= nbytes or got[0] % (8 << 20) < chunk:
            await receiver.publish("bench.kv.ack", str(got[0]).encode())
        if got[0] >= nbytes:
            done.set()

    async def on_ack(msg):
        acked[0] = int(msg.data)
        progress.set()

    await receiver.subscribe("bench.kv", cb=on_chunk, pending_bytes_limit=4 * window)
    await sender.subscribe("bench.kv.ack", cb=on_ack)
    await receiver.flush()
    await sender.flush()
    payload = bytes(chunk)
    started = time.perf_counter()
    sent = 0
    while sent < nbytes:
        while sent - acked[0] >= window:
            progress.clear()
            await sender.flush()
            await asyncio.wait_for(progress.wait(), 30)
        size = min(chunk, nbytes - sent)
        await sender.publish("bench.kv", payload[:size])
        sent += size
    await sender.flush()
    await asyncio.wait_for(done.wait(), 300)
    elapsed = time.perf_counter() - started
    await sender.close()
    await receiver.close()
    return elapsed


MAX_TOKENS = 16384


def prefill_blocks(tokens: int) -> int:
    return MAX_TOKENS // BS + 8


def decode_blocks(tokens: int) -> int:
    return MAX_TOKENS // BS + 64


def transfer_table(lengths: list[int], repeats: int, nats_url: str, segment: int) -> list[dict]:
    rows = []
    rng = random.Random(0)
    staged_rng = random.Random(1)  # its own: the push rows see the same tables as in any revision
    for name, layout in LAYOUTS.items():
        with (
            KVPeer(layout, prefill_blocks(0), seed=1) as prefill,
            KVPeer(layout, decode_blocks(0)) as decode,
        ):
            for tokens in lengths:
                nbytes = tokens * bytes_per_token(layout)
                ours(prefill, decode, tokens, segment, rng, 1)  # warm: endpoints, first-touch
                bare(prefill, decode, nbytes, rng)
                t_ours = median(
                    [ours(prefill, decode, tokens, segment, rng, 1) for _ in range(repeats)]
                )
                t_frag = median(
                    [ours(prefill, decode, tokens, segment, rng, 4) for _ in range(repeats)]
                )
                t_staged = median(
                    [
                        ours(prefill, decode, tokens, segment, staged_rng, 4, how="staged")
                        for _ in range(repeats)
                    ]
                )
                t_bare = median([bare(prefill, decode, nbytes, rng) for _ in range(repeats)])
                t_copy = median([memcpy(nbytes) for _ in range(repeats)])
                t_nats = median(
                    [asyncio.run(nats_push(nats_url, nbytes)) for _ in range(max(1, repeats // 2))]
                )
                transport = prefill.call("counters")["transports"]
                row = dict(
                    layout=name,
                    tokens=tokens,
                    bytes=nbytes,
                    transport=transport,
                    ours_ms=t_ours * 1e3,
                    frag_ms=t_frag * 1e3,
                    staged_ms=t_staged * 1e3,
                    bare_ms=t_bare * 1e3,
                    memcpy_ms=t_copy * 1e3,
                    nats_ms=t_nats * 1e3,
                )
                for key in ("ours", "frag", "staged", "bare", "memcpy", "nats"):
                    row[f"{key}_gbps"] = nbytes / row[f"{key}_ms"] / 1e6
                row["ours_vs_bare"] = row["ours_gbps"] / row["bare_gbps"]
                row["ours_vs_memcpy"] = row["ours_gbps"] / row["memcpy_gbps"]
                row["frag_vs_bare"] = row["frag_gbps"] / row["bare_gbps"]
                rows.append(row)
                print(
                    f"{name:26s} {tokens:6d} tok {nbytes / 2**20:8.1f} MiB  ours {row['ours_gbps']:5.2f} GB/s  "
                    f"(4 runs {row['frag_gbps']:5.2f}, staged {row['staged_gbps']:5.2f})  "
                    f"bare {row['bare_gbps']:5.2f}  memcpy {row['memcpy_gbps']:5.2f}  nats {row['nats_gbps']:5.2f}  "
                    f"ours/bare {row['ours_vs_bare']:.2f}  ours/memcpy {row['ours_vs_memcpy']:.2f}  [{transport}]",
                    flush=True,
                )
    return rows


def ttft_runs(prompt_tokens: int, repeats: int) -> list[dict]:
    """One embedded stack per setting; the same prompt, max_tokens=1."""
    import grpc

    from shared.api import tandem_pb2 as pb
    from shared.api import tandem_pb2_grpc as pb_grpc
    from shared.cli.launcher import start_stack, wait_until_serving
    from shared.cli.main import parser as cli_parser
    from shared.cli.processes import ProcessGroup, free_port

    rows = []
    text = prompt_text(prompt_tokens)
    for label, segment in (
        ("overlap (1024-token segments)", 1024),
        ("no overlap (one segment)", 16384),
    ):
        os.environ["TANDEM_KV_SEGMENT_TOKENS"] = str(segment)
        os.environ["TANDEM_MAX_MODEL_LEN"] = "8192"
        # `tandem up`'s own arguments, so every flag it has gets its default
        args = cli_parser().parse_args(
            ["up", "--mode", "disaggregated", "--cluster", f"bench-kv-{segment}"]
            + ["--grpc-port", str(free_port()), "--http-port", "-1", "--no-demo"]
        )
        with ProcessGroup(Path(tempfile.mkdtemp(prefix="tandem-bench-kv-"))) as group:
            address = start_stack(args, group).address
            wait_until_serving(address, group, 300)
            with grpc.insecure_channel(address) as channel:
                stub = pb_grpc.TandemStub(channel)
                for i in range(repeats + 1):
                    # a different first word each time: no prefix-cache hit on either worker
                    request = pb.GenerateRequest(
                        prompt=f"Run {i} of {label}. " + text,
                        sampling=pb.SamplingParams(max_tokens=1),
                    )
                    last = list(stub.Generate(request, timeout=600))[-1]
                    if i == 0:
                        continue  # warm-up
                    t = last.timing
                    rows.append(
                        dict(
                            setting=label,
                            segment_tokens=segment,
                            prompt_tokens=last.usage.prompt_tokens,
                            ttft_ms=t.ttft_ms,
                            prefill_ms=t.prefill_ms,
                            kv_transfer_ms=t.kv_transfer_ms,
                            kv_exposed_ms=t.kv_exposed_ms,
                            exposed_share=t.kv_exposed_ms / t.ttft_ms,
                        )
                    )
                    print(
                        f"{label:30s} TTFT {t.ttft_ms:8.1f} ms  prefill {t.prefill_ms:8.1f}  transfer span "
                        f"{t.kv_transfer_ms:7.1f}  exposed {t.kv_exposed_ms:6.1f} ms "
                        f"({100 * t.kv_exposed_ms / t.ttft_ms:.2f}% of TTFT)",
                        flush=True,
                    )
            group.stop()
    return rows


def prompt_text(tokens: int) -> str:
    """About `tokens` tokens of the default model's tokenizer, of plain varied words."""
    from shared import model_store

    tokenizer = model_store.load_tokenizer(model_store.prepare("", "~/.cache/tandem/models"))
    rng = random.Random(1)
    words = [
        "river",
        "stone",
        "light",
        "forest",
        "signal",
        "market",
        "winter",
        "engine",
        "garden",
        "letter",
        "silver",
        "harbor",
        "window",
        "number",
        "planet",
        "memory",
        "bridge",
        "orange",
        "paper",
        "thunder",
    ]
    text = " ".join(rng.choice(words) for _ in range(tokens * 2))
    ids = tokenizer(text)["input_ids"][: tokens - 16]
    return tokenizer.decode(ids)


def write_markdown(transfers: list[dict], ttft: list[dict], path: Path, command: str) -> None:
    lines = [
        "# KV data plane benchmark",
        "",
        f"Command: `{command}` (one run, this machine: "
        f"{os.cpu_count()} cores). Throughput in GB/s (10^9 bytes/s); each cell the median of its repeats.",
        "",
        "## Transfer between two processes on one host",
        "",
        '"ours" receives into one run of consecutive decode blocks from one run of prefill blocks (the '
        'block allocator\'s normal case: no copy on either side); "ours, 4 runs" into 4 runs from 4 runs '
        "(a pool with churn: more pieces, and pieces that cross a prefill run are gathered once), both "
        'with the push connector; "staged, 4 runs" the same pools with the staged connector (a message '
        "per segment: gathered on the prefill side, received into a staging buffer and scattered).",
        "",
        "| KV | tokens | MiB | ours | ours, 4 runs | staged, 4 runs | bare ucxx | memcpy | NATS 1 MiB chunks | "
        "ours / bare | 4 runs / bare | ours / memcpy | transport |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in transfers:
        lines.append(
            f"| {r['layout']} | {r['tokens']} | {r['bytes'] / 2**20:.1f} | {r['ours_gbps']:.2f} | "
            f"{r['frag_gbps']:.2f} | {r['staged_gbps']:.2f} | {r['bare_gbps']:.2f} | "
            f"{r['memcpy_gbps']:.2f} | {r['nats_gbps']:.2f} | "
            f"{r['ours_vs_bare']:.2f} | {r['frag_vs_bare']:.2f} | {r['ours_vs_memcpy']:.2f} | {r['transport']} |"
        )
    lines += [
        "",
        "## What the transfer adds to the time to first token",
        "",
        "| setting | prompt tokens | TTFT ms | prefill ms | transfer span ms | exposed ms | exposed / TTFT |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in ttft:
        lines.append(
            f"| {r['setting']} | {r['prompt_tokens']} | {r['ttft_ms']:.1f} | {r['prefill_ms']:.1f} | "
            f"{r['kv_transfer_ms']:.1f} | {r['kv_exposed_ms']:.1f} | {100 * r['exposed_share']:.2f}% |"
        )
    path.write_text("\n".join(lines) + "\n")


def plot(transfers: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(LAYOUTS), figsize=(6 * len(LAYOUTS), 4.5), squeeze=False)
    for ax, name in zip(axes[0], LAYOUTS):
        rows = [r for r in transfers if r["layout"] == name]
        tokens = [r["tokens"] for r in rows]
        for key, label in (
            ("ours", "ours (pool to pool)"),
            ("frag", "ours, 4 runs each side"),
            ("staged", "staged connector, 4 runs"),
            ("bare", "bare ucxx, one buffer"),
            ("memcpy", "memcpy, one process"),
            ("nats", "NATS, 1 MiB chunks"),
        ):
            ax.plot(tokens, [r[f"{key}_gbps"] for r in rows], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("GB/s")
        ax.set_title(name)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,1024,4096,16384")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--segment-tokens", type=int, default=1024)
    parser.add_argument("--ttft-tokens", type=int, default=4096)
    parser.add_argument("--ttft-repeats", type=int, default=2)
    parser.add_argument("--skip-ttft", action="store_true")
    args = parser.parse_args()
    from shared.cli.processes import ProcessGroup, free_port, nats_server_binary, wait_for_port

    torch.set_num_threads(1)
    lengths = [int(t) for t in args.tokens.split(",")]
    with ProcessGroup(Path(tempfile.mkdtemp(prefix="tandem-bench-nats-"))) as group:
        port = free_port()
        group.spawn(
            "nats", [nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)], dict(os.environ)
        )
        assert wait_for_port("127.0.0.1", port, 15), group.log_tail("nats")
        transfers = transfer_table(
            lengths, args.repeats, f"nats://127.0.0.1:{port}", args.segment_tokens
        )
        group.stop()
    ttft = [] if args.skip_ttft else ttft_runs(args.ttft_tokens, args.ttft_repeats)
    RESULTS.mkdir(exist_ok=True)
    command = "python bench/kv.py " + " ".join(sys.argv[1:])
    (RESULTS / "kv.json").write_text(
        json.dumps({"command": command, "transfers": transfers, "ttft": ttft}, indent=1)
    )
    write_markdown(transfers, ttft, RESULTS / "kv.md", command.strip())
    plot(transfers, RESULTS / "kv.png")
    print(f"wrote {RESULTS}/kv.json, kv.md, kv.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
