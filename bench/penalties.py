"""What penalties, a logit bias and min_tokens cost a decode step, at 1, 8 and 32 streams.

    python bench/penalties.py [--rounds 3] [--new-tokens 64] [--dtype float32]

The default model (SmolLM2-135M), Tandem's engine in this process (bench/engine.py's
EngineBench), n streams of distinct short prompts, greedy, each stream `--new-tokens` long. Two
arms, alternating within each round: plain (greedy, no penalty: the batched argmax) and
penalised (presence_penalty, frequency_penalty, repetition_penalty, a 16-token logit bias and
min_tokens = the length, which holds the end tokens back on every step; each stream keeps its
own counts). For each decode step (one where all n streams decode) it times the step, its
postprocess (where each row's token is drawn: the only part penalties touch) and, within that,
the shaping (`penalties.shape`, every row at once; putting the rows back after the draw is not in
it).

The cost per step is the penalised arm's postprocess minus the plain arm's: each sequence's stages
(`Penalties.stages`), the shaping and putting the rows back. It is given in ms
and as a share of the plain arm's step, measured in the same run; the step times of both arms
are given too (their difference is that cost plus the noise of the forward pass). Medians over the steps of a run,
then over the rounds; a step time is the fastest round's (on a shared machine other work only
adds to it, so the share is not understated). Writes bench/results/penalties.{json,md,png}.
"""

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import engine as eb  # noqa: E402  (bench/engine.py)

from shared import model_store  # noqa: E402
from shared.control.messages import GenerateTask, SamplingParams  # noqa: E402
from shared.engine import penalties  # noqa: E402
from shared.engine import shaping as shaping_module  # noqa: E402
from shared.engine.sequence import Sequence  # noqa: E402
from shared.worker.end_tokens import eos_token_ids  # noqa: E402

OUT = ROOT / "bench" / "results"
STREAMS = (1, 8, 32)


def penalised(new_tokens: int) -> dict:
    bias = list(range(1000, 1016))
    return dict(
        presence_penalty=0.3,
        frequency_penalty=0.5,
        repetition_penalty=1.2,
        bias_token_ids=bias,
        bias_values=[(-1.0) ** i * 2.0 for i in range(len(bias))],
        min_tokens=new_tokens,
        ignore_eos=False,
    )


def timed(call, seconds: list[float]):
    """`call`, keeping how long each call took in `seconds` (a function: a method stays one)."""

    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            seconds.append(time.perf_counter() - started)

    return wrapper


def run_arm(bench, prompts: list[list[int]], new_tokens: int, ends: set[int], asked: dict) -> dict:
    """One run of len(prompts) streams: per decode step, its time, its postprocess's, shaping's."""
    engine = bench.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = []
    for i, ids in enumerate(prompts):
        sampling = dataclasses.replace(params, **asked)
        task = GenerateTask(f"s{i}.{time.perf_counter_ns()}", ids, sampling, "", time.time())
        seqs.append(Sequence.from_task(task, None, ends, 8192))
    for seq in seqs:
        engine.add(seq)
    post, shape = [], []
    engine._postprocess = timed(engine._postprocess, post)
    shaping_module.shape = timed(penalties.shape, shape)
    steps = []
    try:
        while engine.has_work():
            decoding = len(engine.scheduler.running) == len(seqs)
            done_shaping, started = len(shape), time.perf_counter()
            engine.step()
            if decoding and post:
                steps.append((time.perf_counter() - started, post[-1], sum(shape[done_shaping:])))
    finally:
        del engine._postprocess
        shaping_module.shape = penalties.shape
    for seq in seqs:
        assert len(seq.output_ids) == new_tokens, "a stream ended early"
        engine.release(seq)
    step, postprocess, shaping = (statistics.median(c) * 1000 for c in zip(*steps))
    return {
        "step_ms": step,
        "postprocess_ms": postprocess,
        "shape_ms": shaping,
        "steps": len(steps),
    }


