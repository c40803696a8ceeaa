"""How often bfloat16 picks float32's next token: the engine's bf16 and Hugging Face's own.

    python bench/bf16.py [--model DIR] [--tokens 1024]     (make bench-bf16)

Teacher-forced over English texts every Debian system has (the Apache 2.0 and GPL 3 licence
texts in /usr/share/common-licenses) and this README, cut to `--tokens` tokens each: HF in
float32 gives the reference top-1 at every position; HF in bfloat16 and the engine in bfloat16
(one decode step per position, through the KV pool and the decode kernels, as served) are each
scored by the fraction of positions whose top-1 is the reference's; so is HF in float32 on the
weights rounded to bf16, the best that bf16 weights allow. Default model: SmolLM2-135M
(trained weights; random-weight checkpoints put near-ties at the top of every row, see the
Models table in docs/engine.md). Writes bench/results/bf16.{json,md}.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results"
TEXTS = {
    "Apache-2.0": (Path("/usr/share/common-licenses/Apache-2.0"), 1000),
    "GPL-3": (Path("/usr/share/common-licenses/GPL-3"), 2000),
    "README.md": (ROOT / "README.md", 0),
}
BLOCK, CHUNK = 16, 32


def hf_top1(model, tokens: list[int]) -> list[int]:
    with torch.inference_mode():
        return model(torch.tensor([tokens])).logits[0].argmax(-1).tolist()


def rounded(model):
    """`model` (float32) with every weight rounded to bf16: the best any bf16 weights allow."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
    return model


def engine_top1(model, tokens: list[int]) -> list[int]:
    from shared.engine.model_runner import ModelRunner, SeqSpan

    blocks = list(range(-(-len(tokens) // BLOCK)))
    runner = ModelRunner(model, "bench", "cpu", len(blocks), BLOCK, CHUNK)
    return [
        int(runner.forward([SeqSpan(blocks, tokens, end - 1, end)])[0].argmax())
        for end in range(1, len(tokens) + 1)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="a checkpoint directory (default SmolLM2)")
    parser.add_argument("--tokens", type=int, default=1024, help="positions per text")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from transformers import AutoModelForCausalLM

    from shared import model_store

    path = model_store.prepare(args.model, Path("~/.cache/tandem/models").expanduser())
    tokenizer = model_store.load_tokenizer(path)

    def load(dtype):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    fp32, bf16, ceiling = load(torch.float32), load(torch.bfloat16), rounded(load(torch.float32))
    rows, same = [], {"engine": 0, "hf": 0, "rounded_weights": 0, "positions": 0}
    for name, (file, skip) in TEXTS.items():
        tokens = tokenizer(file.read_text()[skip:])["input_ids"][: args.tokens]
        reference = hf_top1(fp32, tokens)
        ours, theirs = engine_top1(load(torch.bfloat16), tokens), hf_top1(bf16, tokens)
        row = {
            "text": name,
            "positions": len(tokens),
            "engine": sum(a == b for a, b in zip(ours, reference)),
            "hf": sum(a == b for a, b in zip(theirs, reference)),
            "rounded_weights": sum(a == b for a, b in zip(hf_top1(ceiling, tokens), reference)),
        }
        rows.append(row)
        for key in same:
            same[key] += row[key]
        print(f"{name}: engine {row['engine'] / len(tokens):.2%}, HF {row['hf'] / len(tokens):.2%}")
    rows.append({"text": "all", **same})
    write(path.name, rows)


def write(model: str, rows: list[dict]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "bf16.json").write_text(json.dumps({"model": model, "rows": rows}, indent=2) + "\n")
    lines = [
        f"# bf16 top-1 agreement with fp32 Hugging Face: {model}",
        "",
        "| text | positions | engine bf16 | HF bf16 | HF fp32 on bf16-rounded weights |",
        "| --- | --- | --- | --- | --- |",
    ]
    for row in rows:
        n = row["positions"]
        lines.append(
            f"| {row['text']} | {n} | {row['engine'] / n:.2%} | {row['hf'] / n:.2%} "
            f"| {row['rounded_weights'] / n:.2%} |"
        )
    (OUT / "bf16.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
