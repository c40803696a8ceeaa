"""Prompt logprobs (OpenAI's echo with logprobs): each prompt token's log-probability under the
position before it, from the pass that computes the prompt, never from the prefix cache."""

import dataclasses
import time

import pytest
import torch

from shared.control.messages import GenerateTask, SamplingParams
from shared.engine.prompt_scores import PromptScores
from shared.engine.sequence import Sequence
from tests.unit.test_engine import make_engine, run_to_end

TOP = 3


def scored_seq(prompt: list[int], attempt_id: str = "s", logprobs: bool = True) -> Sequence:
    sampling = SamplingParams(
        max_tokens=2, temperature=0, ignore_eos=True, top_logprobs=TOP, logprobs=True
    )
    sampling = dataclasses.replace(sampling, prompt_logprobs=logprobs)
    task = GenerateTask(attempt_id, list(prompt), sampling, "reply", time.time())
    return Sequence.from_task(task, None, set(), 512)


def reference(model, prompt: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Hugging Face's: each prompt token's logprob (after the first), and the top TOP."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    top = torch.topk(logprobs, TOP, dim=-1)
    return logprobs.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], top.indices, top.values


@pytest.fixture
def model(tiny_model):
    return tiny_model


def test_a_chunked_prompt_is_scored_as_hugging_face_scores_it_with_a_neighbour(model, rand_tokens):
    prompt = rand_tokens(75)  # three chunks of 32
    engine = make_engine(model, max_batch_tokens=48)
    neighbour, seq = scored_seq(rand_tokens(40), "n", logprobs=False), scored_seq(prompt)
    engine.add(neighbour)
    engine.add(seq)
    outputs = []
    while engine.has_work():
        outputs += [out for s, out in engine.step() if s is seq]
    scores = outputs[0].prompt_logprobs
    assert scores is not None and len(scores) == len(prompt) - 1
    assert all(out.prompt_logprobs is None for out in outputs[1:])  # once, with the first token
    logprobs, top_ids, top_values = reference(model, prompt)
    assert torch.allclose(torch.tensor(scores.logprobs), logprobs, atol=1e-4)
    assert scores.top_ids == top_ids.flatten().tolist()
    assert torch.allclose(torch.tensor(scores.top_logprobs), top_values.flatten(), atol=1e-4)
    assert (
        scores.row(5).logprob == scores.logprobs[5]
        and scores.row(5).top_ids == scores.top_ids[15:18]
    )
    assert neighbour.prompt_logprobs is None


def test_a_prompt_whose_prefix_is_cached_is_computed_whole_for_its_scores(model, rand_tokens):
    prompt = rand_tokens(80)
    engine = make_engine(model)
    warm = scored_seq(prompt, "warm", logprobs=False)
    engine.add(warm)
    run_to_end(engine)
    assert engine.blocks.cached >= 4  # the prompt's full blocks stay cached
    seq = scored_seq(prompt)
    engine.add(seq)
    first = engine.step()
    assert seq.num_cached_tokens == 0
    run_to_end(engine)
    scores = next(out for s, out in first if s is seq).prompt_logprobs
    assert torch.allclose(torch.tensor(scores.logprobs), reference(model, prompt)[0], atol=1e-4)
    again = scored_seq(prompt, "again", logprobs=False)  # a plain one still reuses the cache
    engine.add(again)
    engine.step()
    assert again.num_cached_tokens > 0


def test_a_prompt_computed_again_overwrites_its_scores_from_where_it_starts():
    scores = PromptScores(length=6, top=1)
    rows = lambda a, b: torch.eye(8)[a:b] * 5.0  # noqa: E731 - row j favours token j
    tokens = [0, 1, 2, 3, 4, 5]
    scores.add(rows, 0, 4, tokens)
    scores.add(rows, 0, 3, tokens)  # preempted, computed again from its start
    assert len(scores.scores) == 3 and not scores.done
    scores.add(lambda a, b: torch.eye(8)[3 + a : 3 + b] * 5.0, 3, 3, tokens)  # the last row: none
    assert scores.done and scores.scores.top_ids == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError):
        PromptScores(length=6, top=1).add(rows, 2, 2, tokens)  # a gap: rows 0, 1 never scored
