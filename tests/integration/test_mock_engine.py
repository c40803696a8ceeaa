"""Mock workers (--engine mock) in real stacks: real NATS, scheduler and gateway, the KV of a
disaggregated request moved over real UCX at the real model's bytes per token; answers as the
mock promises (the same on either path); a fleet of workers in one process (--mock-workers)
registered one by one, sharing the load, every block back afterwards."""

import threading
import time

import pytest
from transformers import AutoConfig

from shared.api import tandem_pb2 as pb
from shared.engine.dtypes import compute_dtype
from shared.engine.kv_cache import bytes_per_token, layout_of
from shared.worker.mock_runtime import answer_ids
from tests.integration.stack import start_stack

pytestmark = pytest.mark.slow

MOCK = {"TANDEM_ENGINE": "mock", "TANDEM_MOCK_SPEEDUP": "0"}
PROMPT = [1 + (i * 37) % 1000 for i in range(100)]


def expected(tokenizer, model_dir, prompt: list[int], n: int) -> list[int]:
    vocab = answer_ids(tokenizer, AutoConfig.from_pretrained(model_dir))
    tokens = list(prompt)
    for _ in range(n):
        mixed = (tokens[-1] * 1_000_003 + len(tokens) * 7_919) % len(vocab)
        tokens.append(vocab.start + mixed)
    return tokens[len(prompt) :]


def generate(stack, prompt: list[int], max_tokens: int) -> list[int]:
    request = pb.GenerateRequest(
        prompt_token_ids=prompt,
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
    )
    return [t for r in stack.stub().Generate(request, timeout=60) for t in r.token_ids]


@pytest.fixture(scope="module")
def mock_disagg(processes, nats):
    stack = start_stack(processes, nats, "it-mock-d", "disaggregated", extra_env=MOCK)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def mock_fleet(processes, nats):
    env = {**MOCK, "TANDEM_MOCK_WORKERS": "3", "TANDEM_MAX_NUM_SEQS": "4"}
    stack = start_stack(processes, nats, "it-mock-c", "colocated", extra_env=env)
    yield stack
    stack.stop()


def test_a_disaggregated_request_moves_the_real_kv_bytes(mock_disagg, tokenizer, model_dir):
    before = {w.id: w.kv_bytes_received for w in mock_disagg.status().workers}
    assert generate(mock_disagg, PROMPT, 24) == expected(tokenizer, model_dir, PROMPT, 24)
    status = mock_disagg.wait_idle()
    decode = next(w for w in status.workers if w.role == "decode")
    config = AutoConfig.from_pretrained(model_dir)
    per_token = bytes_per_token(layout_of(config, "m", compute_dtype("auto", config, "cpu")))
    assert decode.kv_bytes_received - before[decode.id] >= len(PROMPT) * per_token
    assert "mock engine" in decode.kernels
    # UCX's transport, as the sender saw it: in the prefill worker's first heartbeat after the
    # send (a mock prefill can start and end between two beats, so the status read at idle may
    # still hold the one from before)
    deadline = time.monotonic() + 10
    while not _prefill(mock_disagg.status()).kv_transport:
        assert time.monotonic() < deadline, "the prefill worker never reported its transport"
        time.sleep(0.1)


def _prefill(status: pb.ClusterStatusResponse) -> pb.WorkerStatus:
    return next(w for w in status.workers if w.role == "prefill")


def test_a_fleet_of_mock_workers_in_one_process_shares_the_load(mock_fleet, tokenizer, model_dir):
    status = mock_fleet.wait_idle()
    assert len(status.workers) == 3
    assert len({w.id for w in status.workers}) == 3
    assert len({w.pid for w in status.workers}) == 1  # one process
    prompts = [[5 + i] + PROMPT[: 20 + i] for i in range(12)]
    answers: dict[int, list[int]] = {}

    def one(i: int) -> None:
        answers[i] = generate(mock_fleet, prompts[i], 32)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for i, prompt in enumerate(prompts):
        assert answers.get(i) == expected(tokenizer, model_dir, prompt, 32), i
    deadline = time.monotonic() + 10  # each worker's count comes with its next heartbeat
    while sum(served := [w.requests_served for w in mock_fleet.wait_idle().workers]) < 12:
        assert time.monotonic() < deadline, served
        time.sleep(0.1)
    assert sum(1 for s in served if s) >= 2, served  # 4 seqs each at most
    status = mock_fleet.wait_idle()
    assert all(w.kv_blocks_leaked == 0 for w in status.workers)
