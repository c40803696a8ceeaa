"""lm-eval through Tandem against lm-eval on the checkpoint itself: the same multiple-choice task
scored by lm-eval's `hf` model (fp32, batch size 1) and by its `local-completions` model against
`tandem up` (colocated and disaggregated), which asks /v1/completions for each choice's prompt
logprobs (`echo`, `logprobs` 1, max_tokens 1, prompts as token ids, several per request).

The task is a local one (no dataset hub is reachable here): multiple-choice questions made from
small tables in this file (capitals, arithmetic, opposites, plurals), written as JSON lines with
an lm-eval task config beside them. The bar: the same accuracy, and every choice's
loglikelihood within 1e-4 of the `hf` model's.

lm-eval runs from a venv of its own (make bench-lm-eval makes .venv-lmeval): a peer tool, never a
dependency. Results: bench/results/lm-eval-parity.{md,json,png}.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.tandem_up import TandemUp  # noqa: E402
from shared import model_store  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
TOLERANCE = 1e-4
TASK = "tandem_local_mc"
CAPITALS = [
    ("France", "Paris"), ("Japan", "Tokyo"), ("Italy", "Rome"), ("Spain", "Madrid"),
    ("Germany", "Berlin"), ("Egypt", "Cairo"), ("Canada", "Ottawa"), ("Kenya", "Nairobi"),
    ("Peru", "Lima"), ("Norway", "Oslo"), ("Greece", "Athens"), ("Chile", "Santiago"),
]  # fmt: skip
OPPOSITES = [
    ("hot", "cold"), ("up", "down"), ("early", "late"), ("happy", "sad"), ("open", "closed"),
    ("light", "dark"), ("fast", "slow"), ("full", "empty"), ("old", "new"), ("wet", "dry"),
]  # fmt: skip
PLURALS = [
    ("mouse", "mice"), ("child", "children"), ("foot", "feet"), ("tooth", "teeth"),
    ("goose", "geese"), ("man", "men"), ("woman", "women"), ("person", "people"),
]  # fmt: skip


def questions() -> list[dict]:
    """The task's documents: a question, four choices, the right one's index (its place turns
    with the question, so no position is always right)."""
    docs = []

    def add(question: str, right: str, wrong: list[str]) -> None:
        at = len(docs) % 4
        choices = wrong[:at] + [right] + wrong[at:3]
        docs.append({"question": question, "choices": choices, "answer": at})

    cities = [city for _, city in CAPITALS]
    for i, (country, city) in enumerate(CAPITALS):
        others = [c for c in cities if c != city]
        add(
            f"What is the capital of {country}?",
            city,
            [others[(i + k) % len(others)] for k in (0, 3, 6)],
        )
    for i, (word, opposite) in enumerate(OPPOSITES):
        others = [o for _, o in OPPOSITES if o != opposite]
        add(
            f"What is the opposite of '{word}'?",
            opposite,
            [others[(i + k) % len(others)] for k in (1, 4, 7)],
        )
    for one, many in PLURALS:
        add(f"What is the plural of '{one}'?", many, [one + "s", one + "es", many + "s"])
    for a, b in [(2, 3), (4, 5), (7, 1), (6, 6), (9, 8), (3, 12), (15, 5), (20, 7)]:
        add(f"What is {a} plus {b}?", str(a + b), [str(a + b + d) for d in (1, -1, 10)])
    return docs


def write_task(folder: Path) -> None:
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in questions()))
    config = f"""task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
    (folder / f"{TASK}.yaml").write_text(config)


