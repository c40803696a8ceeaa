"""Every combination of prefill and decode degree in {1, 2}, on every layout whose query heads
divide by 2, against Hugging Face `generate` on the same checkpoint.

For each layout a worker runtime of TP=1 and one of TP=2 (real rank processes, as a worker loads
them) are loaded once; for each (prefill, decode) pair the prompt is computed by the prefill
runtime (a prompt-only sequence, as a prefill worker's), its KV moved into the decode runtime's
reserved blocks by the KV-transfer interface (each piece assembled in the receiving rank's
layout; in-process planes: the stacks of test_tensor_parallel.py move it over UCX), and the
decode runtime generates from the prefill's first token. Greedy fp32: the tokens must equal HF's.
"""

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM

from shared.control.messages import KVDestination
from shared.control.worker_roles import Role
from shared.engine.sequence import Sequence
from shared.kvtransfer.connector import connector
from shared.kvtransfer.plan import new_base_tag
from shared.values.sampling import SamplingParams
from shared.worker.runtime import WorkerRuntime, load_runtime
from shared.worker.settings import WorkerSettings
from tests.fakes.dataplane import InProcessDataPlane, LoopbackNetwork
from tests.integration.test_families import hf_greedy, random_ids

pytestmark = pytest.mark.slow
LAYOUTS = ["llama3", "qwen2.5-heads", "qwen3", "gemma", "phi3", "phi3-longrope"]  # 8:2 ... 2:2
NEW = 10


def runtime_of(path, tp: int) -> WorkerRuntime:
    settings = WorkerSettings(model=str(path), tp=tp, kv_cache_mb=16, prefill_chunk_tokens=32)
    return load_runtime(settings, Role.DECODE)


def prefill(rt: WorkerRuntime, prompt: list[int]) -> Sequence:
    seq = Sequence("p", prompt, SamplingParams(max_tokens=1), None, set(), 512, True)
    rt.engine.add(seq)
    while not seq.output_ids:
        rt.engine.step()
    return seq


async def move(source: WorkerRuntime, sent: Sequence, target: WorkerRuntime, seq: Sequence):
    net = LoopbackNetwork()
    where = KVDestination(
        ucx_address=b"decode",
        base_tag=new_base_tag(11),
        block_ids=seq.block_table,
        segment_tokens=32,
        lease_s=5.0,
        prefill_tp=source.tp,
        decode_tp=target.tp,
    )
    receiver = connector("push", InProcessDataPlane(net, "decode"), target.pools).reserve(
        target.layout, seq.prompt_len, where
    )
    receiver.start()
    sender = connector("push", InProcessDataPlane(net, "prefill"), source.pools).sender(
        source.layout, seq.prompt_len, where
    )
    for segment in sender.ready(seq.prompt_len):
        staged = sender.stage(segment, sent.block_table)
        sender.send(staged.direct)
        sender.send(sender.gather(staged))
    await sender.finish()
    await asyncio.wait_for(receiver.done.wait(), 10)
    receiver.check(5.0)


def served(source: WorkerRuntime, target: WorkerRuntime, prompt: list[int]) -> list[int]:
    sent = prefill(source, prompt)
    seq = Sequence("d", prompt, SamplingParams(max_tokens=NEW, ignore_eos=True), None, set(), 512)
    assert target.engine.admit(seq)
    asyncio.run(move(source, sent, target, seq))
    source.engine.release(sent)
    seq.first_tokens = list(sent.output_ids)
    target.engine.kv_arrived(seq)
    while not seq.status.finished:
        target.engine.step()
    target.engine.release(seq)
    return seq.output_ids


@pytest.mark.parametrize("name", LAYOUTS)
def test_every_pair_of_degrees_decodes_what_hugging_face_generates(family_checkpoint, name):
    path = family_checkpoint(name)
    prompt = random_ids(150, 12)  # five 32-token chunks (past longrope's trained length)
    want = hf_greedy(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), prompt, NEW)
    runtimes = {1: runtime_of(path, 1), 2: runtime_of(path, 2)}
    try:
        got = {(p, d): served(runtimes[p], runtimes[d], prompt) for p in (1, 2) for d in (1, 2)}
    finally:
        runtimes[2].close()
    assert got == {pair: want for pair in got}
    assert all(rt.blocks.used == 0 for rt in runtimes.values())  # every block freed
