"""PromptScores: a prompt's own log-probabilities, gathered while the prompt is computed.

A request that asks for prompt logprobs (OpenAI's `echo` with `logprobs`, as lm-eval scores
multiple-choice answers) wants, for each prompt token after the first, its log-probability under
the logits of the position before it, and the most likely tokens there. Those logits exist only
in the pass that computes the prompt, so that pass scores every row of the span (not only its
last, which samples), on whichever worker computes the prompt; a decode worker never recomputes
them, and they never travel as KV. Positions a prefix cache would serve have no logits: such a
request computes its whole prompt (Sequence.reuses_prefix).

Rows are scored a slice at a time (SLICE rows of vocabulary-wide logits, then only the chosen
token's log-probability and the top few are kept), so a long prompt does not hold a
[prompt, vocab] tensor. The log-probabilities are the model's raw ones: log-softmax of the
float32 logits, before any temperature, penalty or mask, clamped as sampled tokens' are.
"""

from collections.abc import Callable

import torch

from shared.engine.sampler import LOWEST_LOGPROB
from shared.values.sampling import PromptLogprobs, SamplingParams

SLICE = 128  # rows of logits [SLICE, vocab] held at once: 25 MB at a 49k vocabulary


class PromptScores:
    """The scores of one prompt of `length` tokens, `top` alternatives each, filled span by
    span in order (a prompt computed again, after a preemption, overwrites from its start)."""

    def __init__(self, length: int, top: int):
        self.length, self.top = length, top
        self.scores = PromptLogprobs(top)

    @classmethod
    def wanted(cls, length: int, sampling: SamplingParams) -> "PromptScores | None":
        """The scores a prompt of `length` tokens sampled with `sampling` asks for, if any."""
        return cls(length, sampling.top_logprobs) if sampling.prompt_logprobs else None

    @property
    def done(self) -> bool:
        return len(self.scores) == self.length - 1

    def add(
        self,
        logits_of: Callable[[int, int], torch.Tensor],
        start: int,
        rows: int,
        tokens: list[int],
    ) -> None:
        """Scores the span of `rows` rows at positions [start, start + rows): row j predicts the
        token at start + j + 1 (`tokens`: the sequence's ids), when that is a prompt token.
        `logits_of(a, b)`: the float32 logits [b - a, vocab] of the span's rows [a, b)."""
        wanted = min(rows, self.length - 1 - start)
        self._truncate(start)
        for a in range(0, max(wanted, 0), SLICE):
            b = min(wanted, a + SLICE)
            targets = torch.tensor(tokens[start + a + 1 : start + b + 1])
            self._keep(logits_of(a, b), targets)

    def _truncate(self, start: int) -> None:
        s, keep = self.scores, start * self.top
        if len(s) > start:
            del s.logprobs[start:], s.top_ids[keep:], s.top_logprobs[keep:]
        if len(s) != start:
            raise ValueError(f"prompt scored to {len(s)}, then a span from {start}")

    def _keep(self, logits: torch.Tensor, targets: torch.Tensor) -> None:
        logprobs = torch.log_softmax(logits.float(), dim=-1).clamp_(min=LOWEST_LOGPROB)
        self.scores.logprobs += logprobs.gather(1, targets[:, None])[:, 0].tolist()
        if self.top > 0:
            values, ids = torch.topk(logprobs, min(self.top, logprobs.shape[-1]), dim=-1)
            self.scores.top_ids += ids.flatten().tolist()
            self.scores.top_logprobs += values.flatten().tolist()
