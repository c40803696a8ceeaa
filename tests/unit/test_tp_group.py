"""A TP group stepping in lockstep: rank 0's Engine (the group's one block table) drives rank 1's
runner through GroupRunner and `follow`, and decodes what one engine decodes on the whole model,
an n = 2 request's fork (a block copy on every rank) included; the spans' encoding round-trips."""

import copy

import torch.distributed as dist

from shared.engine.block_manager import BlockManager
from shared.engine.engine import Engine
from shared.engine.forward_batch import SeqSpan
from shared.engine.model_runner import ModelRunner
from shared.engine.sequence import Sequence
from shared.parallel.group import GroupRunner, decode_spans, encode_spans, follow
from shared.parallel.shard import shard_model
from shared.values.sampling import SamplingParams
from tests.unit.gloo_group import run_ranks
from tests.unit.test_tp_shard import model_of

BLOCK, CHUNK, NEW = 16, 32, 8
PROMPTS = [[(5 * i + 11 * j) % 3000 + 7 for j in range(n)] for i, n in enumerate((50, 21, 9))]
LAYOUT = ("qwen2", dict(hidden_size=224, num_attention_heads=14, num_key_value_heads=2))


def runner_of(model, reduce=None) -> ModelRunner:
    return ModelRunner(
        model, "tiny", "cpu", pool_blocks=64, block_size=BLOCK, chunk=CHUNK, reduce=reduce
    )


def decode(runner) -> list[list[int]]:
    engine = Engine(runner, BlockManager(64, BLOCK, cache_granularity=CHUNK), 8, 2 * CHUNK)
    seqs = []
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(max_tokens=NEW, ignore_eos=True, n=2 if i == 1 else 1)
        seqs.append(Sequence(f"r{i}", prompt, params, None, set(), 512))
        engine.add(seqs[-1])
        engine.step()
    while engine.has_work():
        engine.step()
    forked = engine.take_forked()
    return [s.output_ids for s in seqs] + [s.output_ids for s in forked if s.forked_from]


def _work(rank: int, results) -> None:
    whole = model_of(*LAYOUT)
    want = decode(runner_of(copy.deepcopy(whole))) if rank == 0 else None
    shard_model(whole, 2, rank)
    runner = runner_of(whole, reduce=dist.all_reduce)
    if rank == 0:
        group = GroupRunner(runner)
        got = decode(group)
        group.stop()
        results["tokens"] = (got, want)
    else:
        results["passes"] = follow(runner)


def test_rank_0_drives_the_group_and_decodes_what_one_engine_decodes():
    results = run_ranks(_work)
    got, want = results["tokens"]
    passes = results["passes"]
    assert len(got) == len(PROMPTS) + 1  # the n = 2 request's second choice
    assert got == want
    assert passes >= NEW


def test_spans_round_trip_through_their_encoding():
    spans = [
        SeqSpan([3, 9, 4], list(range(40)), 32, 40, True),
        SeqSpan([1], [5, 6, 7], 2, 3, False),
        SeqSpan([], [], 0, 0, False),
    ]
    back = decode_spans(encode_spans(spans))
    assert [(s.block_table, s.token_ids, s.start, s.end, s.prompt) for s in back] == [
        ([3, 9, 4], list(range(40)), 32, 40, True),
        ([1], [5, 6, 7], 2, 3, False),
        ([], [], 0, 0, False),
    ]