def lm_eval(args, folder: Path, name: str, model: str, model_args: str, batch: int) -> dict:
    """One lm-eval run: its accuracy and each (document, choice)'s loglikelihood."""
    out = folder / name
    argv = [str(args.lm_eval), "--model", model, "--model_args", model_args, "--tasks", TASK]
    argv += ["--include_path", str(folder), "--batch_size", str(batch), "--log_samples"]
    argv += ["--output_path", str(out)]
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "OPENAI_API_KEY": "x"}
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=args.timeout_s)
    if done.returncode:
        raise RuntimeError(f"lm-eval {name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    results = json.loads(next(out.rglob("results_*.json")).read_text())
    samples = [
        json.loads(line)
        for f in out.rglob("samples_*.jsonl")
        for line in f.read_text().splitlines()
    ]
    scores = {
        (s["doc_id"], i): float(r[0][0])  # each choice's response: [[loglikelihood, greedy]]
        for s in samples
        for i, r in enumerate(s["resps"])
    }
    return {"acc": results["results"][TASK]["acc,none"], "loglikelihoods": scores}


def served_model(base_url: str) -> str:
    with urllib.request.urlopen(base_url + "/v1/models", timeout=30) as answer:
        return json.loads(answer.read())["data"][0]["id"]


def through_tandem(args, folder: Path, model_dir: Path, mode: str, batch: int) -> dict:
    with TandemUp(f"lmeval-{mode}", extra_args=("--mode", mode)) as stack:
        model_args = ",".join(
            [
                f"model={served_model(stack.base_url)}",
                f"base_url={stack.base_url}/v1/completions",
                f"tokenizer={model_dir}",
                "tokenizer_backend=huggingface",
                "tokenized_requests=True",
                "num_concurrent=1",
                "max_retries=1",
            ]
        )
        return lm_eval(
            args, folder, f"tandem-{mode}-b{batch}", "local-completions", model_args, batch
        )


def compare(reference: dict, run: dict) -> dict:
    diffs = [abs(run["loglikelihoods"][k] - v) for k, v in reference["loglikelihoods"].items()]
    return {
        "acc": run["acc"],
        "choices": len(diffs),
        "max_abs_diff": max(diffs),
        "mean_abs_diff": sum(diffs) / len(diffs),
        "same_acc": run["acc"] == reference["acc"],
        "within": max(diffs) <= TOLERANCE,
    }


def report(out: dict) -> str:
    lines = [
        "# lm-eval through Tandem vs lm-eval's `hf` model",
        "",
        f"`python bench/lm_eval_parity.py` — lm-eval {out['lm_eval_version']}, task `{TASK}` "
        f"({out['documents']} local multiple-choice questions, 4 choices each), "
        f"model {out['model']}; `hf`: dtype float32, batch size 1.",
        "",
        f"`hf` accuracy: **{out['hf']['acc']:.4f}**",
        "",
        "| run | accuracy | same accuracy | choices | max abs diff | mean abs diff | within 1e-4 |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, row in out["runs"].items():
        lines.append(
            f"| {name} | {row['acc']:.4f} | {row['same_acc']} | {row['choices']} | "
            f"{row['max_abs_diff']:.2e} | {row['mean_abs_diff']:.2e} | {row['within']} |"
        )
    return "\n".join(lines) + "\n"


def plot(out: dict, reference: dict, runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 6))
    keys = sorted(reference["loglikelihoods"])
    xs = [reference["loglikelihoods"][k] for k in keys]
    for name, run in runs.items():
        ax.scatter(xs, [run["loglikelihoods"][k] for k in keys], s=8, label=name)
    ax.set_xlabel("lm-eval hf: loglikelihood of a choice")
    ax.set_ylabel("lm-eval local-completions through Tandem")
    ax.set_title(
        f"{TASK}: max |diff| "
        + ", ".join(f"{n} {out['runs'][n]['max_abs_diff']:.1e}" for n in runs),
        fontsize=8,
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm-eval", type=Path, default=ROOT / ".venv-lmeval" / "bin" / "lm_eval")
    parser.add_argument("--timeout-s", type=float, default=1800.0, help="each lm-eval run")
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    model_dir = model_store.prepare("", os.path.expanduser("~/.cache/tandem/models"))
    folder = Path(tempfile.mkdtemp(prefix="tandem-lmeval-"))
    write_task(folder)
    hf_args = f"pretrained={model_dir},dtype=float32"
    reference = lm_eval(args, folder, "hf", "hf", hf_args, 1)
    runs = {
        "tandem colocated, batch 1": through_tandem(args, folder, model_dir, "colocated", 1),
        "tandem disaggregated, batch 1": through_tandem(
            args, folder, model_dir, "disaggregated", 1
        ),
        "tandem disaggregated, batch 8": through_tandem(
            args, folder, model_dir, "disaggregated", 8
        ),
    }
    version = subprocess.run(
        [str(args.lm_eval.parent / "python"), "-c", "import lm_eval; print(lm_eval.__version__)"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    out = {
        "lm_eval_version": version,
        "model": model_dir.name,
        "documents": len(questions()),
        "hf": {"acc": reference["acc"]},
        "runs": {name: compare(reference, run) for name, run in runs.items()},
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "lm-eval-parity.json").write_text(json.dumps(out, indent=1) + "\n")
    text = report(out)
    (args.results / "lm-eval-parity.md").write_text(text)
    plot(out, reference, runs, args.results / "lm-eval-parity.png")
    print(text)
    ok = all(r["same_acc"] and r["within"] for r in out["runs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
