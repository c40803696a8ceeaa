"""Engine benchmark: Tandem's engine against Hugging Face generate and llama.cpp, in one run.

    make bench-engine        (or: python bench/engine.py [--quick])
    python bench/engine.py --model DIR [--new-tokens 64]     (any supported HF directory)

Everything is measured here, now, side by side: the machine's memory read bandwidth and GEMM
peak, decode throughput at 1/8/32/64 concurrent sequences (128 tokens each, ignore_eos) for the
engine (native fp32 and int8 weights), HF generate (padded batch) and llama.cpp (one stream),
prefill throughput, the batch-1 roofline, FLOP/s at batch 32, prefix-cache TTFT, and the
accuracy cost of int8. Each engine variant records which kernels it ran (KernelReport: bf16
native or emulated, oneDNN-packed or plain torch matmuls, ...), since they differ by CPU.
Writes bench/results/engine.{json,md,png}.

With --model DIR the run is about that checkpoint (fp32): engine decode tokens/s at 1/8/32
streams against HF generate in the same run, and the batch-1 step against a read of its weights;
it writes bench/results/engine-<directory name>.{json,md}. `make bench-models` runs it on a
random-weight Qwen2.5-0.5B-shaped checkpoint and on SmolLM2, and measures loading (bench/load.py).
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared import model_store  # noqa: E402
from shared.control.messages import GenerateTask, SamplingParams  # noqa: E402
from shared.engine.block_manager import BlockManager  # noqa: E402
from shared.engine.engine import Engine  # noqa: E402
from shared.engine.kernel_report import cpu_capability  # noqa: E402
from shared.engine.kv_cache import bytes_per_token, layout_of  # noqa: E402
from shared.engine.model_runner import ModelRunner  # noqa: E402
from shared.engine.projection import onednn_bf16  # noqa: E402
from shared.engine.sequence import Sequence  # noqa: E402

OUT = ROOT / "bench" / "results"
NEW_TOKENS = 128
VARIANTS = {"engine_native": "fp32", "engine_bf16": "bf16", "engine_int8": "int8"}


def median_of(fn, repeats: int) -> float:
    return statistics.median(fn() for _ in range(repeats))


# -- the machine -------------------------------------------------------------------------------


def memory_bandwidth() -> float:
    x = torch.ones(256 * 2**20)  # 1 GiB of float32
    x.sum()

    def once():
        t = time.perf_counter()
        x.sum()
        return x.numel() * 4 / (time.perf_counter() - t)

    return median_of(once, 5)


def weights_read(model) -> float:
    """Read rate of the model's own linear weights, tensor by tensor (a sum over each): what a
    batch-1 step must stream, at the rate this machine reads 121 separate 1-7 MB tensors."""
    tensors = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    total = sum(t.numel() * t.element_size() for t in tensors)

    def once():
        t = time.perf_counter()
        for weight in tensors:
            weight.sum()
        return total / (time.perf_counter() - t)

    once()
    return median_of(once, 5)


def gemm_peak() -> float:
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b

    def once():
        t = time.perf_counter()
        a @ b
        return 2 * 2048**3 / (time.perf_counter() - t)

    return median_of(once, 5)


def int8_peak() -> float:
    layer = model_store.quantize_int8(torch.nn.Sequential(torch.nn.Linear(2048, 2048, bias=False)))[
        0
    ]
    x = torch.randn(256, 2048)
    layer(x)

    def once():
        t = time.perf_counter()
        layer(x)
        return 2 * 256 * 2048 * 2048 / (time.perf_counter() - t)

    return median_of(once, 5)


# -- the engine --------------------------------------------------------------------------------


class EngineBench:
    def __init__(self, model, name: str, chunk: int = 128, max_batch_tokens: int = 512):
        self.runner = ModelRunner(model, name, "cpu", pool_blocks=6000, block_size=16, chunk=chunk)
        self.blocks = BlockManager(6000, 16, cache_granularity=chunk)
        self.engine = Engine(
            self.runner, self.blocks, max_num_seqs=64, max_batch_tokens=max_batch_tokens
        )

    def seq(self, ids: list[int], max_tokens: int, prefill_only: bool = False) -> Sequence:
        task = GenerateTask(
            attempt_id=str(id(ids)) + str(time.perf_counter_ns()),
            prompt_token_ids=ids,
            sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            reply_subject="",
            arrival_time=time.time(),
        )
        return Sequence.from_task(task, None, set(), 8192, prefill_only=prefill_only)

    def run(self, prompts: list[list[int]], max_tokens: int, prefill_only: bool = False) -> dict:
        seqs = [self.seq(p, max_tokens, prefill_only) for p in prompts]
        for s in seqs:
            self.engine.add(s)
        started = time.perf_counter()
        first = {}
        steps = []
        while self.engine.has_work():
            t = time.perf_counter()
            for s, _ in self.engine.step() or []:
                first.setdefault(s.attempt_id, time.perf_counter())
            steps.append((time.perf_counter() - t, len(self.engine.scheduler.running)))
        end = time.perf_counter()
        for s in seqs:
            self.engine.release(s)
        all_first = max(first.values())
        decode_steps = [dt for dt, running in steps if running == len(prompts)]
        return {
            "prefill_s": all_first - started,
            "decode_s": end - all_first,
            "ttft_s": [first[s.attempt_id] - started for s in seqs],
            "step_ms": 1000 * statistics.median(decode_steps) if decode_steps else None,
            "outputs": [s.output_ids for s in seqs],
        }


def chat_ids(tokenizer, text: str) -> list[int]:
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(ids if isinstance(ids, list) else ids["input_ids"])


def prompts_for(tokenizer, n: int) -> list[list[int]]:
    return [
        chat_ids(tokenizer, f"Write story number {i} about a dragon who learns to fly.")
        for i in range(n)
    ]


def kernels_of(bench: EngineBench) -> dict:
    """Which kernels this engine variant runs here, every field and the one-line summary."""
    report = bench.runner.kernel_report()
    return {**dataclasses.asdict(report), "line": report.line()}


def engine_variant(results: dict, key: str, model, tokenizer, concurrency: list[int]) -> dict:
    """Decode throughput of one engine variant, its kernel report recorded beside it."""
    bench = EngineBench(model, VARIANTS[key])
    results["kernels"][key] = kernels_of(bench)
    print(f"  {VARIANTS[key]} kernels: {results['kernels'][key]['line']}", flush=True)
    return engine_decode(bench, tokenizer, concurrency)


def engine_decode(bench: EngineBench, tokenizer, concurrency: list[int]) -> dict:
    bench.run(prompts_for(tokenizer, 2), 8)  # warm-up
    out = {}
    for n in concurrency:
        r = bench.run(prompts_for(tokenizer, n), NEW_TOKENS)
        out[n] = {"tokens_per_s": n * (NEW_TOKENS - 1) / r["decode_s"], "step_ms": r["step_ms"]}
        print(
            f"  engine n={n}: {out[n]['tokens_per_s']:.1f} tok/s, step {r['step_ms']:.1f} ms",
            flush=True,
        )
    return out


def hf_decode(model, tokenizer, concurrency: list[int]) -> dict:
    tokenizer.padding_side = "left"
    out = {}
    for n in concurrency:
        texts = [tokenizer.decode(p) for p in prompts_for(tokenizer, n)]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            model.generate(
                **enc, max_new_tokens=2, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )
            t = time.perf_counter()
            model.generate(
                **enc, max_new_tokens=1, do_sample=False, pad_token_id=tokenizer.eos_token_id
            )
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            model.generate(
                **enc,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
            total = time.perf_counter() - t
        out[n] = {"tokens_per_s": n * (NEW_TOKENS - 1) / (total - prefill)}
        print(f"  HF n={n}: {out[n]['tokens_per_s']:.1f} tok/s", flush=True)
    return out


def llama_cpp(python: str) -> dict | None:
    if not python or not Path(python).exists():
        return None
    done = subprocess.run(
        [
            python,
            str(ROOT / "bench" / "llama_cpp_stream.py"),
            "--model",
            str(model_store.default_model_path()),
            "--threads",
            str(torch.get_num_threads()),
            "--tokens",
            str(NEW_TOKENS),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if done.returncode != 0:
        print("  llama.cpp failed:", done.stderr[-500:], flush=True)
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"  llama.cpp (Q4_1, one stream): {result['tokens_per_s']:.1f} tok/s", flush=True)
    return result


def prefill(bench: EngineBench, tokenizer) -> dict:
    text = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(600))
    base = tokenizer(text)["input_ids"]
    out = {}
    for length in (128, 512, 2048):
        alone = bench.run([base[:length]], 1, prefill_only=True)
        batch = bench.run(
            [[7 + i] + base[i + 1 : i + length] for i in range(4)], 1, prefill_only=True
        )
        out[length] = {
            "alone_tokens_per_s": length / alone["prefill_s"],
            "batched4_tokens_per_s": 4 * length / batch["prefill_s"],
        }
        print(
            f"  prefill {length}: alone {out[length]['alone_tokens_per_s']:.0f} tok/s, "
            f"4 batched {out[length]['batched4_tokens_per_s']:.0f} tok/s",
            flush=True,
        )
    return out


def prefix_cache(bench: EngineBench, tokenizer) -> dict:
    shared_prefix = tokenizer(" ".join(f"Fact {i}: rivers flow to the sea." for i in range(120)))[
        "input_ids"
    ][:1000]
    first = bench.run([shared_prefix + tokenizer(" Question one?")["input_ids"]], 1)["ttft_s"][0]
    # Keep the first request's blocks cached: run the second while they are still in the pool.
    second = bench.run([shared_prefix + tokenizer(" Question two, longer?")["input_ids"]], 1)[
        "ttft_s"
    ][0]
    print(
        f"  prefix cache: first {first * 1000:.0f} ms, second {second * 1000:.0f} ms ({first / second:.1f}x)",
        flush=True,
    )
    return {
        "prefix_tokens": len(shared_prefix),
        "first_ttft_ms": first * 1000,
        "second_ttft_ms": second * 1000,
        "speedup": first / second,
    }


def accuracy(native, other, tokenizer) -> dict:
    """Teacher-forced agreement of `other`'s next-token choice with fp32's, and the mean KL."""
    texts = [
        "The history of the Roman Empire spans many centuries, from its founding to its fall.",
        "Photosynthesis converts light energy into chemical energy stored in glucose molecules.",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    ]
    agree = total = 0
    kl = []
    with torch.inference_mode():
        for text in texts:
            ids = torch.tensor([tokenizer(text)["input_ids"]])
            a, b = native(ids).logits[0].float(), other(ids).logits[0].float()
            agree += int((a.argmax(-1) == b.argmax(-1)).sum())
            total += a.shape[0]
            kl.append(
                float(
                    torch.nn.functional.kl_div(
                        b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="batchmean"
                    )
                )
            )
    return {"top1_agreement": agree / total, "mean_kl": statistics.mean(kl), "positions": total}


def weight_bytes(model) -> int:
    from torch.ao.nn.quantized.dynamic import Linear as Int8Linear

    total = 0
    for module in model.modules():
        if isinstance(module, Int8Linear):  # one byte a weight
            total += module.weight().numel()
        elif (
            isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
            and module is not model.model.embed_tokens
        ):
            total += module.weight.numel() * module.weight.element_size()
    return total  # the embedding table is read one row per token: not counted


def flops_per_token(model) -> int:
    config = model.config
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    kv = config.num_key_value_heads * (h // config.num_attention_heads)
    per_layer = h * h * 2 + h * kv * 2 + 3 * h * i
    return 2 * (layers * per_layer + h * config.vocab_size)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, key in (
        ("Tandem engine (fp32, exact)", "engine_native"),
        ("Tandem engine (bf16)", "engine_bf16"),
        ("Tandem engine (int8 weights)", "engine_int8"),
        ("HF generate (fp32, padded batch)", "hf"),
    ):
        series = results["decode"].get(key)
        if series:
            xs = sorted(int(n) for n in series)
            ax.plot(xs, [series[str(n)]["tokens_per_s"] for n in xs], marker="o", label=label)
    if results["decode"].get("llama_cpp"):
        ax.axhline(
            results["decode"]["llama_cpp"]["tokens_per_s"],
            color="gray",
            linestyle="--",
            label="llama.cpp (Q4_1, one stream)",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("output tokens/s (all streams)")
    ax.set_title(f"SmolLM2-135M decode, {results['machine']['threads']} threads")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def table(results: dict) -> str:
    d = results["decode"]
    lines = [
        "| concurrency | engine fp32 tok/s | engine bf16 tok/s | engine int8 tok/s | HF fp32 tok/s "
        "| fp32 / HF | bf16 / HF | int8 / HF |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for n in sorted(int(k) for k in d["engine_native"]):
        e, b, q, h = (
            d[k][str(n)]["tokens_per_s"]
            for k in ("engine_native", "engine_bf16", "engine_int8", "hf")
        )
        lines.append(
            f"| {n} | {e:.1f} | {b:.1f} | {q:.1f} | {h:.1f} | {e / h:.2f}x | {b / h:.2f}x | {q / h:.2f}x |"
        )
    m, r = results["machine"], results["roofline"]
    lines += ["", *kernel_notes(results)]
    lines += [
        f"llama.cpp one stream (Q4_1): {d['llama_cpp']['tokens_per_s']:.1f} tok/s"
        if d.get("llama_cpp")
        else "llama.cpp: not measured (no bench venv)",
        f"memory read bandwidth {m['bandwidth_gbs']:.1f} GB/s (one 1 GiB array; the model's weights, read "
        f"tensor by tensor: {m['weights_read_gbs']:.1f} GB/s); fp32 GEMM peak {m['gemm_gflops']:.0f} GFLOP/s; "
        f"int8 linear peak {m['int8_gflops']:.0f} GFLOP/s; threads {m['threads']}",
        f"batch-1 roofline: fp32 {r['native']['bytes_per_step'] / 1e6:.0f} MB/step -> "
        f"{r['native']['roofline_ms']:.1f} ms; achieved {r['native']['step_ms']:.1f} ms "
        f"({r['native']['ratio']:.2f}x the roofline); bf16 {r['bf16']['roofline_ms']:.1f} ms roofline, "
        f"{r['bf16']['step_ms']:.1f} ms achieved ({r['bf16']['ratio']:.2f}x); int8 {r['int8']['roofline_ms']:.1f} ms "
        f"roofline, {r['int8']['step_ms']:.1f} ms achieved ({r['int8']['ratio']:.2f}x)",
        f"batch-1 fp32 step against a plain read of its weights tensor by tensor "
        f"({r['native']['weights_read_ms']:.1f} ms): {r['native']['ratio_to_weights_read']:.2f}x",
        f"batch 32: {results['flops']['native_gflops']:.0f} GFLOP/s achieved "
        f"({results['flops']['fraction_of_peak']:.0%} of the fp32 GEMM peak)",
        "",
        "| prompt tokens | prefill alone tok/s | prefill 4 batched tok/s |",
        "| --- | --- | --- |",
    ]
    for length, p in results["prefill"].items():
        lines.append(
            f"| {length} | {p['alone_tokens_per_s']:.0f} | {p['batched4_tokens_per_s']:.0f} |"
        )
    pc, acc = results["prefix_cache"], results["accuracy"]
    lines += [
        "",
        f"prefix cache: {pc['prefix_tokens']}-token shared prefix, first TTFT {pc['first_ttft_ms']:.0f} ms, "
        f"second {pc['second_ttft_ms']:.0f} ms ({pc['speedup']:.1f}x sooner)",
        *(
            f"{name} vs fp32: top-1 agreement {a['top1_agreement']:.1%} over {a['positions']} positions, "
            f"mean KL {a['mean_kl']:.4f}"
            for name, a in acc.items()
        ),
    ]
    return "\n".join(lines)


def vllm_series(out: Path) -> str:
    """The decode series against vLLM-CPU (`make bench-decode`, bench/decode_series.py), as last
    written for each ISA, to sit beside this run's figures."""
    parts = [
        f"\n## Decode against vLLM-CPU, {path.stem.removeprefix('decode-')} "
        f"(`make bench-decode`, {path.name})\n\n{path.read_text()}"
        for path in sorted(out.glob("decode-*.md"))
    ]
    return "".join(parts)


