"""The engine samples every token of a constrained sequence under its mask (TokenMask), the
first included, on the prefill-only path too; each choice of n > 1 with a mask of its own."""

import dataclasses
import time

import torch

from shared.control.messages import GenerateTask, SamplingParams
from shared.engine.sequence import Sequence
from shared.values.constraint import Constraint, ConstraintKind
from tests.unit.test_engine import make_engine, run_to_end

ALLOWED = [7, 11]
LENGTH = 3


class OnlySome:
    """Allows ALLOWED, for LENGTH tokens; records what it accepted."""

    def __init__(self, taken=None):
        self.taken = list(taken or [])

    @property
    def finished(self) -> bool:
        return len(self.taken) >= LENGTH

    def allowed(self, width: int) -> torch.Tensor:
        allowed = torch.zeros(width, dtype=torch.bool)
        allowed[ALLOWED] = True
        return allowed

    def accept(self, token: int) -> None:
        self.taken.append(token)

    def fork(self) -> "OnlySome":
        return OnlySome(self.taken)


def constrained(prompt, n: int = 1, prefill_only: bool = False) -> tuple[Sequence, OnlySome]:
    sampling = SamplingParams(max_tokens=20, temperature=0.9, seed=3, n=n, ignore_eos=True)
    sampling = dataclasses.replace(sampling, constraint=Constraint(ConstraintKind.JSON_OBJECT))
    task = GenerateTask("m", list(prompt), sampling, "reply", time.time())
    mask = OnlySome()
    return Sequence.from_task(task, None, set(), 512, prefill_only, mask), mask


def test_every_token_of_every_choice_is_one_the_mask_allows(tiny_model, rand_tokens):
    engine = make_engine(tiny_model)
    seq, _ = constrained(rand_tokens(20), n=3)
    engine.add(seq)
    run_to_end(engine)
    choices = engine.take_forked()
    assert len(choices) == 3
    for choice in choices:
        assert choice.output_ids and set(choice.output_ids) <= set(ALLOWED)
        assert len(choice.output_ids) == LENGTH and choice.mask.taken == choice.output_ids
        assert choice.status.name == "FINISHED_STOPPED"  # its output complete: not max_tokens


def test_the_first_token_sampled_where_the_prompt_is_computed_obeys_the_mask(
    tiny_model, rand_tokens
):
    engine = make_engine(tiny_model)
    seq, mask = constrained(rand_tokens(20), prefill_only=True)
    engine.add(seq)
    run_to_end(engine)
    assert len(seq.output_ids) == 1 and seq.output_ids[0] in ALLOWED
    assert mask.taken == seq.output_ids
