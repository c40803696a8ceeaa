"""The only prefill worker SIGKILLed mid-prompt (issue 44): a disaggregated stack of one prefill
and one decode worker. The decode worker fails the attempt, blaming the lost worker; placed again
with that one avoided, the request finds no live prefill worker and, under the scheduler's default
`prefill_fallback` (local), is prefilled on the decode worker, which holds the same model. It
completes token-identical to Hugging Face greedy, the scheduler counts the fallback, and no KV
block is held afterwards: none used, leaked or quarantined.

(With TANDEM_PREFILL_FALLBACK=fail in the environment, which the stack's processes inherit, the
request fails with UNAVAILABLE, as it did before the setting.)
"""

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.helpers import chat_request, hf_greedy, long_document
from tests.integration.stack import start_stack
from tests.integration.test_faults import _kill_mid_prefill

pytestmark = pytest.mark.slow


def _fallbacks(stack) -> float:
    """The scheduler's count of requests prefilled on their decode worker for want of a prefill
    worker."""
    port = stack.metrics_ports[f"{stack.cluster}-scheduler"]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem_scheduler_prefill_fallbacks_total"
    )


def _nothing_held(stack, timeout: float = 30):
    """Until the killed worker has left the registry and the decode worker holds no request and no
    KV block, none leaked and none quarantined (a receive whose peer died is reclaimed once the
    peer is known gone). Its status."""
    deadline = time.monotonic() + timeout
    while True:
        status = stack.status()
        if [w.role for w in status.workers] == ["decode"] and all(
            (w.running, w.queued, w.kv_blocks_used, w.kv_blocks_leaked, w.kv_blocks_quarantined)
            == (0, 0, 0, 0, 0)
            for w in status.workers
        ):
            return status
        assert time.monotonic() < deadline, f"blocks still held: {status}"
        time.sleep(0.2)


def test_the_only_prefill_worker_killed_mid_prompt_costs_no_request(
    processes, nats, hf_model, tokenizer
):
    stack = start_stack(processes, nats, "it-last-prefill", "disaggregated", prefill=1, decode=1)
    try:
        # a prompt long enough to be caught mid-prefill
        long = chat_request(f"About the marsh. {long_document(1200)} And near the marsh?", 8)
        started = time.monotonic()
        responses, killed = _kill_mid_prefill(stack, long, frozenset())
        print(f"answered {time.monotonic() - started:.1f}s after it was sent")
        ids = [t for r in responses for t in r.token_ids]
        assert ids == hf_greedy(hf_model, tokenizer, long)
        timing = responses[-1].timing
        assert (timing.migrations, timing.path) == (1, "local"), timing
        assert timing.prefill_worker != killed.id and responses[-1].usage.completion_tokens == len(
            ids
        )
        assert _fallbacks(stack) == 1
        _nothing_held(stack)
    finally:
        stack.stop()
