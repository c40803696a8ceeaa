"""GrammarState: one sequence's output under its constraint (an llguidance matcher), as the
engine's TokenMask: each token sampled accepted, a copy per choice of a request of n > 1; and
GrammarMasker, which computes the next-token masks of a step's states together.

The mask is computed for each token the sequence samples, the first included (on whichever
worker computes the prompt): the engine sets the disallowed tokens of a copy of its logits row to
-inf. Once the output is complete, only the end tokens are allowed; once one is taken (or the
grammar can go no further) the state is finished, and the sequence ends there.
"""

import numpy as np
import torch
from llguidance import LLExecutor, LLMatcher

from shared.values.constraint import MASK_WORD as WORD


class GrammarMasker:
    """The masks of a step's states in one call: llguidance's executor fills each state's row of
    one int32 bitmask (bit k of word w: token 32 * w + k may come next) on `threads` threads,
    outside the GIL. One per compiler (its tokenizer's `vocab` tokens); the engine's thread only."""

    def __init__(self, vocab: int, eos_ids: list[int], threads: int):
        self.words = (vocab + WORD - 1) // WORD
        self._eos = [t for t in eos_ids if t < self.words * WORD]
        self._threads = max(1, threads)
        self._executor: LLExecutor | None = None  # made at the first mask (none at a gateway)
        self._buffer = torch.zeros(0, self.words, dtype=torch.int32)

    def bitmask(self, states: list["GrammarState"]) -> torch.Tensor:
        """int32 [len(states), words]: each state's next tokens; a state that allows none (its
        output is over) the end tokens only. Valid until the next call (one buffer, reused)."""
        n = len(states)
        if self._buffer.shape[0] < n:
            self._buffer = torch.zeros(
                max(n, 2 * self._buffer.shape[0]), self.words, dtype=torch.int32
            )
        bits = self._buffer[:n]
        live = [(s._matcher, i) for i, s in enumerate(states) if not s.finished]
        if len(live) < n:
            bits.zero_()
        if live:
            self._executor = self._executor or LLExecutor(self._threads)
            self._executor.unsafe_compute_mask_ptr(live, bits.data_ptr(), self.words * 4, n)
        empty = (~bits.any(dim=1)).nonzero().flatten().tolist()
        if empty:
            words = bits.numpy().view(np.uint32)
            for token in self._eos:
                words[empty, token // WORD] |= np.uint32(1 << (token % WORD))
        return bits


class GrammarState:
    def __init__(self, matcher: LLMatcher, masker: GrammarMasker):
        self._matcher = matcher
        self._masker = masker

    @property
    def finished(self) -> bool:
        """The output is complete (an end token was taken) or can go no further."""
        return self._matcher.is_stopped() or self._matcher.is_error()

    @property
    def masker(self) -> GrammarMasker:
        return self._masker

    def accept(self, token: int) -> None:
        """The sequence took `token`. A token the grammar does not allow (sampled where the
        mask did not apply) leaves the state in error: finished."""
        if not self.finished:
            self._matcher.consume_token(token)

    def fork(self) -> "GrammarState":
        return GrammarState(self._matcher.deep_copy(), self._masker)
