"""TokenMask: what the engine asks of a sequence's structured-output state (a grammar's,
shared/grammar/state.py builds one): which tokens may come next, and each token it took."""

from typing import Protocol

import torch


class TokenMask(Protocol):
    @property
    def finished(self) -> bool:
        """The output is complete (or can go no further): the sequence ends."""

    def allowed(self, width: int) -> torch.Tensor:
        """Which of the `width` tokens of a logits row may come next: a bool tensor [width]."""

    def accept(self, token: int) -> None:
        """The sequence took `token`."""

    def fork(self) -> "TokenMask":
        """The same state, for another choice of the request (n > 1)."""
