"""The engine on a model sharded over two gloo ranks (each rank its own ModelRunner, KV pool of
its heads and Engine, stepping in lockstep, the runner summing o's and down's outputs across the
group) decodes the same greedy tokens as the engine on the whole model, for prompts computed in
several chunks beside running decodes; each rank's pool holds only its share of the KV heads."""

import copy

import torch.distributed as dist

from shared.engine.block_manager import BlockManager
from shared.engine.engine import Engine
from shared.engine.model_runner import ModelRunner
from shared.engine.sequence import Sequence
from shared.parallel.shard import shard_model
from shared.values.sampling import SamplingParams
from tests.unit.gloo_group import run_ranks
from tests.unit.test_tp_shard import model_of

LAYOUTS = [
    ("llama3", {}),  # 8 / 2 heads, head_dim 128
    ("llama-linear-mqa", {}),  # 8 / 1: the one KV head on both ranks
    ("qwen2", dict(hidden_size=224, num_attention_heads=14, num_key_value_heads=2)),
    ("phi3", {}),  # fused q|k|v, gate|up
]
BLOCK, CHUNK, NEW = 16, 32, 10
PROMPTS = [[(7 * i + 3 * j) % 4000 + 5 for j in range(n)] for i, n in enumerate((70, 9, 40))]


def decode(model, reduce=None) -> tuple[list[list[int]], int]:
    runner = ModelRunner(
        model, "tiny", "cpu", pool_blocks=64, block_size=BLOCK, chunk=CHUNK, reduce=reduce
    )
    engine = Engine(runner, BlockManager(64, BLOCK, cache_granularity=CHUNK), 8, 2 * CHUNK)
    seqs = [
        Sequence(f"r{i}", p, SamplingParams(max_tokens=NEW, ignore_eos=True), None, set(), 512)
        for i, p in enumerate(PROMPTS)
    ]
    for seq in seqs:
        engine.add(seq)
        engine.step()  # each joins a batch already running
    while engine.has_work():
        engine.step()
    return [s.output_ids for s in seqs], runner.layout.num_kv_heads


def _work(rank: int, results) -> None:
    for name, overrides in LAYOUTS:
        whole = model_of(name, overrides)
        want, _ = decode(copy.deepcopy(whole))
        shard_model(whole, 2, rank)
        got, heads = decode(whole, reduce=dist.all_reduce)
        results[(name, rank)] = (got == want, heads)


def test_two_gloo_ranks_decode_what_one_engine_decodes():
    results = run_ranks(_work)
    assert {name: results[(name, 0)][0] and results[(name, 1)][0] for name, _ in LAYOUTS} == {
        name: True for name, _ in LAYOUTS
    }
    heads = {name: results[(name, 0)][1] for name, _ in LAYOUTS}
    assert heads == {"llama3": 1, "llama-linear-mqa": 1, "qwen2": 1, "phi3": 1}
