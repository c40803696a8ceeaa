"""A crash inside UCX costs the transfers in flight, not the worker: each worker's UCX runs in a
data-plane helper process, and here that helper is killed as UCX's use after free kills it
(SIGSEGV) while a long prompt's KV is due to move, first the decode worker's, then the prefill
worker's. Each time the worker process lives on (same pid, same id), starts a new helper, and the
request completes token-identical to Hugging Face greedy, with no KV block leaked on either side;
the next request goes through the new helpers."""

import concurrent.futures
import os
import signal
import time

import pytest

from tests.integration.helpers import chat_request, hf_greedy, long_document
from tests.integration.stack import start_stack
from tests.integration.test_data_plane import _helpers

pytestmark = pytest.mark.slow


def _busy_prefill(stack):
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for w in stack.status().workers:
            if w.role == "prefill" and (w.running or w.queued):
                return w
        time.sleep(0.02)
    raise AssertionError(f"no busy prefill worker: {stack.status()}")


def _crash_helper_mid_prefill(stack, role: str, request) -> list[int]:
    """Streams `request`; once its prompt is being computed, SIGSEGVs `role`'s helper. The ids."""
    worker = next(w for w in stack.status().workers if w.role == role)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(lambda: list(stack.stub().Generate(request, timeout=300)))
        _busy_prefill(stack)  # the prompt is being computed: its receives are posted
        (doomed,) = _helpers(worker.pid)
        os.kill(doomed, signal.SIGSEGV)
        responses = pending.result()
    assert _helpers(worker.pid) not in ([], [doomed])  # a new helper took over
    return [t for r in responses for t in r.token_ids]


def test_a_helper_crash_costs_no_request_and_no_worker(processes, nats, hf_model, tokenizer):
    stack = start_stack(processes, nats, "it-helper", "disaggregated")
    try:
        before = {w.role: (w.id, w.pid) for w in stack.status().workers}
        for role in ("decode", "prefill"):
            request = chat_request(f"On {role}s. {long_document(500)} What about the {role}?", 6)
            assert _crash_helper_mid_prefill(stack, role, request) == hf_greedy(
                hf_model, tokenizer, request
            ), role
            after = {w.role: (w.id, w.pid) for w in stack.status().workers}
            assert after == before  # no worker died or was replaced
            stack.wait_idle()  # nothing held, nothing leaked
        again = chat_request("Name three rivers.", 4)
        assert [t for r in stack.stub().Generate(again, timeout=120) for t in r.token_ids] == (
            hf_greedy(hf_model, tokenizer, again)
        )
    finally:
        stack.stop()
