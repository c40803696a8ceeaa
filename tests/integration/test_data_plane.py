"""The KV cache moves over UCX, worker to worker, and never touches NATS."""

import os
import time

import pytest

from shared.control.messages import KVLayout
from shared.engine.kv_cache import bytes_per_token
from tests.integration.helpers import chat_request, collect, long_document

pytestmark = pytest.mark.slow


def test_kv_bytes_never_cross_nats(disagg, nats, hf_model):
    before_nats = nats.varz()
    before = {w.id: w for w in disagg.status().workers}
    chunks, ids, _ = collect(disagg.stub(), chat_request(long_document(1500), 8), timeout=300)

    config = hf_model.config
    layout = KVLayout(
        "m",
        "float32",
        config.num_hidden_layers,
        config.num_key_value_heads,
        config.hidden_size // config.num_attention_heads,
    )
    blocks = -(-chunks[-1].usage.prompt_tokens // 16)  # whole blocks travel (16 tokens each)
    kv_bytes = blocks * 16 * bytes_per_token(layout)
    decode_id, prefill_id = chunks[-1].timing.decode_worker, chunks[-1].timing.prefill_worker
    deadline = time.monotonic() + 5
    while True:  # the counters travel in heartbeats, every 0.5 s
        after = {w.id: w for w in disagg.status().workers}
        received = after[decode_id].kv_bytes_received - before[decode_id].kv_bytes_received
        sent = after[prefill_id].kv_bytes_sent - before[prefill_id].kv_bytes_sent
        if (received, sent) == (kv_bytes, kv_bytes) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    after_nats = nats.varz()
    assert received == sent == kv_bytes  # ~66 MiB for this prompt, all over UCX

    # Everything NATS carried in that time (all clusters, heartbeats included) is a sliver of it.
    nats_in = after_nats["in_bytes"] - before_nats["in_bytes"]
    nats_out = after_nats["out_bytes"] - before_nats["out_bytes"]
    assert nats_in + nats_out < kv_bytes / 100, (nats_in, nats_out, kv_bytes)
    assert after_nats["max_payload"] <= 1024 * 1024


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _helpers(pid: int) -> list[int]:
    """The data-plane helper processes a worker started (its UCX runs there)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(child) for child in f.read().split()]
    out = []
    for child in children:
        with open(f"/proc/{child}/cmdline", "rb") as f:
            if b"shared.dataplane.helper" in f.read():
                out.append(child)
    return out


def test_workers_idle_after_a_transfer_use_no_cpu(disagg):
    # A KV transfer wakes each side's UCX progress; afterwards nothing may spin (ucxx's own
    # blocking mode never re-armed the worker and kept a core busy for good). UCX runs in each
    # worker's data-plane helper process: it is counted with its worker.
    collect(disagg.stub(), chat_request(long_document(600), 4), timeout=300)
    disagg.wait_idle()
    workers = {w.id: w.pid for w in disagg.status().workers}
    families = {name: [pid, *_helpers(pid)] for name, pid in workers.items()}
    assert all(len(pids) == 2 for pids in families.values()), families  # one helper each
    before = {name: sum(map(_cpu_seconds, pids)) for name, pids in families.items()}
    time.sleep(3)
    used = {name: sum(map(_cpu_seconds, pids)) - before[name] for name, pids in families.items()}
    assert all(seconds < 0.5 for seconds in used.values()), used  # heartbeats only: a few ms
