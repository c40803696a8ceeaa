"""Tensor parallelism on CPU: a TP=2 group (two gloo ranks, one core and one thread each) against
TP=1 (one process, two threads), in one run, on a Qwen2.5-0.5B-shaped model (random weights: 24
layers, hidden 896, 14 query heads, 2 KV heads, MLP 4864; SmolLM2's 9 heads do not split by 2).

    python bench/tp.py [--layers 24]

Decode tokens/s at 1, 8 and 32 streams (n * (T - 1) / (wall of T tokens - wall of 1), T = 16,
greedy, as bench/decode_series.py counts it) and prefill prompt tokens/s at 1k and 4k tokens (one
prompt, the prefill worker's job). TP=2 runs through shared/parallel: each rank its shard, its
pool of one KV head and a ModelRunner summing o's and down's outputs across the group (layer by
layer: the fused C++ decode stack has no point between layers for the all-reduce), rank 0's
Engine driving rank 1 (GroupRunner, follow). Writes bench/results/tp.{json,md,png}.
"""

import argparse
import datetime
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.families import config_of, randomize  # noqa: E402
from shared.engine.block_manager import BlockManager  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.model_runner import ModelRunner  # noqa: E402
from shared.engine.sequence import Sequence  # noqa: E402
from shared.parallel.group import GroupRunner, follow  # noqa: E402
from shared.parallel.shard import shard_model  # noqa: E402
from shared.values.sampling import SamplingParams  # noqa: E402

OUT = ROOT / "bench" / "results"
SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_attention_heads=14,
    num_key_value_heads=2,
    rope_scaling=None,
)
BLOCK, CHUNK, NEW = 16, 512, 16
STREAMS, PROMPTS = (1, 8, 32), (1024, 4096)


def model_of(layers: int):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = config_of("qwen2", num_hidden_layers=layers, **SHAPE)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    return model.eval()


def runner_of(model, reduce=None) -> ModelRunner:
    return ModelRunner(model, "qwen-0.5b-shape", "cpu", 640, BLOCK, CHUNK, reduce=reduce)


def run(runner, prompts: list[list[int]], new: int, prefill_only: bool = False) -> float:
    engine = Engine(runner, BlockManager(640, BLOCK, cache_granularity=CHUNK), 64, 2 * CHUNK)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    seqs = [
        Sequence(f"s{i}", p, params, None, set(), 8192, prefill_only) for i, p in enumerate(prompts)
    ]
    started = time.perf_counter()
    for seq in seqs:
        engine.add(seq)
    while engine.has_work():
        engine.step()
        if prefill_only and all(s.output_ids for s in seqs):
            break
    for seq in seqs:
        engine.release(seq)
    return time.perf_counter() - started


def measure(runner) -> dict:
    prompt = [(7 * j) % 40000 + 5 for j in range(32)]
    run(runner, [prompt] * 2, 4)  # warm-up
    out = {}
    for n in STREAMS:
        full, one = run(runner, [prompt] * n, NEW), run(runner, [prompt] * n, 1)
        out[f"decode x{n}"] = n * (NEW - 1) / (full - one)
    for length in PROMPTS:
        ids = [(13 * j) % 40000 + 5 for j in range(length)]
        out[f"prefill {length}"] = length / run(runner, [ids], 1, prefill_only=True)
    return out


def _rank(rank: int, port: int, layers: int, results) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=600),
    )
    try:
        model = model_of(layers)
        shard_model(model, 2, rank)
        runner = runner_of(model, reduce=dist.all_reduce)
        if rank == 0:
            group = GroupRunner(runner)
            results["tp2"] = measure(group)
            group.stop()
        else:
            follow(runner)
    finally:
        dist.destroy_process_group()


def table(result: dict) -> str:
    lines = [
        "# Tensor parallelism on CPU: TP=2 (two ranks, a core each) against TP=1 (two threads)",
        "",
        f"`python bench/tp.py` · {result['layers']} layers of a Qwen2.5-0.5B shape, fp32, random "
        f"weights; torch {torch.__version__}, {os.cpu_count()} CPUs.",
        "",
        "| figure | TP=1 | TP=2 | TP=2 / TP=1 |",
        "| --- | ---: | ---: | ---: |",
    ]
    for name, one in result["tp1"].items():
        two = result["tp2"][name]
        lines.append(f"| {name} tokens/s | {one:.1f} | {two:.1f} | {two / one:.2f} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["tp1"])
    ratios = [result["tp2"][n] / result["tp1"][n] for n in names]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh(names, ratios, color="tab:green")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("TP=2 / TP=1 tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count()))
    result = {"layers": args.layers, "tp1": measure(runner_of(model_of(args.layers)))}
    print("TP=1", json.dumps(result["tp1"]), flush=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        shared = manager.dict()
        mp.spawn(_rank, args=(port, args.layers, shared), nprocs=2, join=True)
        result["tp2"] = dict(shared)["tp2"]
    print("TP=2", json.dumps(result["tp2"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "tp.md").write_text(table(result))
    plot(result, args.out / "tp.png")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
