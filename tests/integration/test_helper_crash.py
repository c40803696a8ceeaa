"""A crash inside UCX costs the transfers in flight, not the worker: each worker's UCX runs in a
data-plane helper process, and here that helper is killed as UCX's use after free kills it
(SIGSEGV) while a long prompt's KV is due to move. The worker process lives on (same pid, same
id), starts a new helper, and the request completes token-identical to Hugging Face greedy, with
no KV block leaked on either side; the next request goes through the new helper."""

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


@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_a_helper_crash_costs_no_request_and_no_worker(processes, nats, hf_model, tokenizer, role):
    stack = start_stack(processes, nats, f"it-helper-{role}", "disaggregated")
    try:
        before = {w.role: w for w in stack.status().workers}
        request = chat_request(f"On {role}s. {long_document(500)} What about the {role}?", 6)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(lambda: list(stack.stub().Generate(request, timeout=300)))
            _busy_prefill(stack)  # the prompt is being computed: its receives are posted
            (doomed,) = _helpers(before[role].pid)
            os.kill(doomed, signal.SIGSEGV)
            responses = pending.result()
        ids = [t for r in responses for t in r.token_ids]
        assert ids == hf_greedy(hf_model, tokenizer, request)
        after = {w.role: w for w in stack.status().workers}
        assert {r: (w.id, w.pid) for r, w in after.items()} == {
            r: (w.id, w.pid) for r, w in before.items()
        }  # no worker died or was replaced
        assert _helpers(after[role].pid) not in ([], [doomed])  # a new helper took over
        stack.wait_idle()  # nothing held, nothing leaked
        again = chat_request("Name three rivers.", 4)
        assert [t for r in stack.stub().Generate(again, timeout=120) for t in r.token_ids] == (
            hf_greedy(hf_model, tokenizer, again)
        )
    finally:
        stack.stop()
