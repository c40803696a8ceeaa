"""Every supported family served by real services, against Hugging Face on the same checkpoint.

For each variant of harness/families.py (random weights, real HF directories) one auto-mode stack
(a scheduler, a prefill worker, a decode worker, a gateway) serves greedy requests whose output
must equal HF `generate`, token for token:
  - a short prompt, prefilled on the decode worker (path "local", the colocated path);
  - a long one (several 32-token chunks; past every sliding window and past the trained length
    of the dynamic and longrope variants), prefilled on the prefill worker and its KV sent over
    UCX (path "disaggregated");
  - the long one again with more after it: its prefix is served from a prefix cache (except
    where the rope's frequencies depend on the sequence's length: never past the trained one).
Qwen3 and Gemma also lose their decode worker mid-stream (the request moves to the other one).
A prefill and a decode worker of different models never pair: the request gets a clear error.
"""

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from harness.families import VARIANTS, VOCAB
from shared.api import tandem_pb2 as pb
from tests.integration.stack import start_stack

pytestmark = pytest.mark.slow
LENGTH_DEPENDENT = ("llama-dynamic", "phi3-longrope")  # rope frequencies by sequence length
ENV = {"TANDEM_LOCAL_PREFILL_TOKENS": "64", "TANDEM_PREFILL_CHUNK_TOKENS": "32"}


def ids_request(prompt: list[int], max_tokens: int) -> pb.GenerateRequest:
    sampling = pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)


def random_ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=new,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def served(stack, prompt: list[int], new: int):
    """(token ids, the last response's timing) of a greedy request."""
    responses = list(stack.stub().Generate(ids_request(prompt, new), timeout=240))
    return [t for r in responses for t in r.token_ids], responses[-1].timing


def busy_decode_worker(stack):
    """The decode worker that reports a running request (heartbeats come every 0.5 s)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        busy = [w for w in stack.status().workers if w.role == "decode" and w.running]
        if busy:
            return busy[0]
        time.sleep(0.05)
    raise AssertionError(f"no busy decode worker: {stack.status()}")


def kill_mid_stream(stack, prompt: list[int], new: int):
    """Streams a request and SIGKILLs the decode worker serving it after 4 tokens."""
    ids, victim = [], None
    for response in stack.stub().Generate(ids_request(prompt, new), timeout=240):
        ids += response.token_ids
        if victim is None and len(ids) >= 4:
            victim = busy_decode_worker(stack)
            os.kill(victim.pid, signal.SIGKILL)
    return ids, response.timing, victim


def plain_torch_role(name: str) -> str:
    """The role whose workers run without Tandem's C++ kernels (--kernels off) for `name`: the
    prefill for every other variant, the decode for the rest, so that each path is served with
    the kernels and without across the families, and KV written by one is read by the other."""
    return ("decode", "prefill")[list(VARIANTS).index(name) % 2]


@pytest.mark.parametrize("name", list(VARIANTS))
def test_family_served_token_identical_to_hugging_face(processes, nats, family_checkpoint, name):
    path = family_checkpoint(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    moves = name in ("qwen3", "gemma")
    env = {**ENV, "TANDEM_MODEL": str(path)}
    plain = plain_torch_role(name)
    stack = start_stack(
        processes,
        nats,
        f"it-{name}",
        "auto",
        decode=2 if moves else 1,
        extra_env=env,
        role_env={plain: {"TANDEM_KERNELS": "off"}},
    )
    try:
        workers = stack.status().workers
        for worker in workers:
            assert worker.model.startswith(f"{name} · ") and worker.model.endswith(" · float32")
            assert ("attention paged-c++" in worker.kernels) != (worker.role == plain), worker
        short, long = random_ids(20, 1), random_ids(150, 2)
        for prompt, want in ((short, "local"), (long, "disaggregated")):
            ids, timing = served(stack, prompt, 10)
            assert ids == hf_greedy(model, prompt, 10), (name, want, worker.kernels)
            assert timing.path == want, timing
        longer = long + random_ids(20, 3)
        ids, timing = served(stack, longer, 10)
        assert ids == hf_greedy(model, longer, 10)
        if name in LENGTH_DEPENDENT:  # past the trained length every key depends on the length
            assert timing.cached_tokens == 0, timing
        else:
            assert timing.cached_tokens >= 128, timing  # the long prompt's prefix, cached
        if moves:
            stack.wait_idle()  # no stale "running" left from the requests before
            prompt = random_ids(40, 4)
            ids, timing, victim = kill_mid_stream(stack, prompt, 400)
            assert ids == hf_greedy(model, prompt, 400)
            assert timing.migrations == 1 and timing.decode_worker != victim.id, timing
        stack.wait_idle()
    finally:
        stack.stop()


def test_workers_of_different_models_refuse_to_pair(processes, nats, family_checkpoint):
    """A prefill worker of Qwen3 and a decode worker of Gemma, disaggregated: no KV moves between
    them, and the client is told why."""
    qwen3, gemma = family_checkpoint("qwen3"), family_checkpoint("gemma")
    stack = start_stack(
        processes,
        nats,
        "it-mixed",
        "disaggregated",
        extra_env={"TANDEM_MODEL": str(gemma)},
        role_env={"prefill": {"TANDEM_MODEL": str(qwen3)}},
    )
    try:
        with pytest.raises(grpc.RpcError) as err:
            served(stack, random_ids(20, 5), 4)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value
        details = err.value.details()
        assert "matching KV layout" in details, details
        assert "gemma (GemmaForCausalLM" in details and "qwen3 (Qwen3ForCausalLM" in details
        assert {w.role: w.model.split(" · ")[0] for w in stack.status().workers} == {
            "prefill": "qwen3",
            "decode": "gemma",
        }
    finally:
        stack.stop()


def test_tandem_up_refuses_an_unsupported_architecture_before_starting_anything(tmp_path):
    from transformers import GPT2Config

    config = GPT2Config(n_layer=1, n_embd=32, n_head=2)
    config.architectures = ["GPT2LMHeadModel"]
    config.save_pretrained(tmp_path)  # no weights needed: the config is refused first
    done = subprocess.run(
        [sys.executable, "-m", "shared.cli.main", "up", "--model", str(tmp_path), "--insecure"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "architecture 'GPT2LMHeadModel' is not supported" in done.stderr
    assert "Qwen3ForCausalLM" in done.stderr and "starting" not in done.stdout
