"""Fits the mock engine's timing model from the real engine's profile.

    python bench/fit_timing.py [--repeats 3]            (make bench-timing)

Loads the real worker runtime (the default model, as a worker loads it), then times its
ModelRunner's forward pass over prompt chunks (16-256 rows at contexts of 0-3k tokens) and
decode batches (1-64 sequences at contexts of 64-1k tokens), each the median of `--repeats`
runs after a warm-up; fits TimingModel (shared/engine/timing_model.py) by least squares; and
checks it on steps it was not fitted on: prompt chunks beside decode rows, as the engine mixes
them. Saves the model where the mock engine reads it by default
(shared/engine/timing/smollm2-135m-cpu.json) and a table, bench/results/timing-model.md.
"""

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shared.engine.forward_batch import SeqSpan  # noqa: E402
from shared.engine.kernel_report import cpu_capability  # noqa: E402
from shared.engine.timing_model import DEFAULT_PATH, TimingModel, features  # noqa: E402
from shared.worker.runtime import load_runtime  # noqa: E402
from shared.worker.settings import WorkerSettings  # noqa: E402

PROMPTS = [(ctx, rows) for ctx in (0, 512, 1536, 3072) for rows in (16, 64, 128, 256)]
DECODES = [(batch, ctx) for batch in (1, 4, 16, 32, 64) for ctx in (64, 256, 1024)]
MIXED = [((512, 128), (8, 256)), ((0, 128), (32, 512)), ((1536, 64), (16, 1024))]


class Profiler:
    def __init__(self, runner, repeats: int):
        self.runner, self.repeats = runner, repeats
        self.block_size = runner.pool.block_size
        self.next_block = 0

    def _table(self, tokens: int) -> list[int]:
        """Blocks for `tokens` positions, fresh ones while the pool lasts (then reused)."""
        count = -(-tokens // self.block_size)
        total = self.runner.pool.num_blocks
        table = [(self.next_block + i) % total for i in range(count)]
        self.next_block = (self.next_block + count) % total
        return table

    def time(self, prompts: list[tuple[int, int]], decodes: list[int]) -> float:
        """Median seconds of one forward over these prompt chunks (start, end) and decode rows
        (context lengths)."""
        spans = [SeqSpan(self._table(end), [7] * end, start, end) for start, end in prompts]
        spans += [SeqSpan(self._table(ctx), [7] * ctx, ctx - 1, ctx) for ctx in decodes]
        self.runner.forward(spans)  # warm-up
        runs = []
        for _ in range(self.repeats):
            started = time.perf_counter()
            self.runner.forward(spans)
            runs.append(time.perf_counter() - started)
        return statistics.median(runs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=str(DEFAULT_PATH))
    parser.add_argument("--report", default=str(ROOT / "bench" / "results" / "timing-model.md"))
    args = parser.parse_args()
    settings = WorkerSettings(kv_cache_mb=3200, kv_plane="inprocess", max_batch_tokens=512)
    runtime = load_runtime(settings, "colocated")
    profiler = Profiler(runtime.runner, args.repeats)
    samples, rows = [], []
    for ctx, n in PROMPTS:
        seconds = profiler.time([(ctx, ctx + n)], [])
        samples.append((features([(ctx, ctx + n)], []), seconds))
        rows.append((f"prompt chunk {n} at {ctx}", [(ctx, ctx + n)], [], seconds))
    for batch, ctx in DECODES:
        seconds = profiler.time([], [ctx] * batch)
        samples.append((features([], [ctx] * batch), seconds))
        rows.append((f"decode {batch} x {ctx}", [], [ctx] * batch, seconds))
    source = f"{runtime.model_label}, {cpu_capability()}, {os.cpu_count()} cores, fitted here"
    model = TimingModel.fitted(samples, source)
    checks = []
    for (ctx, n), (batch, dctx) in MIXED:
        prompts, decodes = [(ctx, ctx + n)], [dctx] * batch
        seconds = profiler.time(prompts, decodes)
        checks.append((f"chunk {n} at {ctx} + decode {batch} x {dctx}", prompts, decodes, seconds))
    worst_mixed = max(abs(model.step_s(p, d) - s) / s for _, p, d, s in checks)
    model = TimingModel(
        model.coefficients, source, {**model.fit, "worst_rel_error_mixed": round(worst_mixed, 3)}
    )
    model.save(args.out)
    shown = Path(args.out).resolve()
    shown = shown.relative_to(ROOT) if shown.is_relative_to(ROOT) else shown
    Path(args.report).write_text(report(model, rows, checks, str(shown)))
    print(Path(args.report).read_text())
    return 0


def report(model: TimingModel, rows: list, checks: list, out: str) -> str:
    lines = [
        "# The mock engine's timing model",
        "",
        "`python bench/fit_timing.py` (`make bench-timing`): the real engine's forward pass timed",
        f"on {model.source}; fitted by least squares on relative error; saved to `{out}`.",
        "",
        "| coefficient | value |",
        "|---|---|",
        *[f"| {name} | {value * 1e3:.4f} ms |" for name, value in model.coefficients.items()],
        "",
        f"Fit: {model.fit}",
        "",
        "| step | measured ms | model ms | error |",
        "|---|---|---|---|",
    ]
    for label, prompts, decodes, seconds in rows + [
        (f"**{r[0]}** (not fitted on)", *r[1:]) for r in checks
    ]:
        predicted = model.step_s(prompts, decodes)
        lines.append(
            f"| {label} | {seconds * 1e3:.2f} | {predicted * 1e3:.2f} | "
            f"{(predicted - seconds) / seconds:+.0%} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
