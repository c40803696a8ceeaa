"""Leases and aborts of KV transfers against real services: whatever happens to a request or a
worker, every block comes back and the leaked-block counter stays at zero."""

import asyncio
import os
import random
import signal
import threading
import time

import grpc
import pytest

from shared.control.bus import NatsBus
from shared.control.failure import Code
from shared.control.messages import (
    GenerateTask,
    KVDestination,
    KVLayout,
    PrefillTask,
    SamplingParams,
    TaskAck,
)
from shared.control.subjects import Subjects
from tests.integration.helpers import chat_request, long_document
from tests.integration.stack import start_stack

pytestmark = pytest.mark.slow


def assert_no_leaks(stack) -> None:
    status = stack.wait_idle(60)
    assert all(w.kv_blocks_leaked == 0 for w in status.workers), status


def test_random_cancellations_leak_no_block(disagg):
    """200 requests, half cancelled at a random moment: before, during or after their KV moves."""
    rng = random.Random(7)
    document = long_document(900)
    outcomes, lock = [], threading.Lock()

    def one(i: int) -> None:
        words = rng.randint(10, 600)
        request = chat_request(document[: words * 5] + f" #{i}", rng.randint(1, 12))
        cancel_after = rng.choice(
            [None, rng.uniform(0.0, 0.05), rng.uniform(0.05, 0.6), rng.uniform(0.6, 1.5)]
        )
        stream = disagg.stub().Generate(request, timeout=120)
        if cancel_after is not None:
            threading.Timer(cancel_after, stream.cancel).start()
        try:
            chunks = list(stream)
            result = "ok" if chunks and chunks[-1].finish_reason else "empty"
        except grpc.RpcError as err:
            result = (
                err.code().name
                if err.code() == grpc.StatusCode.CANCELLED
                else f"{err.code().name}: {err.details()}"
            )
        with lock:
            outcomes.append(result)

    queue = list(range(200))
    workers = [
        threading.Thread(
            target=lambda: [one(queue.pop()) for _ in iter(lambda: bool(queue), False)]
        )
        for _ in range(12)
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(600)
    assert len(outcomes) == 200
    assert set(outcomes) <= {"ok", "CANCELLED"}, [
        o for o in outcomes if o not in ("ok", "CANCELLED")
    ]
    assert outcomes.count("ok") >= 50 and outcomes.count("CANCELLED") >= 30
    assert_no_leaks(disagg)
    assert not disagg.dead()


def test_layout_mismatch_is_refused_before_any_transfer(disagg, nats):
    prefill = next(w for w in disagg.status().workers if w.role == "prefill")
    layout = KVLayout(
        model="SmolLM2-135M-Instruct",
        dtype="float32",
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        block_size=32,
    )
    task = PrefillTask(
        task=GenerateTask(
            attempt_id="mismatch",
            prompt_token_ids=list(range(100, 164)),
            sampling=SamplingParams(),
            reply_subject="",
            arrival_time=time.time(),
        ),
        layout=layout,
        destination=KVDestination(ucx_address=b"x", base_tag=1 << 40, block_ids=[0, 1]),
        decode_worker="nobody",
    )

    async def ask() -> TaskAck:
        async with NatsBus(nats.url, "test-layout") as bus:
            return await bus.request(
                Subjects(disagg.cluster).prefill_tasks(prefill.id), task, 5.0, TaskAck
            )

    ack = asyncio.run(ask())
    failure = ack.failure
    assert failure and failure.code is Code.FAILED_PRECONDITION and not failure.movable, ack
    assert "layout mismatch" in failure.message, ack


def test_aborts_travel_both_ways_and_free_both_pools(processes, nats):
    # A short drain: on SIGTERM the prefill worker gives up on its prompt after 0.5 s instead of finishing it.
    stack = start_stack(
        processes,
        nats,
        "it-abort",
        extra_env={
            "TANDEM_KV_SEGMENT_TOKENS": "256",
            "TANDEM_DRAIN_TIMEOUT_S": "0.5",
            "TANDEM_PREFILL_FALLBACK": "fail",  # the request must fail, not be prefilled locally
        },
    )
    pids = {name: proc.pid for name, proc in processes.children}
    prefill = pids["it-abort-prefill-0"]
    try:
        # decode -> prefill: the prefill worker freezes mid-prompt; the decode worker's lease on it
        # runs out (its heartbeats stop), it frees its blocks and tells the prefill worker, which
        # frees its own when it wakes up.
        stream = stack.stub().Generate(chat_request(long_document(3000), 8), timeout=120)
        time.sleep(1.5)
        os.kill(prefill, signal.SIGSTOP)
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert (
            err.value.code() == grpc.StatusCode.UNAVAILABLE
            and "stopped responding" in err.value.details()
        )
        os.kill(prefill, signal.SIGCONT)
        assert_no_leaks(stack)
        deadline = time.monotonic() + 10
        while "transfer aborted by its decode worker" not in processes.log_tail(
            "it-abort-prefill-0", 200
        ):
            assert time.monotonic() < deadline, processes.log_tail("it-abort-prefill-0")
            time.sleep(0.2)
        # the thawed prefill worker is placed on again only once a scheduler hears it (until
        # then a request is refused at once: "no live prefill worker")
        deadline = time.monotonic() + 30
        while not any(w.role == "prefill" for w in stack.wait_idle(60).workers):
            assert time.monotonic() < deadline, "no scheduler hears the thawed prefill worker"
            time.sleep(0.2)

        # prefill -> decode: the prefill worker shuts down mid-prompt and says so; the decode
        # worker frees the blocks it had reserved and the client hears why.
        stream = stack.stub().Generate(chat_request(long_document(3000) + " again", 8), timeout=120)
        time.sleep(1.5)
        os.kill(prefill, signal.SIGTERM)
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
        assert (
            err.value.code() == grpc.StatusCode.UNAVAILABLE and "shut down" in err.value.details()
        )
        deadline = time.monotonic() + 10
        while any(w.kv_blocks_used for w in stack.status().workers if w.role == "decode"):
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert all(w.kv_blocks_leaked == 0 for w in stack.status().workers)
    finally:
        stack.stop()
