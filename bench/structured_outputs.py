"""Structured outputs, measured: how often the answer is valid, and what the mask costs a step.

    python bench/structured_outputs.py [--requests 50] [--rounds 3]

1. The openai SDK's `parse()` with a nested Pydantic model (bounded strings and lists) against
   `tandem up`, colocated and disaggregated, at temperatures 0 and 0.8: `--requests` each, 8 at a
   time; valid means parse() returned the object (the SDK validated it). Greedy answers compared
   between the two paths.
2. Each model family's random-weight layout (harness/families.py, SmolLM2's tokenizer) in this
   process's engine under an enum-and-integer schema: `--requests` sequences each (half greedy,
   half sampled), every answer checked with jsonschema.
3. The mask's cost per decode step at 1, 8 and 32 streams (default model, this process's engine):
   the same streams with and without a constraint (json_object), alternating within each round;
   the cost is the constrained arm's postprocess minus the plain arm's, as a share of the plain
   step. The goal is under 5% at 32 streams.

Writes bench/results/structured-outputs.{json,md,png}.
"""

import argparse
import concurrent.futures
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import jsonschema
import openai
import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import engine as eb  # noqa: E402  (bench/engine.py)

from bench.tandem_up import TandemUp  # noqa: E402
from harness import families  # noqa: E402
from harness.structured import ASK, City  # noqa: E402
from shared import model_store  # noqa: E402
from shared.control.messages import GenerateTask, SamplingParams  # noqa: E402
from shared.engine import engine as engine_module  # noqa: E402
from shared.engine.block_manager import BlockManager  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.model_runner import ModelRunner  # noqa: E402
from shared.engine.sequence import Sequence  # noqa: E402
from shared.grammar.compiler import GrammarCompiler  # noqa: E402
from shared.values.constraint import Constraint, ConstraintKind  # noqa: E402

OUT = ROOT / "bench" / "results"
STREAMS = (1, 8, 32)
ENUM_SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue", "violet"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["color", "count"],
    "additionalProperties": False,
}


def sdk_parse(args) -> dict:
    """Part 1: parse() through tandem up, each mode and temperature."""
    out, greedy = {}, {}
    for mode in ("colocated", "disaggregated"):
        with TandemUp(f"structured-{mode}", extra_args=("--mode", mode)) as stack:
            client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0)
            model = client.models.list().data[0].id
            for temperature in (0.0, 0.8):
                out[f"{mode}, temperature {temperature}"] = _parse_many(
                    client, model, temperature, args.requests
                )
            greedy[mode] = out[f"{mode}, temperature 0.0"].pop("first_answer")
            out[f"{mode}, temperature 0.8"].pop("first_answer")
    return {
        "runs": out,
        "greedy_same_on_both_paths": greedy["colocated"] == greedy["disaggregated"],
    }


def _parse_many(client, model: str, temperature: float, requests: int) -> dict:
    def one(seed: int):
        answer = client.chat.completions.parse(
            model=model,
            messages=[{"role": "user", "content": ASK}],
            response_format=City,
            temperature=temperature,
            seed=seed,
            max_tokens=256,
        )
        message = answer.choices[0].message
        return isinstance(message.parsed, City), message.content, answer.usage.completion_tokens

    started = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, range(requests)))
    return {
        "requests": requests,
        "valid": sum(ok for ok, _, _ in results),
        "tokens_mean": statistics.mean(n for _, _, n in results),
        "seconds": time.perf_counter() - started,
        "first_answer": results[0][1],
    }


