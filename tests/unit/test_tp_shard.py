"""A model sharded over a tensor-parallel group of two gloo ranks computes what the whole model
computes: the prompt's logits within fp32 rounding and the same greedy tokens, for every family's
layout whose query heads divide by 2 (Phi-3's fused projections, GQA with fewer KV heads than
ranks replicated), and a degree that does not split the heads is refused."""

import copy

import pytest
import torch
from transformers import AutoModelForCausalLM

from harness.families import config_of, randomize
from shared.parallel.heads import TPError
from shared.parallel.shard import reduce_after_row_layers, shard_model
from tests.unit.gloo_group import run_ranks

# (variant, config overrides): heads / KV heads
LAYOUTS = [
    ("llama2", {}),  # 4 / 4
    ("llama3", {}),  # 8 / 2, head_dim 128
    ("llama-linear-mqa", {}),  # 8 / 1: the one KV head on both ranks
    ("qwen2", dict(hidden_size=224, num_attention_heads=14, num_key_value_heads=2)),  # 0.5B shape
    ("qwen3", {}),  # 4 / 2, q_norm and k_norm
    ("gemma", {}),  # 4 / 1
    ("phi3", {}),  # 2 / 2, fused qkv_proj and gate_up_proj
]
PROMPT = [5, 17, 250, 1033, 77, 4, 912, 66, 3001, 41, 8, 19]
NEW = 12


def model_of(name: str, overrides: dict):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_of(name, **overrides), dtype=torch.float32)
    randomize(model)
    return model.eval()


def greedy(model, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        logits = model(ids).logits[0]
        out = model.generate(ids, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    return logits, out[0, len(prompt) :].tolist()


def _work(rank: int, results) -> None:
    for name, overrides in LAYOUTS:
        whole = model_of(name, overrides)
        want_logits, want = greedy(whole, PROMPT)
        part = copy.deepcopy(whole)
        split = shard_model(part, 2, rank)
        reduce_after_row_layers(part)
        logits, got = greedy(part, PROMPT)
        if rank == 0:
            gap = (logits - want_logits).abs().max().item()
            results[name] = (got == want, gap, split.kv_heads(0), split.kv_heads(1))


def test_two_gloo_ranks_compute_what_the_whole_model_computes():
    results = run_ranks(_work)
    assert set(results) == {name for name, _ in LAYOUTS}
    for name, (same, gap, *_) in results.items():
        assert gap < 1e-4, (name, gap)
        assert same, name
    assert results["llama-linear-mqa"][2:] == ((0, 1), (0, 1))  # replicated
    assert results["qwen2"][2:] == ((0, 1), (1, 2))


def test_a_degree_that_does_not_split_the_heads_is_refused_before_any_weight_is_cut():
    model = model_of("llama2", {})
    before = model.model.layers[0].self_attn.q_proj.weight.shape
    with pytest.raises(TPError, match="degrees that would: 1, 2, 4"):
        shard_model(model, 3, 0)
    assert model.model.layers[0].self_attn.q_proj.weight.shape == before
