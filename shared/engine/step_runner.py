"""StepRunner: what an Engine asks of the runner it steps. A ModelRunner is one; so is a
tensor-parallel group's rank 0 (shared.parallel.group.GroupRunner), which runs each call on
every rank of its group."""

from collections.abc import Callable
from typing import Protocol

import torch

from shared.engine.forward_batch import SeqSpan
from shared.engine.rotary import Rotary


class RunnerLost(RuntimeError):
    """The runner can never step again (a tensor-parallel group lost a rank): the worker hands
    its requests to others and exits, for its supervisor to start a new one."""


class StepRunner(Protocol):
    chunk: int  # the most prompt tokens of one sequence in one pass
    rotary: Rotary  # when a sequence's rope must be recomputed, which prefixes may be cached
    kernels: object | None  # Tandem's CPU kernels where it computes with them (None: torch's)

    def forward(
        self, spans: list[SeqSpan], abandon: Callable[[], bool] | None = None
    ) -> torch.Tensor | None:
        """One row of logits per span (None when `abandon()` said so before the pass ended)."""

    def argmax(self, logits: torch.Tensor) -> list[int]:
        """The first index of each row's largest value in logits its `forward` returned, as they
        are (sampler.argmax_rows): a runner that knows them without reading the rows says so
        (the mock, which put them there; a vocabulary-wide scan per row is the model's work,
        done on a GPU's side)."""

    def copy_block(self, source: int, target: int) -> None:
        """Block `target` of the KV pool gets block `source`'s keys and values (a fork's)."""