def family_schemas(args, tokenizer, model_dir: Path) -> dict:
    """Part 2: each family's random-weight layout under ENUM_SCHEMA, in this process's engine."""
    compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id])
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ENUM_SCHEMA))
    root, out = Path(tempfile.mkdtemp(prefix="tandem-families-")), {}
    for name in families.VARIANTS:
        model = AutoModelForCausalLM.from_pretrained(families.build(name, root, model_dir)).eval()
        runner = ModelRunner(model, name, "cpu", pool_blocks=512, block_size=16, chunk=64)
        engine = Engine(runner, BlockManager(512, 16, cache_granularity=64), 64, 512)
        seqs = []
        for i in range(args.requests):
            sampling = SamplingParams(
                max_tokens=256, temperature=0.0 if i % 2 == 0 else 1.0, seed=i
            )
            sampling = dataclasses.replace(sampling, constraint=constraint)
            prompt = tokenizer.encode(f"Pick a color and a number ({i}):")
            task = GenerateTask(f"{name}-{i}", prompt, sampling, "", time.time())
            mask = compiler.state(constraint, [])
            seqs.append(Sequence.from_task(task, None, {tokenizer.eos_token_id}, 4096, mask=mask))
            engine.add(seqs[-1])
        while engine.has_work():
            engine.step()
        out[name] = {"requests": args.requests, "valid": sum(_valid(tokenizer, s) for s in seqs)}
    return out


