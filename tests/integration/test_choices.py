"""n > 1 through the gRPC and OpenAI APIs, disaggregated and colocated: one prefill for the
request, then each choice is what a request of n = 1 with its seed (the request's + its index)
gives. The migrated path (a decode worker killed mid-stream) is checked in test_faults."""

import openai
import pytest

from tests.integration.helpers import chat_request, collect

pytestmark = pytest.mark.slow


def by_choice(chunks) -> dict[int, list[int]]:
    choices: dict[int, list[int]] = {}
    for c in chunks:
        choices.setdefault(c.index, []).extend(c.token_ids)
    return choices


def served(stack, role: str) -> int:
    return sum(w.requests_served for w in stack.status().workers if w.role == role)


@pytest.mark.parametrize("stack_name", ["disagg", "colocated"])
def test_each_choice_is_its_seeds_answer_from_one_prefill(stack_name, request):
    stack = request.getfixturevalue(stack_name)
    ask = chat_request("Invent a name for a ship.", 12, temperature=0.9, seed=7, logprobs=True)
    ask.sampling.n = 3
    prefill_role = "prefill" if stack_name == "disagg" else "colocated"
    before = served(stack, prefill_role)
    chunks, _, _ = collect(stack.stub(), ask)
    stack.wait_idle()
    if stack_name == "disagg":
        assert served(stack, "prefill") == before + 1  # the prompt prefilled once for all three
    choices = by_choice(chunks)
    assert sorted(choices) == [0, 1, 2]
    finals = [c for c in chunks if c.finish_reason]
    assert sorted(c.index for c in finals) == [0, 1, 2]
    assert all(c.usage.completion_tokens == len(choices[c.index]) for c in finals)
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    for index in range(3):
        alone = chat_request("Invent a name for a ship.", 12, temperature=0.9, seed=7 + index)
        assert collect(stack.stub(), alone)[1] == choices[index], index
    assert len({tuple(ids) for ids in choices.values()}) > 1


def test_openai_n_with_a_seed(disagg):
    client = openai.OpenAI(base_url=disagg.http_url + "/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    kw = dict(
        model=model,
        messages=[{"role": "user", "content": "Invent a name for a dog."}],
        max_tokens=10,
        temperature=1.0,
    )
    whole = client.chat.completions.create(n=3, seed=40, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2]
    for choice in whole.choices:
        alone = client.chat.completions.create(n=1, seed=40 + choice.index, **kw)
        assert alone.choices[0].message.content == choice.message.content
    streamed = client.chat.completions.create(
        n=3, seed=40, stream=True, stream_options={"include_usage": True}, **kw
    )
    texts: dict[int, str] = {}
    usage = None
    for chunk in streamed:
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + (c.delta.content or "")
        usage = chunk.usage or usage
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens
    assert usage.prompt_tokens == whole.usage.prompt_tokens
    disagg.wait_idle()
