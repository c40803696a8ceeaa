"""Logprobs through the gRPC API, on the disaggregated path (the first token's logprob comes
from the prefill worker, the rest from the decode worker) and the colocated one: each is Hugging
Face's log-softmax for its prefix. The migrated path is checked in test_faults."""

import pytest

from tests.integration.helpers import (
    assert_logprobs_match,
    chat_request,
    collect,
    hf_logprobs,
    prompt_ids,
)

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("stack_name", ["disagg", "colocated"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_hugging_faces(stack_name, temperature, request, hf_model, tokenizer):
    stack = request.getfixturevalue(stack_name)
    ask = chat_request(
        "Name a bird that cannot fly.", 12, temperature=temperature, seed=3, logprobs=True
    )
    ask.sampling.top_logprobs = 5
    chunks, ids, _ = collect(stack.stub(), ask)
    logprobs = [lp for c in chunks for lp in c.logprobs]
    reference = hf_logprobs(hf_model, prompt_ids(tokenizer, ask), ids)
    assert_logprobs_match(reference, ids, logprobs, top=5)
    if temperature == 0:  # greedy takes the most likely: its own logprob heads the list
        assert all(lp.top[0].token_id == lp.token_id for lp in logprobs)


def test_no_logprobs_unless_asked(disagg):
    chunks, ids, _ = collect(disagg.stub(), chat_request("Say hi.", 4))
    assert ids and all(not c.logprobs for c in chunks)


def test_logprobs_without_alternatives(disagg, hf_model, tokenizer):
    ask = chat_request("Say hi.", 4, logprobs=True)
    chunks, ids, _ = collect(disagg.stub(), ask)
    logprobs = [lp for c in chunks for lp in c.logprobs]
    assert_logprobs_match(hf_logprobs(hf_model, prompt_ids(tokenizer, ask), ids), ids, logprobs, 0)
