"""Tensor parallelism on CPU: a TP=2 worker (two rank processes, one core and one thread each)
against TP=1 (one process, two threads), in one run, on a Qwen2.5-0.5B-shaped checkpoint (random
weights: 24 layers, hidden 896, 14 query heads, 2 KV heads, MLP 4864; SmolLM2's 9 heads do not
split by 2), each loaded as a worker loads it (shared.worker.runtime.load_runtime).

    python bench/tp.py [--layers 24]

Decode tokens/s at 1, 8 and 32 streams (n * (T - 1) / (wall of T tokens - wall of 1), T = 16,
greedy, as bench/decode_series.py counts it) and prefill prompt tokens/s at 1k and 4k tokens (one
prompt, the prefill worker's job). Three engines: TP=1 as a worker runs it (the fused C++ decode
stack, every layer in one call); TP=1 layer by layer (the same runner with a no-op reduce: what a
TP rank's Python loop over layers costs alone); TP=2 (each rank its shard and its pool of one KV
head, an all-reduce after o and down, rank 0's Engine driving rank 1 over its command link). The
three split what TP=2 costs against TP=1 into the layer-by-layer loop and the rest (collectives,
commands, each rank's replicated output head). Qwen2's layers run one by one at TP=1 too (its
kernel report says `decode-stack per-layer`), so the loop's own cost is measured again on the
default SmolLM2, whose family the fused stack runs: TP=1 fused against the same runner layer by
layer. Writes bench/results/tp.{json,md,png}.
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from harness.families import build  # noqa: E402
from shared import model_store  # noqa: E402
from shared.control.worker_roles import Role  # noqa: E402
from shared.engine.block_manager import BlockManager  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.model_runner import ModelRunner  # noqa: E402
from shared.engine.sequence import Sequence  # noqa: E402
from shared.values.sampling import SamplingParams  # noqa: E402
from shared.worker.runtime import load_runtime  # noqa: E402
from shared.worker.settings import WorkerSettings  # noqa: E402

OUT = ROOT / "bench" / "results"
BLOCK, CHUNK, NEW = 16, 512, 16
STREAMS, PROMPTS = (1, 8, 32), (1024, 4096)
CACHE = Path("~/.cache/tandem/bench").expanduser()


def checkpoint(layers: int) -> Path:
    tokenizer = model_store.prepare("", "~/.cache/tandem/models")
    target = CACHE / f"qwen2.5-0.5b-{layers}"
    overrides = {"num_hidden_layers": layers}
    return build("qwen2.5-0.5b", CACHE, tokenizer, target=target, overrides=overrides)


def settings(path: Path, tp: int) -> WorkerSettings:
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0))[:2])
    return WorkerSettings(
        model=str(path),
        tp=tp,
        cpus=cores if tp > 1 else "",
        torch_threads=2 if tp == 1 else 0,
        kv_cache_mb=640 * BLOCK * 24 * 2 * 2 * 64 * 4 // 2**20 // tp,
        prefill_chunk_tokens=CHUNK,
        max_batch_tokens=2 * CHUNK,
        max_num_seqs=64,
    )


def loop_cost() -> dict:
    """SmolLM2 (its family runs the fused C++ stack) at TP=1: fused against layer by layer."""
    path = model_store.prepare("", "~/.cache/tandem/models")
    one = load_runtime(settings(path, 1), Role.DECODE)
    out = {"kernels": one.runner.kernel_report().line(), "fused": measure(one.engine)}
    del one
    torch.set_num_threads(min(2, os.cpu_count()))
    out["layers"] = measure(layer_by_layer(path))
    return out


def layer_by_layer(path: Path) -> Engine:
    """TP=1 without the fused stack: the runner a rank builds, its reduce a no-op."""
    config = model_store.load_config(path)
    model = model_store.load_model(path, "cpu", torch.float32, "native", config)
    runner = ModelRunner(
        model, "qwen2.5-0.5b", "cpu", 640, BLOCK, CHUNK, release_weights=True,
        cuda_graphs=False, reduce=lambda t: t,
    )  # fmt: skip
    blocks = BlockManager(640, BLOCK, cache_granularity=CHUNK)
    return Engine(runner, blocks, 64, 2 * CHUNK)


def run(engine: Engine, prompts: list[list[int]], new: int, prefill_only: bool = False) -> float:
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


def measure(engine: Engine) -> dict:
    prompt = [(7 * j) % 40000 + 5 for j in range(32)]
    run(engine, [prompt] * 2, 4)  # warm-up
    out = {}
    for n in STREAMS:
        full, one = run(engine, [prompt] * n, NEW), run(engine, [prompt] * n, 1)
        out[f"decode x{n}"] = n * (NEW - 1) / (full - one)
    for length in PROMPTS:
        ids = [(13 * j) % 40000 + 5 for j in range(length)]
        out[f"prefill {length}"] = length / run(engine, [ids], 1, prefill_only=True)
    return out


def table(result: dict) -> str:
    lines = [
        "# Tensor parallelism on CPU: TP=2 (two ranks, a core each) against TP=1 (two threads)",
        "",
        f"`python bench/tp.py` · {result['layers']} layers of a Qwen2.5-0.5B shape, fp32, random "
        f"weights, each loaded as a worker loads it; torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs.",
        "",
        "| figure | TP=1 | TP=1 layer by layer | TP=2 | TP=2 / TP=1 | layer by layer / TP=1 "
        "| TP=2 / layer by layer |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, one in result["tp1"].items():
        loop, two = result["tp1_layers"][name], result["tp2"][name]
        lines.append(
            f"| {name} tokens/s | {one:.1f} | {loop:.1f} | {two:.1f} | {two / one:.2f} | "
            f"{loop / one:.2f} | {two / loop:.2f} |"
        )
    small = result.get("smollm2")
    if small:
        lines += [
            "",
            "What the layer-by-layer loop costs where the fused C++ stack runs: SmolLM2-135M at "
            f"TP=1 ({small['kernels']}), fused against the same runner layer by layer:",
            "",
            "| figure | fused | layer by layer | ratio |",
            "| --- | ---: | ---: | ---: |",
        ]
        for name, fused in small["fused"].items():
            loop = small["layers"][name]
            lines.append(f"| {name} tokens/s | {fused:.1f} | {loop:.1f} | {loop / fused:.2f} |")
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
    path = checkpoint(args.layers)
    result = {"layers": args.layers}
    one = load_runtime(settings(path, 1), Role.DECODE)
    result["tp1"] = measure(one.engine)
    print("TP=1", json.dumps(result["tp1"]), flush=True)
    del one
    torch.set_num_threads(min(2, os.cpu_count()))
    result["tp1_layers"] = measure(layer_by_layer(path))
    print("TP=1 layer by layer", json.dumps(result["tp1_layers"]), flush=True)
    two = load_runtime(settings(path, 2), Role.DECODE)
    try:
        result["tp2"] = measure(two.engine)
    finally:
        two.close()
    print("TP=2", json.dumps(result["tp2"]), flush=True)
    result["smollm2"] = loop_cost()
    print("SmolLM2", json.dumps(result["smollm2"]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tp.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "tp.md").write_text(table(result))
    plot(result, args.out / "tp.png")
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
