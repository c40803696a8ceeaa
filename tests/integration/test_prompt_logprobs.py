"""Prompt logprobs through the OpenAI API, as lm-eval's local-completions asks for them (several
prompts of token ids, `echo`, `logprobs`: 1, max_tokens 1 or 0): each prompt token's
log-probability is Hugging Face's, computed on whichever worker computed the prompt (the prefill
worker disaggregated, the one worker colocated), the same on both paths."""

import openai
import pytest
import torch

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is Paris.", "Water boils at one hundred degrees."]


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)


def hf_prompt_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


def echoed(stack, prompts: list[list[int]], max_tokens: int, stream: bool = False):
    return client(stack).completions.create(
        model=client(stack).models.list().data[0].id,
        prompt=prompts,
        echo=True,
        logprobs=1,
        max_tokens=max_tokens,
        temperature=0,
        stream=stream,
    )


def test_each_prompt_tokens_logprob_is_hugging_faces_on_both_paths(
    disagg, colocated, prompts, hf_model, tokenizer
):
    answers = {name: echoed(stack, prompts, 1) for name, stack in (("d", disagg), ("c", colocated))}
    for name, answer in answers.items():
        assert [c.index for c in answer.choices] == [0, 1]
        for choice, ids in zip(answer.choices, prompts):
            lp, reference = choice.logprobs, hf_prompt_logprobs(hf_model, ids)
            assert len(lp.token_logprobs) == len(ids) + 1  # the prompt and the token generated
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert choice.text.startswith(tokenizer.decode(ids))
            for i, token in enumerate(ids[1:]):
                assert abs(lp.token_logprobs[i + 1] - float(reference[i, token])) <= 1e-4, (name, i)
                ((best, value),) = lp.top_logprobs[i + 1].items()
                assert abs(value - float(reference[i].max())) <= 1e-4
                assert best == tokenizer.decode([int(reference[i].argmax())])
        assert answer.usage.prompt_tokens == sum(len(ids) for ids in prompts)
    disaggregated, together = answers["d"].choices, answers["c"].choices
    assert [c.logprobs.token_logprobs for c in disaggregated] == [
        c.logprobs.token_logprobs for c in together
    ]


def test_max_tokens_0_echoes_the_prompt_alone_and_a_cached_prompt_is_scored_whole(
    disagg, prompts, tokenizer
):
    first = echoed(disagg, prompts[:1], 0)
    again = echoed(disagg, prompts[:1], 0)  # its prefix is cached now: computed whole anyway
    for answer in (first, again):
        choice = answer.choices[0]
        assert choice.text == tokenizer.decode(prompts[0])
        assert len(choice.logprobs.token_logprobs) == len(prompts[0])
        assert answer.usage.completion_tokens == 0
    assert first.choices[0].logprobs.token_logprobs == again.choices[0].logprobs.token_logprobs
    streamed = list(echoed(disagg, prompts[:1], 0, stream=True))
    text = "".join(c.choices[0].text for c in streamed if c.choices)
    assert text == first.choices[0].text
