"""StepStats: what the engine's steps take, measured as they run.

Two smoothed figures feed the scheduler's estimates: prompt throughput (from steps with at least
a chunk of prompt rows: a few rows say little about how fast a long prompt goes) and the wall
time of a step while sequences decode (the gap between their tokens, which the scheduler keeps
under its ITL target; prompt chunks in the step count, as they delay the tokens). An observer,
when set, is told of every step (the worker's metrics).
"""

from collections.abc import Callable

SMOOTHING = 0.2  # weight of the newest step


def _smoothed(old: float, new: float) -> float:
    return new if not old else (1 - SMOOTHING) * old + SMOOTHING * new


class StepStats:
    def __init__(self, chunk: int):
        self.chunk = chunk
        self.prefill_tokens_per_s = 0.0
        self.decode_step_s = 0.0
        # (kind: prefill, decode or mixed; seconds; sequences in the step)
        self.observer: Callable[[str, float, int], None] | None = None

    def record(
        self, decode_rows: int, prompt_rows: int, forward_s: float, step_s: float, sequences: int
    ) -> None:
        if prompt_rows >= self.chunk and forward_s > 0:
            self.prefill_tokens_per_s = _smoothed(
                self.prefill_tokens_per_s, prompt_rows / forward_s
            )
        if decode_rows:
            self.decode_step_s = _smoothed(self.decode_step_s, step_s)
        if self.observer is not None:
            kind = ("mixed" if prompt_rows else "decode") if decode_rows else "prefill"
            self.observer(kind, step_s, sequences)
