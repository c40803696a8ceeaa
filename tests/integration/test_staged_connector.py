"""The second KV connector in a whole stack: decode workers that ask for `staged` transfers (a
message per segment, gathered by the prefill worker's helper and scattered into the decode pool)
answer token-identical to Hugging Face and to the push connector's stack, many at once, and free
every block they took."""

import concurrent.futures

import pytest

from shared.api import tandem_pb2 as pb
from tests.integration.helpers import chat_request, collect, hf_greedy, long_document
from tests.integration.stack import start_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def staged(processes, nats):
    # segments of 64 tokens: a prompt is many staged messages, each over several decode runs
    decode_env = {"TANDEM_KV_CONNECTOR": "staged", "TANDEM_KV_SEGMENT_TOKENS": "64"}
    return start_stack(processes, nats, "it-staged", role_env={"decode": decode_env})


def test_a_staged_stack_answers_as_hugging_face_and_as_push(staged, disagg, hf_model, tokenizer):
    long = chat_request(long_document(1200), 16)
    chunks, ids, _ = collect(staged.stub(), long, timeout=300)
    assert ids == hf_greedy(hf_model, tokenizer, long)
    assert chunks[-1].timing.kv_transfer_ms > 0 and chunks[-1].timing.prefill_worker
    assert ids == collect(disagg.stub(), long, timeout=300)[1]


def test_staged_transfers_into_a_busy_pool_free_every_block(staged):
    """Sixteen streams at once fragment the decode pool; every answer is the one it gets alone."""
    before = {w.id: w.kv_blocks_used for w in staged.wait_idle().workers}
    prompts = [chat_request(f"Tell me a fact about the number {n}.", 16) for n in range(4)]
    alone = [collect(staged.stub(), r)[1] for r in prompts]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: collect(staged.stub(), prompts[i % 4]), range(16)))
    for i, (chunks, ids, _) in enumerate(results):
        assert chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert ids == alone[i % 4], i
    status = staged.wait_idle()
    assert {w.id: w.kv_blocks_used for w in status.workers} == before
    assert all(w.kv_blocks_leaked == w.kv_blocks_quarantined == 0 for w in status.workers)
