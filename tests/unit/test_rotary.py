"""Rotary: per-sequence frequencies for length-dependent ropes, and their bounded cache."""

import torch
from transformers import AutoModelForCausalLM

from harness.families import config_of
from shared.engine.rotary import CACHED, Rotary


def rotary_of(name: str) -> Rotary:
    config = config_of(name, vocab_size=64, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    return Rotary(model.model.rotary_emb, model.config)


def test_dynamic_frequencies_are_cached_for_recent_lengths_only():
    rotary = rotary_of("llama-dynamic")  # trained length 96
    first = rotary._inv_freq(rotary._key(200)).clone()
    for length in range(97, 97 + 3 * CACHED):
        rotary._inv_freq(rotary._key(length))
    assert len(rotary._freqs) == CACHED
    assert torch.equal(rotary._inv_freq(rotary._key(200)), first)  # computed again, the same


def test_lengths_up_to_the_trained_one_share_the_original_frequencies():
    rotary = rotary_of("llama-dynamic")
    assert {rotary._key(n) for n in (1, 50, 96)} == {0}
    assert rotary._key(97) == 97 and rotary._key(500) == 500
    longrope = rotary_of("phi3-longrope")  # original 64
    assert {longrope._key(n) for n in (1, 64)} == {0}
    assert longrope._key(65) == longrope._key(400) == 65
    x = torch.zeros(3, 8)
    positions = torch.tensor([0, 1, 2])
    cos, _ = rotary(x, positions, [(3, 3)])
    reference, _ = rotary.module(x, positions[None])
    assert torch.equal(cos, reference[0])
