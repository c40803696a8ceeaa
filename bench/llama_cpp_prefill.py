"""llama.cpp's prompt throughput on a GGUF (run in the bench venv that has llama-cpp-python).

    python bench/llama_cpp_prefill.py --model FILE.gguf --lengths 1024,4096,8192 [--threads 2]

Prints one line, "TANDEM_RESULT " and JSON: {length: {"ttft_s": ..., "tokens_per_s": ...}}: the time of one eval of a
`length`-token prompt (seeded random ids, a fresh context each time: nothing cached).
"""

import argparse
import json
import random
import time

from llama_cpp import Llama


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--lengths", default="1024,4096,8192")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    llm = Llama(
        model_path=args.model,
        n_ctx=max(lengths) + 16,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        verbose=False,
    )
    llm.eval(list(range(100, 164)))  # warm-up
    out = {}
    for length in lengths:
        rng = random.Random(length)  # as bench/prefill.py and vllm_prefill.py draw theirs
        prompt = [11] + [rng.randrange(100, 40000) for _ in range(length - 1)]
        llm.reset()
        started = time.perf_counter()
        llm.eval(prompt)
        took = time.perf_counter() - started
        out[str(length)] = {"ttft_s": took, "tokens_per_s": length / took}
    print("TANDEM_RESULT", json.dumps(out))


if __name__ == "__main__":
    main()
