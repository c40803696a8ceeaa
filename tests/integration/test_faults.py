"""Workers killed (SIGKILL) under real requests: the request moves, the client's stream goes on.

One auto-mode stack, 2 prefill and 3 decode workers, killed one after another:
  0. the decode worker streaming an answer under a JSON schema (its first token masked and drawn on
     a prefill worker): the grammar is rebuilt on the next decode worker from the tokens already
     sent, and the answer goes on token-identical to an undisturbed run, and validates;
  1. a prefill worker, while it computes a long prompt: the decode worker frees the blocks it
     reserved and the request is prefilled again on the other prefill worker;
     then that one, the same way: with no prefill worker left, the request is prefilled locally
     on a decode worker;
  2. the decode worker streaming a request: the request is re-prefilled on the other decode worker
     from its prompt plus the tokens already sent, and the stream goes on;
  3. the last decode worker: nothing can take the request, and the client gets UNAVAILABLE.
Every output is token-identical to Hugging Face greedy (part 2's under penalties, a logit bias and
min_tokens), and the text is the text of the tokens.
"""

import concurrent.futures
import json
import os
import signal
import time

import grpc
import pytest

from harness.structured import ASK, City
from tests.integration.helpers import (
    assert_logprobs_match,
    chat_request,
    hf_greedy,
    hf_logprobs,
    hf_penalised_greedy,
    long_document,
    prompt_ids,
)
from tests.integration.stack import start_stack

pytestmark = pytest.mark.slow