def kernel_notes(results: dict) -> list[str]:
    """Which kernels each engine column ran (results from before the report have none)."""
    m, kernels = results["machine"], results.get("kernels", {})
    if not kernels:
        return []
    return [
        f"kernels (CPU {m.get('cpu_capability', '?')}, oneDNN bf16 kernels: "
        f"{'yes' if m.get('onednn_bf16') else 'no'}):",
        *(f"- engine {VARIANTS[key]}: {k['line']}" for key, k in kernels.items()),
        "",
    ]


def machine(model, threads: int) -> dict:
    return {
        "threads": threads,
        "cpu": os.uname().machine,
        "cpu_capability": cpu_capability(),
        "onednn_bf16": onednn_bf16(),
        "bandwidth_gbs": memory_bandwidth() / 1e9,
        "weights_read_gbs": weights_read(model) / 1e9,
        "gemm_gflops": gemm_peak() / 1e9,
    }


def model_run(args) -> int:
    """The --model run: one checkpoint in fp32, the engine against HF generate."""
    model_dir = Path(args.model).expanduser()
    tokenizer = model_store.load_tokenizer(model_dir)
    native = model_store.load_model(model_dir, "cpu", "float32")
    name = model_dir.name
    params = sum(p.numel() for p in native.parameters())
    print(f"{name}: {params / 1e6:.0f}M parameters, {type(native).__name__}", flush=True)
    results = {"model": name, "architecture": type(native).__name__, "parameters": params}
    results["machine"] = machine(native, args.threads)
    results["new_tokens"] = NEW_TOKENS
    bench = EngineBench(native, name)
    results["kernels"] = kernels_of(bench)
    print(f"  kernels: {results['kernels']['line']}", flush=True)
    concurrency = [1, 8, 32]
    engine = engine_decode(bench, tokenizer, concurrency)
    hf = hf_decode(native, tokenizer, concurrency)
    results["decode"] = {
        str(n): {**engine[n], "hf_tokens_per_s": hf[n]["tokens_per_s"]} for n in concurrency
    }
    read_ms = 1000 * weight_bytes(native) / (results["machine"]["weights_read_gbs"] * 1e9)
    step = engine[1]["step_ms"]
    results["batch1"] = {"step_ms": step, "weights_read_ms": read_ms, "ratio": step / read_ms}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"engine-{name}.json").write_text(json.dumps(results, indent=2))
    (OUT / f"engine-{name}.md").write_text(model_table(results) + "\n")
    print(model_table(results))
    return 0


