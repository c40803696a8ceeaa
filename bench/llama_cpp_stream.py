"""llama.cpp single-stream decode rate on a GGUF (run in the bench venv that has llama-cpp-python).

Prints one JSON line: {"tokens_per_s": ..., "n_tokens": ..., "threads": ...}. Decode only: the
clock starts after the first token (the prompt pass), like the engine's decode figures.
"""

import argparse
import json
import time

from llama_cpp import Llama


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    llm = Llama(
        model_path=args.model,
        n_ctx=1024,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_batch=512,
        verbose=False,
    )
    prompt = llm.tokenize(b"Write a long story about a dragon who learns to fly.")
    rates = []
    for repeat in range(args.repeats + 1):  # the first run warms up
        llm.reset()
        started, count = None, 0
        for _ in llm.generate(prompt, temp=0.0, reset=True):  # never stops on EOS by itself
            count += 1
            if count == 1:
                started = time.perf_counter()
            if count == args.tokens:
                break
        if repeat:
            rates.append((count - 1) / (time.perf_counter() - started))
    rates.sort()
    print(
        json.dumps(
            {
                "tokens_per_s": rates[len(rates) // 2],
                "n_tokens": args.tokens,
                "threads": args.threads,
            }
        )
    )


if __name__ == "__main__":
    main()
