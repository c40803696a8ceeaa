"""GrammarState: one sequence's output under its constraint (an llguidance matcher), as the
engine's TokenMask: the tokens that may come next, each token sampled accepted, a copy per
choice of a request of n > 1.

The mask is computed for each token the sequence samples, the first included (on whichever
worker computes the prompt): the engine sets the disallowed tokens of its logits row to -inf. Once the
output is complete, only the end tokens are allowed; once one is taken (or the grammar can go no
further) the state is finished, and the sequence ends there.
"""

import numpy as np
import torch
from llguidance import LLMatcher


class GrammarState:
    def __init__(self, matcher: LLMatcher, eos_ids: list[int]):
        self._matcher = matcher
        self._eos = eos_ids

    @property
    def finished(self) -> bool:
        """The output is complete (an end token was taken) or can go no further."""
        return self._matcher.is_stopped() or self._matcher.is_error()

    def allowed(self, width: int) -> torch.Tensor:
        """Which of a logits row's `width` tokens the grammar allows next. Where it allows none
        (its output is over), only the end tokens: the sequence ends there."""
        allowed = self._allowed(width)
        if not allowed.any():
            allowed[[t for t in self._eos if t < width]] = True
        return torch.from_numpy(allowed)

    def _allowed(self, width: int) -> np.ndarray:
        if self.finished:
            return np.zeros(width, dtype=bool)
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[:width].astype(bool)
        return np.pad(allowed, (0, width - len(allowed)))  # rows past the tokenizer's: never

    def accept(self, token: int) -> None:
        """The sequence took `token`. A token the grammar does not allow (sampled where the
        mask did not apply) leaves the state in error: finished."""
        if not self.finished:
            self._matcher.consume_token(token)

    def fork(self) -> "GrammarState":
        return GrammarState(self._matcher.deep_copy(), self._eos)
