"""End to end through the gRPC API: real NATS, real services, KV over real UCX."""

import concurrent.futures

import pytest

from shared.api import tandem_pb2 as pb
from tests.integration.helpers import (
    chat_request,
    collect,
    hf_greedy,
    hf_penalised_greedy,
    long_document,
)

pytestmark = pytest.mark.slow

PROMPTS = [
    chat_request("What is the capital of France?", 24),
    chat_request("Write a short poem about autumn leaves.", 40),
    pb.GenerateRequest(
        prompt="The three primary colors are", sampling=pb.SamplingParams(max_tokens=24)
    ),
]


@pytest.mark.parametrize("request_index", range(len(PROMPTS)))
def test_greedy_matches_hugging_face(disagg, hf_model, tokenizer, request_index):
    request = PROMPTS[request_index]
    chunks, ids, text = collect(disagg.stub(), request)
    assert ids == hf_greedy(hf_model, tokenizer, request)
    assert text == tokenizer.decode(ids, skip_special_tokens=True)
    last = chunks[-1]
    assert last.finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
    assert all(c.finish_reason == pb.FINISH_REASON_UNSPECIFIED for c in chunks[:-1])
    assert last.usage.completion_tokens == len(ids)


def test_long_prompt_matches_hugging_face(disagg, hf_model, tokenizer):
    request = chat_request(long_document(1500), 24)
    chunks, ids, _ = collect(disagg.stub(), request, timeout=300)
    assert 1300 <= chunks[-1].usage.prompt_tokens <= 1800
    assert ids == hf_greedy(hf_model, tokenizer, request)
    assert chunks[-1].timing.kv_transfer_ms > 0


def test_disaggregated_equals_colocated(disagg, colocated):
    for request in PROMPTS[:2] + [chat_request("Name three rivers.", 32, temperature=0.9, seed=7)]:
        _, remote_ids, remote_text = collect(disagg.stub(), request)
        chunks, local_ids, local_text = collect(colocated.stub(), request)
        assert remote_ids == local_ids and remote_text == local_text
        assert chunks[-1].timing.prefill_worker == chunks[-1].timing.decode_worker  # no transfer
        assert chunks[-1].timing.kv_transfer_ms == 0


def test_penalised_greedy_is_hugging_faces_colocated_and_disaggregated(
    disagg, colocated, hf_model, tokenizer
):
    """Penalties, logit bias and min_tokens: the first token drawn on the prefill worker, the
    rest on the decode worker, or all on one colocated worker; the same tokens as Hugging Face's
    processors give, and not the unpenalised ones."""
    question = "List the days of the week, twice."
    plain = hf_greedy(hf_model, tokenizer, chat_request(question, 24))
    request = chat_request(
        question, 24, repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.3
    )
    request.sampling.logit_bias[plain[1]] = -100.0  # the plain answer's second token: banned
    short = chat_request("Say only: yes.", 10, min_tokens=6)
    answers = []
    for asked in (request, short):
        expected = hf_penalised_greedy(hf_model, tokenizer, asked)
        _, remote, _ = collect(disagg.stub(), asked)
        chunks, local, _ = collect(colocated.stub(), asked)
        assert remote == local == expected
        assert chunks[-1].timing.kv_transfer_ms == 0  # colocated: no transfer
        answers.append(expected)
    assert answers[0] != plain
    assert len(hf_greedy(hf_model, tokenizer, chat_request("Say only: yes.", 10))) < 6
    assert len(answers[1]) >= 6  # its end token held back until then


def test_seeded_sampling_is_repeatable(disagg):
    request = chat_request(
        "Invent a name for a cat.", 24, temperature=1.0, top_p=0.9, top_k=50, seed=1234
    )
    first = collect(disagg.stub(), request)[1]
    assert collect(disagg.stub(), request)[1] == first
    other = chat_request(
        "Invent a name for a cat.", 24, temperature=1.0, top_p=0.9, top_k=50, seed=99
    )
    assert collect(disagg.stub(), other)[1] != first


def test_streams_in_chunks_with_usage_and_timing(disagg):
    chunks, ids, text = collect(
        disagg.stub(), chat_request("Count from one to ten in words.", 30, ignore_eos=True)
    )
    assert len(chunks) == 30 and len(ids) == 30
    last = chunks[-1]
    assert last.finish_reason == pb.FINISH_REASON_LENGTH
    assert last.usage.prompt_tokens > 0 and last.usage.completion_tokens == 30
    workers = {w.id: w.role for w in disagg.status().workers}
    assert workers[last.timing.prefill_worker] == "prefill"
    assert workers[last.timing.decode_worker] == "decode"
    assert 0 < last.timing.ttft_ms <= last.timing.total_ms
    assert last.timing.prefill_ms > 0 and last.timing.kv_transfer_ms > 0


def test_stop_string_ends_the_answer(disagg):
    request = chat_request("Tell me about the moon.", 40, ignore_eos=True)
    _, _, full = collect(disagg.stub(), request)
    stop = full[len(full) // 2 : len(full) // 2 + 4]
    assert len(stop) == 4, full
    request.sampling.stop.append(stop)
    chunks, _, text = collect(disagg.stub(), request)
    assert chunks[-1].finish_reason == pb.FINISH_REASON_STOP
    assert text == full[: full.index(stop)]


@pytest.mark.parametrize("stack_name", ["disagg", "colocated"])
def test_greedy_is_the_same_alone_and_in_a_batch_of_16(stack_name, request):
    stack = request.getfixturevalue(stack_name)
    requests = [chat_request(f"Give one fact about the number {n}.", 16) for n in range(16)]
    alone = [collect(stack.stub(), r)[1] for r in requests[:3]]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        together = list(pool.map(lambda r: collect(stack.stub(), r)[1], requests))
    assert together[:3] == alone
    stack.wait_idle()


def test_32_concurrent_streams_complete_correctly_and_free_the_pool(disagg):
    """Eight prompts, four streams each, all at once: every copy of a prompt gets the answer it
    gets alone (two of them asked alone first; the batch-of-16 test does the rest)."""
    before = {w.id: w.kv_blocks_used for w in disagg.wait_idle().workers}
    prompts = [
        chat_request(f"Describe the colour number {n} in one sentence.", 24, ignore_eos=True)
        for n in range(8)
    ]
    alone = [collect(disagg.stub(), r)[1] for r in prompts[:2]]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(
            pool.map(lambda i: collect(disagg.stub(), prompts[i % 8], timeout=300), range(32))
        )
    for i, (chunks, ids, _text) in enumerate(results):
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH and len(ids) == 24
        assert ids == results[i % 8][1], i
    assert [ids for _, ids, _ in results[:2]] == alone
    after = {w.id: w.kv_blocks_used for w in disagg.wait_idle().workers}
    assert after == before


def test_cluster_status_lists_the_workers(disagg):
    status = disagg.status()
    assert status.mode == "disaggregated"
    roles = sorted(w.role for w in status.workers)
    assert roles == ["decode", "prefill"]
    for w in status.workers:
        assert w.pid > 0 and w.kv_blocks_total > 0 and w.host


def test_health_reports_serving(disagg):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(disagg.channel())
    for service in ("", "tandem.v1.Tandem"):
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
