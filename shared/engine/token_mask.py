"""TokenMask: what the engine asks of a sequence's structured-output state (a grammar's,
shared/grammar/state.py builds one): which tokens may come next, and each token it took."""

from typing import Protocol

import torch


class TokenMask(Protocol):
    @property
    def finished(self) -> bool:
        """The output is complete (or can go no further): the sequence ends."""

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """A new row of `logits` [vocab] with the tokens not allowed next at -inf."""

    def accept(self, token: int) -> None:
        """The sequence took `token`."""

    def fork(self) -> "TokenMask":
        """The same state, for another choice of the request (n > 1)."""
