"""Tensor-parallel workers in real stacks: prefill and decode workers of different degrees, their
KV moved rank to rank over UCX, greedy output token-identical to Hugging Face `generate`; a
black-box client sees nothing different but `tandem status`. Through `tandem up`: the degrees
as flags, and a decode group that loses a rank mid-stream (the stream completes on another
worker, the group comes back, no process is left behind)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.cli.processes import free_port
from tests.integration.stack import Stack, start_stack
from tests.integration.test_families import (
    busy_decode_worker,
    hf_greedy,
    ids_request,
    random_ids,
    served,
)
from tests.integration.test_launcher import _alive, _launch, _read_until

pytestmark = pytest.mark.slow
ENV = {"TANDEM_PREFILL_CHUNK_TOKENS": "32", "TANDEM_KV_SEGMENT_TOKENS": "64"}


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _degrees(stack: Stack) -> dict[str, int]:
    return {w.role: w.tp for w in stack.status().workers}


@pytest.mark.parametrize(
    "name, prefill_tp, decode_tp",
    [
        ("qwen2.5-heads", 2, 2),  # 14 query heads, 2 KV heads: one each, rank to rank
        ("gemma", 2, 1),  # one KV head, held by both prefill ranks: one sends it
    ],  # 1 -> 2 and 3 -> 1 run through `tandem up` below; every pair on five layouts, without
    # NATS and UCX: test_tp_matrix.py
)
def test_workers_of_any_degrees_serve_what_hugging_face_generates(
    processes, nats, family_checkpoint, name, prefill_tp, decode_tp
):
    path = family_checkpoint(name)
    roles = {"prefill": {"TANDEM_TP": str(prefill_tp)}, "decode": {"TANDEM_TP": str(decode_tp)}}
    env = {**ENV, "TANDEM_MODEL": str(path)}
    stack = start_stack(
        processes,
        nats,
        f"tp{prefill_tp}{decode_tp}-{name.replace('.', '')}",
        "disaggregated",
        extra_env=env,
        role_env=roles,
    )
    try:
        assert _degrees(stack) == {"prefill": prefill_tp, "decode": decode_tp}
        model = _hf(path)
        for prompt in (random_ids(70, 5), random_ids(9, 6)):  # several segments; one block
            ids, timing = served(stack, prompt, 12)
            assert ids == hf_greedy(model, prompt, 12), (name, prefill_tp, decode_tp)
            assert timing.path == "disaggregated", timing
        by_role = {w.role: w for w in stack.status().workers}
        assert by_role["decode"].kv_bytes_received > 0
        assert by_role["decode"].kv_blocks_leaked == 0 and by_role["prefill"].kv_blocks_leaked == 0
        stack.wait_idle()
    finally:
        stack.stop()


def _status(port: int) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "shared.cli.main", "status", "--address", f"127.0.0.1:{port}"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _up(tmp_path, *command: str, model: str = "") -> tuple[subprocess.Popen, Stack]:
    """`tandem up ...` (`command`, its first two words "tandem", "up"), serving `model` (the
    default without)."""
    port = free_port()
    flags = (*command[2:], "--no-demo", *(("--model", model) if model else ()))
    proc = _launch(tmp_path, port, *flags)
    _read_until(proc, lambda lines: lines and "tandem is ready" in lines[-1], 300)
    return proc, Stack("tandem-up", f"127.0.0.1:{port}", None, "disaggregated", [])


def _stop(proc: subprocess.Popen) -> None:
    os.killpg(proc.pid, signal.SIGINT)
    proc.wait(60)


def test_tandem_up_prefill_tp_3_serves_the_default_model_as_hugging_face_does(tmp_path, model_dir):
    """The README's command: SmolLM2 (9 query heads, 3 KV heads) prefilled by three ranks."""
    proc, stack = _up(tmp_path, "tandem", "up", "--mode", "disaggregated", "--prefill-tp", "3")
    try:
        prompt = random_ids(80, 7)
        ids, timing = served(stack, prompt, 10)
        assert ids == hf_greedy(_hf(model_dir), prompt, 10)
        assert timing.path == "disaggregated"
        text = _status(int(stack.address.rsplit(":", 1)[1]))
        ranks = (
            r"rank 0: q 0-2, kv 0-0 \(pid \d+\); rank 1: q 3-5, kv 1-1 .*; rank 2: q 6-8, kv 2-2"
        )
        assert re.search(rf"tp 3: {ranks}", text), text
    finally:
        _stop(proc)


def test_a_tandem_up_refuses_a_degree_that_does_not_split_the_heads(tmp_path, family_checkpoint):
    proc = _launch(
        tmp_path,
        free_port(),
        "--model",
        str(family_checkpoint("qwen2.5-heads")),
        "--decode-tp",
        "4",
    )
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 2
    assert "degrees that would: 1, 2, 14" in out


def test_a_decode_rank_killed_mid_stream_moves_the_stream_and_the_group_comes_back(
    tmp_path, family_checkpoint
):
    path = family_checkpoint("qwen2.5-heads")
    up = ("tandem", "up", "--mode", "disaggregated", "--decode", "2", "--decode-tp", "2")
    proc, stack = _up(tmp_path, *up, model=str(path))
    try:
        prompt, victim, ids = random_ids(40, 8), None, []
        for response in stack.stub().Generate(ids_request(prompt, 300), timeout=240):
            ids += response.token_ids
            if victim is None and len(ids) >= 4:
                victim = busy_decode_worker(stack)
                rank_pids = [int(p) for p in re.findall(r"pid (\d+)", " ".join(victim.tp_ranks))]
                os.kill(rank_pids[1], signal.SIGKILL)  # rank 1: rank 0 is the worker
        assert ids == hf_greedy(_hf(path), prompt, 300)
        timing = response.timing
        assert timing.migrations == 1 and timing.decode_worker != victim.id, timing
        deadline = time.monotonic() + 120  # the launcher starts a worker in its place
        while True:
            decode = [w for w in stack.status().workers if w.role == "decode"]
            if len(decode) == 2 and victim.id not in {w.id for w in decode}:
                break
            assert time.monotonic() < deadline, decode
            time.sleep(0.5)
        assert all(w.tp == 2 and len(w.tp_ranks) == 2 for w in decode)
        assert not any(_alive(pid) for pid in rank_pids)  # nothing of the old group hangs on
    finally:
        _stop(proc)