def model_table(results: dict) -> str:
    m, b = results["machine"], results["batch1"]
    lines = [
        f"{results['model']} ({results['architecture']}, {results['parameters'] / 1e6:.0f}M "
        f"parameters, fp32), {m['threads']} threads, CPU {m['cpu_capability']}; "
        f"{results['new_tokens']} new tokens per stream",
        f"kernels: {results['kernels']['line']}",
        "",
        "| streams | engine tok/s | HF generate tok/s | engine / HF |",
        "| --- | --- | --- | --- |",
    ]
    for n, d in results["decode"].items():
        e, h = d["tokens_per_s"], d["hf_tokens_per_s"]
        lines.append(f"| {n} | {e:.1f} | {h:.1f} | {e / h:.2f}x |")
    lines += [
        "",
        f"batch-1 step {b['step_ms']:.1f} ms against a tensor-by-tensor read of its weights "
        f"{b['weights_read_ms']:.1f} ms ({m['weights_read_gbs']:.1f} GB/s): {b['ratio']:.2f}x",
    ]
    return "\n".join(lines)


def main() -> int:
    global NEW_TOKENS
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--llama-python",
        default=str(ROOT / ".venv-bench" / "bin" / "python"),
        help="a Python with llama-cpp-python installed (make bench-engine makes one)",
    )
    parser.add_argument("--quick", action="store_true", help="concurrency 1 and 8 only")
    parser.add_argument("--model", default="", help="a HF directory: the engine vs HF on it")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    NEW_TOKENS = args.new_tokens
    if args.model:
        return model_run(args)
    concurrency = [1, 8] if args.quick else [1, 8, 32, 64]
    model_dir = model_store.prepare(
        "", os.environ.get("TANDEM_MODEL_CACHE", "~/.cache/tandem/models")
    )
    tokenizer = model_store.load_tokenizer(model_dir)
    native = model_store.load_model(model_dir, "cpu", "float32")
    bf16 = model_store.load_model(model_dir, "cpu", "bfloat16")
    int8 = model_store.load_model(model_dir, "cpu", "float32", "int8")
    results = {
        "machine": {
            "threads": args.threads,
            "cpu": os.uname().machine,
            "cpu_capability": cpu_capability(),
            "onednn_bf16": onednn_bf16(),
        },
        "decode": {},
        "kernels": {},
        "new_tokens": NEW_TOKENS,
    }
    print("machine ...", flush=True)
    results["machine"].update(
        bandwidth_gbs=memory_bandwidth() / 1e9,
        weights_read_gbs=weights_read(native) / 1e9,
        gemm_gflops=gemm_peak() / 1e9,
        int8_gflops=int8_peak() / 1e9,
    )
    print("decode ...", flush=True)
    for key, model in (("engine_native", native), ("engine_bf16", bf16), ("engine_int8", int8)):
        decoded = engine_variant(results, key, model, tokenizer, concurrency)
        results["decode"][key] = {str(n): v for n, v in decoded.items()}
    results["decode"]["hf"] = {
        str(n): v for n, v in hf_decode(native, tokenizer, concurrency).items()
    }
    results["decode"]["llama_cpp"] = llama_cpp(args.llama_python)
    print("prefill ...", flush=True)
    results["prefill"] = {
        str(k): v
        for k, v in prefill(EngineBench(native, "native", max_batch_tokens=2048), tokenizer).items()
    }
    results["prefix_cache"] = prefix_cache(EngineBench(native, "native"), tokenizer)
    bandwidth = results["machine"]["bandwidth_gbs"] * 1e9
    context = len(prompts_for(tokenizer, 1)[0]) + NEW_TOKENS // 2
    results["roofline"] = {}
    kv_bytes = bytes_per_token(layout_of(native.config, "native", native.dtype, 16))  # fp32 KV
    for key, model in (("native", native), ("bf16", bf16), ("int8", int8)):
        per_step = weight_bytes(model) + context * kv_bytes
        step = results["decode"][f"engine_{key}"]["1"]["step_ms"]
        results["roofline"][key] = {
            "bytes_per_step": per_step,
            "roofline_ms": 1000 * per_step / bandwidth,
            "step_ms": step,
            "ratio": step / (1000 * per_step / bandwidth),
        }
    read_ms = 1000 * weight_bytes(native) / (results["machine"]["weights_read_gbs"] * 1e9)
    results["roofline"]["native"].update(
        weights_read_ms=read_ms,
        ratio_to_weights_read=results["roofline"]["native"]["step_ms"] / read_ms,
    )
    if "32" in results["decode"]["engine_native"]:
        step = results["decode"]["engine_native"]["32"]["step_ms"] / 1000
        achieved = flops_per_token(native) * 32 / step / 1e9
        results["flops"] = {
            "native_gflops": achieved,
            "fraction_of_peak": achieved / results["machine"]["gemm_gflops"],
        }
    else:
        results["flops"] = {"native_gflops": 0.0, "fraction_of_peak": 0.0}
    results["accuracy"] = {
        "bf16": accuracy(native, bf16, tokenizer),
        "int8": accuracy(native, int8, tokenizer),
    }
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "engine.json").write_text(json.dumps(results, indent=2))
    (OUT / "engine.md").write_text(table(results) + "\n" + vllm_series(OUT))
    plot(results, OUT / "engine.png")
    print(table(results))
    print(f"wrote {OUT}/engine.json, engine.md, engine.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
