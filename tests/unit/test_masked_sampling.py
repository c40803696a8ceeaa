"""The engine samples every token of a constrained sequence under its mask (TokenMask), the
first included, on the prefill-only path too; each choice of n > 1 with a mask of its own."""

import dataclasses
import time

import pytest
import torch

from shared.control.messages import GenerateTask, SamplingParams
from shared.engine import kernels as cpu_kernels
from shared.engine.sequence import Sequence
from shared.engine.token_mask import RowMasks
from shared.values.constraint import Constraint, ConstraintKind
from tests.unit.test_engine import make_engine, run_to_end

ALLOWED = [7, 11]
LENGTH = 3


class OnlySomeMasker:
    """Each mask's bitmask: ALLOWED's bits, in two words (the tiny model's tokens past 64 never)."""

    def bitmask(self, masks) -> torch.Tensor:
        bits = torch.zeros(len(masks), 2, dtype=torch.int32)
        for token in ALLOWED:
            bits[:, token // 32] |= 1 << (token % 32)
        return bits


MASKER = OnlySomeMasker()


class OnlySome:
    """Allows ALLOWED, for LENGTH tokens; records what it accepted."""

    def __init__(self, taken=None):
        self.taken = list(taken or [])

    @property
    def finished(self) -> bool:
        return len(self.taken) >= LENGTH

    @property
    def masker(self) -> OnlySomeMasker:
        return MASKER

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


class FixedMasker:
    """Hands back the bitmask it was made with, a row per mask."""

    def __init__(self, bits: torch.Tensor):
        self.bits = bits

    def bitmask(self, masks) -> torch.Tensor:
        return self.bits[: len(masks)]


class Fixed:
    def __init__(self, masker):
        self.masker = masker


def _expected(logits, rows, bits) -> torch.Tensor:
    """Row by row, bit by bit: the definition a bitmask has."""
    out = logits[rows].clone()
    for i in range(len(rows)):
        for token in range(logits.shape[1]):
            word = token // 32
            allowed = word < bits.shape[1] and (int(bits[i, word]) >> (token % 32)) & 1
            if not allowed:
                out[i, token] = float("-inf")
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [96, 100, 200])  # whole words, a partial word, past the mask
def test_rows_are_masked_alike_by_the_kernel_and_by_torch(dtype, width):
    """The C++ kernel's masked copies equal torch's, and both the bitmask's definition; the
    runner's logits are left as they came."""
    kernels = cpu_kernels.load()
    if kernels is None:
        pytest.skip("no C++ compiler here: torch's path only")
    generator = torch.Generator().manual_seed(width)
    logits = torch.randn(6, width, generator=generator).to(dtype)
    raw = logits.clone()
    words = 4  # 128 tokens: width 200 reaches past them
    bits = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=generator, dtype=torch.int32)
    bits[1, 0], bits[1, 1], bits[2, 2] = 0, -1, 0  # a word all clear, one all set
    masker = FixedMasker(bits)
    rows = [4, 0, 2]
    masked = [(row, Fixed(masker)) for row in rows]
    expected = _expected(logits, rows, bits)
    for masks in (RowMasks(kernels), RowMasks()):
        [(listed, copies)] = masks.masked(logits, masked)
        assert listed == rows and torch.equal(copies, expected)
    assert torch.equal(logits, raw)