def _valid(tokenizer, seq: Sequence) -> bool:
    try:
        jsonschema.validate(
            json.loads(tokenizer.decode(seq.output_ids, skip_special_tokens=True)), ENUM_SCHEMA
        )
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def mask_cost(args, tokenizer, model_dir: Path) -> dict:
    """Part 3: the mask's cost per decode step, plain and constrained arms alternating: with one
    mask thread (what a CPU worker runs) at each of STREAMS, and with two at the last."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    bench = eb.EngineBench(model, "structured")
    postprocess = _timed_postprocess()
    out = {}
    for threads, streams in ((1, STREAMS), (2, STREAMS[-1:])):
        compiler = GrammarCompiler(tokenizer, [tokenizer.eos_token_id], threads)
        for n, row in _mask_rows(args, tokenizer, bench, compiler, streams, postprocess).items():
            out[n if threads == 1 else f"{n}, {threads} mask threads"] = row
    return out


def _mask_rows(args, tokenizer, bench, compiler, streams, postprocess) -> dict:
    constraint = Constraint(ConstraintKind.JSON_OBJECT)
    out = {}
    for n in streams:
        rows = {"plain": [], "constrained": []}
        for round_ in range(args.rounds):
            for arm in ("plain", "constrained"):
                prompts = [tokenizer.encode(f"Item {round_}-{i}: write JSON.") for i in range(n)]
                rows[arm].append(
                    _run_arm(
                        bench,
                        compiler,
                        constraint if arm == "constrained" else None,
                        prompts,
                        args.new_tokens,
                        postprocess,
                    )
                )
        plain = min(r["step_ms"] for r in rows["plain"])
        cost = statistics.median(r["post_ms"] for r in rows["constrained"]) - statistics.median(
            r["post_ms"] for r in rows["plain"]
        )
        out[str(n)] = {
            "plain_step_ms": plain,
            "constrained_step_ms": min(r["step_ms"] for r in rows["constrained"]),
            "mask_ms": cost,
            "share": cost / plain,
        }
    return out


def _timed_postprocess():
    """Engine._postprocess timed per call (the part of a step where rows are shaped and drawn)."""
    record: list[float] = []
    original = engine_module.Engine._postprocess

    def timed(self, work, logits):
        started = time.perf_counter()
        try:
            return original(self, work, logits)
        finally:
            record.append(time.perf_counter() - started)

    engine_module.Engine._postprocess = timed
    return record


def _run_arm(bench, compiler, constraint, prompts, new_tokens: int, postprocess: list) -> dict:
    engine, seqs = bench.engine, []
    for i, ids in enumerate(prompts):
        sampling = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
        sampling = dataclasses.replace(sampling, constraint=constraint)
        task = GenerateTask(f"a{i}-{time.perf_counter_ns()}", ids, sampling, "", time.time())
        mask = compiler.state(constraint, []) if constraint else None
        seqs.append(Sequence.from_task(task, None, set(), 8192, mask=mask))
        engine.add(seqs[-1])
    steps, posts = [], []
    while engine.has_work():
        before, started = len(postprocess), time.perf_counter()
        engine.step()
        if len(engine.scheduler.running) == len(prompts) and all(s.output_ids for s in seqs):
            steps.append(time.perf_counter() - started)
            posts.append(sum(postprocess[before:]))
    for s in seqs:
        engine.release(s)
    return {"step_ms": 1e3 * statistics.median(steps), "post_ms": 1e3 * statistics.median(posts)}


def report(out: dict) -> str:
    lines = ["# Structured outputs", "", "`python bench/structured_outputs.py` " + out["args"], ""]
    lines += [
        "## The openai SDK's parse() through tandem up",
        "",
        "| run | valid | mean tokens | s |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in out["sdk"]["runs"].items():
        lines.append(
            f"| {name} | {row['valid']}/{row['requests']} | {row['tokens_mean']:.0f} | {row['seconds']:.0f} |"
        )
    lines += [
        "",
        f"Greedy answer the same colocated and disaggregated: **{out['sdk']['greedy_same_on_both_paths']}**",
        "",
    ]
    lines += [
        "## Each family's random-weight layout, enum-and-integer schema",
        "",
        "| family | valid |",
        "| --- | --- |",
    ]
    lines += [
        f"| {name} | {row['valid']}/{row['requests']} |" for name, row in out["families"].items()
    ]
    lines += [
        "",
        "## The mask's cost per decode step (json_object, default model, this process's engine)",
        "",
        "A step's constrained rows: their bitmasks filled together by llguidance's executor (one",
        "thread, as a CPU worker runs it: the last row, two threads, contends with the forward",
        "pass's torch threads), each row masked on a copy by one C++ pass, greedy rows' argmax",
        "from the copies, each token accepted by its matcher.",
        "",
    ]
    lines += [
        "| streams | plain step ms | constrained step ms | mask ms | share of the step |",
        "| --- | --- | --- | --- | --- |",
    ]
    for n, row in out["mask"].items():
        lines.append(
            f"| {n} | {row['plain_step_ms']:.1f} | {row['constrained_step_ms']:.1f} | {row['mask_ms']:.2f} | {100 * row['share']:.1f}% |"
        )
    return "\n".join(lines) + "\n"


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    streams = list(out["mask"])
    ax.bar(streams, [100 * out["mask"][n]["share"] for n in streams])
    ax.axhline(5, color="red", linestyle="--", label="goal: 5%")
    ax.set_xlabel("streams")
    ax.set_ylabel("grammar mask, % of a decode step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--skip-sdk", action="store_true", help="parts 2 and 3; part 1 kept from the last run"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    model_dir = model_store.prepare("", str(Path("~/.cache/tandem/models").expanduser()))
    tokenizer = model_store.load_tokenizer(model_dir)
    out = {"args": " ".join(sys.argv[1:]) or "(defaults)"}
    out["mask"] = mask_cost(args, tokenizer, model_dir)
    out["families"] = family_schemas(args, tokenizer, model_dir)
    previous = OUT / "structured-outputs.json"
    if args.skip_sdk and previous.exists():  # the SDK part of the last full run, kept as it was
        out["sdk"] = json.loads(previous.read_text())["sdk"]
    else:
        out["sdk"] = sdk_parse(args)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "structured-outputs.json").write_text(json.dumps(out, indent=1) + "\n")
    text = report(out)
    (OUT / "structured-outputs.md").write_text(text)
    plot(out, OUT / "structured-outputs.png")
    print(text)
    valid = all(
        r["valid"] == r["requests"]
        for r in [*out["sdk"]["runs"].values(), *out["families"].values()]
    )
    return 0 if valid and out["mask"][str(STREAMS[-1])]["share"] < 0.05 else 1


if __name__ == "__main__":
    sys.exit(main())