def measure(bench, tokenizer, rounds: int, new_tokens: int, ends: set[int]) -> dict:
    runs = {str(n): {"plain": [], "penalised": []} for n in STREAMS}
    run_arm(bench, eb.prompts_for(tokenizer, 2), 8, ends, {})  # warm-up
    for r in range(rounds):
        for n in STREAMS:
            prompts = eb.prompts_for(tokenizer, n)
            arms = ["plain", "penalised"] if r % 2 == 0 else ["penalised", "plain"]
            for arm in arms:
                asked = penalised(new_tokens) if arm == "penalised" else {}
                runs[str(n)][arm].append(run_arm(bench, prompts, new_tokens, ends, asked))
                print(n, arm, runs[str(n)][arm][-1], flush=True)
    return runs


def summary(runs: dict) -> dict:
    out = {}
    for n, arms in runs.items():
        med = {
            arm: {k: statistics.median(r[k] for r in rs) for k in ("step_ms", "postprocess_ms")}
            for arm, rs in arms.items()
        }
        shape = statistics.median(r["shape_ms"] for r in arms["penalised"])
        cost = med["penalised"]["postprocess_ms"] - med["plain"]["postprocess_ms"]
        step = min(
            r["step_ms"] for r in arms["plain"]
        )  # the least disturbed: a share not understated
        out[n] = {
            "plain_step_ms": step,
            "plain_step_median_ms": med["plain"]["step_ms"],
            "penalised_step_ms": min(r["step_ms"] for r in arms["penalised"]),
            "plain_postprocess_ms": med["plain"]["postprocess_ms"],
            "penalised_postprocess_ms": med["penalised"]["postprocess_ms"],
            "shape_ms": shape,
            "cost_ms": cost,
            "cost_share": cost / step,
        }
    return out


def table(result: dict) -> str:
    head = [
        "streams",
        "plain step (ms)",
        "penalised step (ms)",
        "postprocess plain / penalised (ms)",
        "of which shaping (ms)",
        "cost per step (ms)",
        "cost / plain step",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for n, s in result["summary"].items():
        lines.append(
            f"| {n} | {s['plain_step_ms']:.1f} | {s['penalised_step_ms']:.1f} | "
            f"{s['plain_postprocess_ms']:.2f} / {s['penalised_postprocess_ms']:.2f} | "
            f"{s['shape_ms']:.2f} | {s['cost_ms']:.2f} | {100 * s['cost_share']:.1f}% |"
        )
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["summary"])
    s = [result["summary"][n] for n in names]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5))
    left.bar(names, [x["cost_ms"] for x in s], color="tab:orange", label="cost per step")
    left.bar(names, [x["shape_ms"] for x in s], color="tab:blue", width=0.4, label="shaping")
    left.set_xlabel("streams")
    left.set_ylabel("ms per decode step")
    left.legend()
    right.bar(names, [100 * x["cost_share"] for x in s], color="tab:orange")
    right.set_xlabel("streams")
    right.set_ylabel("% of the plain step")
    fig.suptitle(f"Penalties per decode step: {result['model']}, {result['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args()
    model_dir = model_store.prepare("", "~/.cache/tandem/models")
    tokenizer = model_store.load_tokenizer(model_dir)
    model = model_store.load_model(model_dir, "cpu", args.dtype)
    bench = eb.EngineBench(model, args.dtype)
    ends = eos_token_ids(model.generation_config, tokenizer)
    runs = measure(bench, tokenizer, args.rounds, args.new_tokens, ends)
    result = {
        "model": model_dir.name,
        "dtype": args.dtype,
        "threads": torch.get_num_threads(),
        "kernels": bench.runner.kernel_report().line(),
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "runs": runs,
        "summary": summary(runs),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "penalties.json").write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out / "penalties.png")
    notes = (
        f"{result['model']}, {args.dtype}, {result['threads']} threads; kernels: "
        f"{result['kernels']}; {args.new_tokens} new tokens per stream, greedy; medians over "
        f"the decode steps of a run, then over {args.rounds} rounds (arms alternating); step "
        f"times: the fastest round's."
    )
    (args.out / "penalties.md").write_text(
        "# Penalties per decode step\n\n" + table(result) + "\n\n" + notes + "\n"
    )
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
