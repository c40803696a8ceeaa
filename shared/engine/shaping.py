"""The one place a step's logits rows are shaped before tokens are drawn from them: a row's
penalties, logit bias and min_tokens (penalties.py) in place, put back after the draw; a
constrained row's mask (token_mask.py) on a copy. Logprobs then read the raw rows, and a runner
may keep its buffer (the mock's lives from step to step)."""

import contextlib
from collections.abc import Callable

import torch

from shared.engine.penalties import shape
from shared.engine.sampler import argmax_rows, greedy_tokens
from shared.engine.sequence import Sequence
from shared.engine.token_mask import RowMasks


class Shaped:
    """A step's logits as its tokens are drawn: `shaped[row]` is the row to draw from (a
    constrained row's masked copy, else the logits' row, penalised in place)."""

    def __init__(
        self,
        logits: torch.Tensor,
        masked: list[tuple[list[int], torch.Tensor]],
        argmax: Callable[[torch.Tensor], list[int]] | None = None,
    ):
        self.logits = logits
        self.masked = masked
        self._copies = {row: copies[i] for rows, copies in masked for i, row in enumerate(rows)}
        self._argmax = argmax  # of the logits as the runner gave them (None: penalised in place)

    def __getitem__(self, row: int) -> torch.Tensor:
        found = self._copies.get(row)
        return self.logits[row] if found is None else found

    def greedy(self, wanted: list[bool]) -> list[int]:
        """Each wanted row's argmax (greedy_tokens), the masked ones' from their copies."""
        plain = [w and r not in self._copies for r, w in enumerate(wanted)]
        if self._argmax is not None and any(plain):  # the runner's (it may know them unread)
            picked = self._argmax(self.logits[: len(wanted)])
            tokens = [token if want else -1 for token, want in zip(picked, plain)]
        else:
            tokens = greedy_tokens(self.logits, plain)
        for rows, copies in self.masked:
            if any(wanted[r] for r in rows):
                for row, token in zip(rows, argmax_rows(copies)):
                    tokens[row] = token if wanted[row] else -1
        return tokens


@contextlib.contextmanager
def shaped(
    logits,
    rows: list[tuple[int, Sequence]],
    masks: RowMasks | None = None,
    argmax: Callable[[torch.Tensor], list[int]] = argmax_rows,
):
    """Each listed row shaped by its sequence for the draw (see above): penalties in place, put
    back on leaving; masks on copies, through `masks` (the engine's, with its runner's kernels).
    `argmax`: the runner's (StepRunner.argmax), used for the rows left as they were when no row
    was penalised in place. Yields the Shaped rows."""
    staged = [
        (
            row,
            seq.penalties.stages(
                logits[row], seq.prompt_token_ids, seq.resume_tokens, seq.output_ids
            ),
        )
        for row, seq in rows
        if seq.penalties is not None
    ]
    put_back = shape(logits, staged) if staged else None
    try:
        masked = [(row, seq.mask) for row, seq in rows if seq.mask is not None]
        copies = (masks or RowMasks()).masked(logits, masked) if masked else []
        yield Shaped(logits, copies, None if staged else argmax)
    finally:
        if put_back is not None:
            put_back()
