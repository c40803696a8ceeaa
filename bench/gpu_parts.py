"""The GPU check's measurements (bench/gpu_check.py), on any device: the engine in-process
against Hugging Face `generate` on the same model."""

import random
import time

import torch

from shared.control.messages import GenerateTask, SamplingParams
from shared.engine.block_manager import BlockManager
from shared.engine.engine import Engine
from shared.engine.model_runner import ModelRunner
from shared.engine.sequence import Sequence

BLOCK = 16


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


class EngineRun:
    """One engine over `model` on `device`, sized for `tokens` of KV (bench/prefill.py's too)."""

    def __init__(
        self,
        model,
        device: str,
        tokens: int,
        max_batch_tokens: int = 2048,
        chunk: int = 128,
        cuda_graphs: bool = True,
        reduce=None,  # a tensor-parallel rank's: its all-reduce across the group
    ):
        blocks = tokens // BLOCK + 256
        self.runner = ModelRunner(
            model, "bench", device, blocks, BLOCK, chunk, cuda_graphs=cuda_graphs, reduce=reduce
        )
        self.engine = Engine(
            self.runner, BlockManager(blocks, BLOCK, cache_granularity=chunk), 256, max_batch_tokens
        )
        self.device = device
        self.context = model.config.max_position_embeddings

    def seq(self, prompt: list[int], new: int, prefill_only: bool = False) -> Sequence:
        task = GenerateTask(
            attempt_id=f"g{time.perf_counter_ns()}{random.random()}",
            prompt_token_ids=prompt,
            sampling=SamplingParams(max_tokens=new, ignore_eos=True),
            reply_subject="",
            arrival_time=time.time(),
        )
        return Sequence.from_task(task, None, set(), self.context, prefill_only=prefill_only)

    def run(self, prompts: list[list[int]], new: int, prefill_only: bool = False):
        """(outputs, seconds until every first token, seconds in all)."""
        seqs = [self.seq(p, new, prefill_only) for p in prompts]
        for s in seqs:
            self.engine.add(s)
        _sync(self.device)
        started, first = time.perf_counter(), None
        while self.engine.has_work():
            self.engine.step()
            if first is None and all(s.output_ids for s in seqs):
                _sync(self.device)
                first = time.perf_counter()
            if all(s.status.finished or (prefill_only and s.output_ids) for s in seqs):
                break
        _sync(self.device)
        done = time.perf_counter()
        for s in seqs:
            self.engine.release(s)
        return [s.output_ids for s in seqs], first - started, done - started


def engine_greedy(model, prompts: list[list[int]], new: int, device: str) -> list[list[int]]:
    run = EngineRun(model, device, sum(len(p) + new for p in prompts))
    return run.run(prompts, new)[0]


def decode_rates(model, streams: list[int], new: int, device: str) -> tuple[dict, str]:
    """Decode tokens/s (after every first token) at each stream count: HF's, and the engine's with
    its decode steps replayed from CUDA graphs and without (on CUDA; on CPU there are none);
    and the engine's kernel report."""
    out = {}
    rng = random.Random(0)
    variants = {"engine": True, "engine_eager": False} if device.startswith("cuda") else {}
    runs = {
        name: EngineRun(model, device, max(streams) * (64 + new), cuda_graphs=graphs)
        for name, graphs in (variants or {"engine": False}).items()
    }
    for n in streams:
        prompts = [[rng.randrange(3, 49152) for _ in range(64)] for _ in range(n)]
        row = {}
        for name, run in runs.items():
            run.run(prompts[:1], 4)  # warm-up
            _, first, total = run.run(prompts, new)
            row[f"{name}_tokens_per_s"] = n * (new - 1) / (total - first)
        row["graphs"] = runs["engine"].runner.graphs is not None
        row["hf_tokens_per_s"] = _hf_decode(model, prompts, new, device)
        row["ratio"] = row["engine_tokens_per_s"] / row["hf_tokens_per_s"]
        out[str(n)] = row
        print(f"  decode {n} streams: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items()))
    return out, runs["engine"].runner.kernel_report().line()


def _hf_decode(model, prompts: list[list[int]], new: int, device: str) -> float:
    ids = torch.tensor(prompts, device=model.device)
    mask = torch.ones_like(ids)

    def timed(tokens: int) -> float:
        _sync(device)
        started = time.perf_counter()
        with torch.inference_mode():
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                eos_token_id=None,
                pad_token_id=0,
            )
        _sync(device)
        return time.perf_counter() - started

    timed(2)  # warm-up
    prefill = timed(1)
    return len(prompts) * (new - 1) / (timed(new) - prefill)


def ttft(model, length: int, device: str) -> dict:
    """Time to the first token of one `length`-token prompt (prefill only), after a warm-up."""
    run = EngineRun(model, device, length + 1024, max_batch_tokens=8192, cuda_graphs=False)
    rng = random.Random(length)
    run.run([[rng.randrange(3, 49152) for _ in range(256)]], 1, prefill_only=True)
    prompt = [rng.randrange(3, 49152) for _ in range(length)]
    _, first, _ = run.run([prompt], 1, prefill_only=True)
    print(f"  TTFT {length} tokens: {first:.3f} s", flush=True)
    return {"ttft_s": first, "tokens_per_s": length / first}