def _worker(stack, role: str, busy: bool = True, killed: frozenset[str] = frozenset()):
    """The live worker of `role` that holds a request (running or queued); never one in `killed`
    (the scheduler lists a killed worker until its heartbeats have been missing for 3 s)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for w in stack.status().workers:
            if w.role == role and w.id not in killed and (not busy or w.running or w.queued):
                return w
        time.sleep(0.05)
    raise AssertionError(f"no busy {role} worker: {stack.status()}")


def _stream_and_kill(
    stack,
    request,
    role: str,
    after_tokens: int,
    timeout: float = 300,
    killed: frozenset[str] = frozenset(),
):
    """Streams `request`; once `after_tokens` tokens have come, SIGKILLs the busy `role` worker
    (not one in `killed`). Returns (responses, the killed worker)."""
    responses, victim, ids, killed_at, gap = [], None, 0, 0.0, 0.0
    stream = stack.stub().Generate(request, timeout=timeout)
    for response in stream:
        if killed_at and not gap:
            gap = time.monotonic() - killed_at
            print(f"{role} worker killed: the stream went on {gap:.1f}s later")
        responses.append(response)
        ids += len(response.token_ids)
        if victim is None and ids >= after_tokens:
            victim = _worker(stack, role, killed=killed)
            os.kill(victim.pid, signal.SIGKILL)
            killed_at = time.monotonic()
    return responses, victim


def _kill_mid_prefill(stack, request, killed: frozenset[str]):
    """Sends `request` (a long prompt); SIGKILLs the prefill worker computing it (not one in
    `killed`). (responses, killed)"""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: list(stack.stub().Generate(request, timeout=300)))
        prefill = _worker(stack, "prefill", killed=killed)
        os.kill(prefill.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        responses = pending.result()
    print(f"prefill worker killed mid-prefill: answered {time.monotonic() - killed_at:.1f}s later")
    return responses, prefill


def _kill_under_a_schema(stack):
    """Greedy under City's JSON schema, undisturbed and then with its decode worker SIGKILLed after
    12 tokens: the same tokens, a valid City, one move. Returns the killed worker."""
    # a prompt past the local-prefill threshold (64 tokens): its first token is drawn, masked, on
    # a prefill worker
    city = chat_request(f"{long_document(60)}\n\n{ASK} Answer in JSON.", 256)
    city.sampling.structured_output.json_schema = json.dumps(City.model_json_schema())
    undisturbed = list(stack.stub().Generate(city, timeout=300))
    expected = [t for r in undisturbed for t in r.token_ids]
    assert undisturbed[-1].timing.path == "disaggregated", undisturbed[-1].timing
    responses, victim = _stream_and_kill(stack, city, "decode", after_tokens=12)
    ids = [t for r in responses for t in r.token_ids]
    assert ids == expected
    City.model_validate_json("".join(r.text for r in responses))
    timing = responses[-1].timing
    assert timing.migrations == 1 and timing.decode_worker != victim.id, timing
    assert responses[-1].finish_reason == undisturbed[-1].finish_reason
    return victim


def test_killed_workers_lose_no_request(processes, nats, hf_model, tokenizer):
    stack = start_stack(
        processes,
        nats,
        "it-faults",
        "auto",
        prefill=2,
        decode=3,
        # part 3 finds no worker left: a second of asking again (--move-wait-s), not ten
        extra_env={"TANDEM_LOCAL_PREFILL_TOKENS": "64", "TANDEM_MOVE_WAIT_S": "1"},
    )
    try:
        # 0. A stream under a JSON schema loses its decode worker mid-answer.
        schema_victim = _kill_under_a_schema(stack)

        # 1. A prefill worker dies while it computes a long prompt, then the other one.
        killed_ids: set[str] = set()
        for question, path in (("river", "disaggregated"), ("forest", "local")):
            # distinct from the first token: no prefix cache shortens the prefill we kill
            long = chat_request(
                f"About the {question}. {long_document(700)} And near the {question}?", 8
            )
            responses, killed = _kill_mid_prefill(stack, long, frozenset(killed_ids))
            killed_ids.add(killed.id)
            ids = [t for r in responses for t in r.token_ids]
            assert ids == hf_greedy(hf_model, tokenizer, long)
            timing = responses[-1].timing
            assert (timing.migrations, timing.path) == (1, path), timing
            assert timing.prefill_worker != killed.id and responses[
                -1
            ].usage.completion_tokens == len(ids)

        # 2. The decode worker streaming a request of two choices dies after 10 tokens: each
        # choice moves on its own, and goes on with Hugging Face's tokens and logprobs. It is
        # penalised: the 10 tokens sent count as output on the next worker (and min_tokens).
        story = chat_request(
            "Write a long story about a fox who learns to sail.",
            40,
            repetition_penalty=1.2,
            frequency_penalty=0.3,
            presence_penalty=0.2,
            min_tokens=30,
        )
        story.sampling.logit_bias[tokenizer.encode(" boat", add_special_tokens=False)[0]] = -100
        story.sampling.logprobs, story.sampling.top_logprobs, story.sampling.n = True, 3, 2
        responses, victim = _stream_and_kill(
            stack, story, "decode", after_tokens=10, killed=frozenset({schema_victim.id})
        )
        expected = hf_penalised_greedy(hf_model, tokenizer, story)
        reference = hf_logprobs(hf_model, prompt_ids(tokenizer, story), expected)
        for index in (0, 1):
            mine = [r for r in responses if r.index == index]
            ids = [t for r in mine for t in r.token_ids]
            assert ids == expected, index
            assert_logprobs_match(reference, ids, [lp for r in mine for lp in r.logprobs], 3)
            text = "".join(r.text for r in mine)
            assert text == tokenizer.decode(ids, skip_special_tokens=True)
            timing, usage = mine[-1].timing, mine[-1].usage
            assert timing.migrations == 1 and timing.decode_worker != victim.id, timing
            assert usage.completion_tokens == len(ids) and usage.prompt_tokens > 0

        # Nothing is left held: the surviving decode worker's KV pool is all free again.
        deadline = time.monotonic() + 30
        while {w.role for w in stack.status().workers} != {
            "decode"
        } and time.monotonic() < deadline:
            time.sleep(0.2)  # the killed workers leave the registry once their heartbeats stop
        status = stack.wait_idle()
        assert [w.role for w in status.workers] == ["decode"], status

        # 3. The last decode worker dies: no worker can take the request.
        with pytest.raises(grpc.RpcError) as err:
            _stream_and_kill(stack, story, "decode", after_tokens=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "stopped responding" in err.value.details() and "no live" in err.value.details(), (
            err.value.details()
        )
    finally:
        stack.stop()
