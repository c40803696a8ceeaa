"""Every supported family, run by the engine, against Hugging Face on the same checkpoint.

The checkpoints are harness/families.py's: real HF directories with random weights, shaped like
each family's real models. Greedy output must be token-identical to HF `generate` (fp32), with
Tandem's C++ kernels and without, for a short prompt and for a long one (several prompt chunks,
past every sliding window and past the trained length of the dynamic and longrope variants).
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from harness.families import VARIANTS, VOCAB
from shared.engine.block_manager import BlockManager
from shared.engine.engine import Engine
from shared.engine.model_runner import ModelRunner, SeqSpan
from tests.unit.test_engine import make_seq, run_to_end
from tests.unit.test_model_runner import greedy as model_runner_greedy

BLOCK, CHUNK, NEW = 16, 32, 12
LONG = 130  # > 4 chunks; > the windows (40, 47), the dynamic (96) and longrope (64) lengths


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(path, dtype=torch.float32):
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def prompt_of(n: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=generator).tolist()


def greedy(runner: ModelRunner, prompt: list[int], new_tokens: int) -> list[int]:
    return model_runner_greedy(runner, prompt, new_tokens, first_block=0)


def hf_greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    config = GenerationConfig(
        max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "torch"])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_greedy_output_is_hugging_face_s(family_checkpoint, name, kernels):
    model = load(family_checkpoint(name))
    runner = ModelRunner(
        model, name, "cpu", pool_blocks=64, block_size=BLOCK, chunk=CHUNK, use_kernels=kernels
    )
    assert (runner.paged is not None) == kernels, runner.kernel_report().line()
    for n, seed in ((7, 1), (LONG, 2)):
        prompt = prompt_of(n, seed)
        ours = greedy(runner, prompt, NEW)
        assert ours == hf_greedy(model, prompt, NEW), (name, n, runner.kernel_report().line())
        assert len(set(ours)) > 2  # not a trivial loop


def test_decode_stack_covers_the_families_it_can(family_checkpoint):
    """The fused C++ decode stack runs Llama, Mistral (windowed too) and Phi-3; the families with
    biases (Qwen2), q/k norms (Qwen3) or GELU and (1 + w) norms (Gemma) run layer by layer."""
    stacked = {}
    for name in VARIANTS:
        runner = ModelRunner(load(family_checkpoint(name)), name, "cpu", 8, BLOCK, CHUNK)
        stacked[name] = runner.stack is not None
    assert {n for n, s in stacked.items() if not s} == {"qwen2", "qwen3", "gemma"}, stacked


def top1(path, tokens: list[int], dtype) -> list[int]:
    """Hugging Face's argmax at every position of `tokens`, in one teacher-forced pass."""
    with torch.no_grad():
        return load(path, dtype)(torch.tensor([tokens])).logits[0].argmax(-1).tolist()


def engine_top1(path, tokens: list[int], dtype) -> list[int]:
    """The engine's argmax at every position, teacher-forced one decode step at a time."""
    runner = ModelRunner(load(path, dtype), "engine", "cpu", 32, BLOCK, CHUNK)
    blocks = list(range(-(-len(tokens) // BLOCK)))
    return [
        int(runner.forward([SeqSpan(blocks, tokens, end - 1, end)])[0].argmax())
        for end in range(1, len(tokens) + 1)
    ]


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


def rounded_weights_top1(path, tokens: list[int]) -> list[int]:
    """The argmax of HF in float32 on weights rounded to bf16: the best any bf16 weights allow."""
    model = load(path)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(torch.bfloat16).float())
        return model(torch.tensor([tokens])).logits[0].argmax(-1).tolist()


@pytest.mark.parametrize("name", list(VARIANTS))
def test_bfloat16_loses_no_more_than_hugging_face_s_own_bfloat16(
    family_checkpoint, name, record_property
):
    """Random weights put near-ties at the top of the logits: rounding the weights alone to bf16
    (computing in fp32) flips 0.6-5% of the top-1 choices on these checkpoints, so no bf16
    engine reaches 98% on most of them (that bar is checked on trained weights, below). The engine's bf16 must
    agree with fp32 HF as well as HF's own bf16 does, within 3 points."""
    path, tokens = family_checkpoint(name), prompt_of(160, 3)
    reference = top1(path, tokens, torch.float32)
    ours = agreement(engine_top1(path, tokens, torch.bfloat16), reference)
    theirs = agreement(top1(path, tokens, torch.bfloat16), reference)
    ceiling = agreement(rounded_weights_top1(path, tokens), reference)
    record_property("bf16_top1_agreement", (ours, theirs, ceiling))
    print(
        f"{name}: bf16 top-1 agreement with fp32 HF: engine {ours:.1%}, HF bf16 {theirs:.1%}, "
        f"fp32 on bf16-rounded weights {ceiling:.1%}"
    )
    assert ours >= theirs - 0.03


TEXT = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in Europe "
    "built wooden machines that riders pushed along with their feet. Pedals arrived decades later, "
    "and by the 1880s the safety bicycle, with two wheels of equal size and a chain driving the "
    "rear wheel, had made cycling popular across the world. Today bicycles are used for commuting, "
    "sport and recreation, and many cities build separate lanes to keep cyclists safe from traffic. "
    "A bicycle is also one of the most efficient ways to travel: a rider uses less energy per "
    "kilometre than a walker, and the machine itself needs no fuel. Maintenance is simple. The "
    "chain should be cleaned and oiled every few weeks, the tyres kept at the right pressure, and "
    "the brakes checked before every long ride. Children usually learn to ride between the ages "
    "of four and eight, often with the help of a parent who holds the saddle and runs alongside "
    "until the child can balance alone. Once learned, the skill is rarely forgotten."
)


def test_bfloat16_agrees_with_float32_on_trained_weights(model_dir, tokenizer, record_property):
    """SmolLM2-135M (trained Llama weights) on English text: the engine in bf16 picks fp32 HF's
    top-1 at >= 97.5% of teacher-forced positions, and no less often than HF's own bf16 but for
    two positions of the ~200. Which of the two agrees more depends on the CPU: on an AVX2 host
    the engine (fp32 logits, output_head.py) 98.5% against HF's 97.5% (over 3,275 positions,
    98.2% against 97.4%); on an AVX-512-BF16 host, whose native bf16 dot products HF uses,
    98.0% against 98.5%."""
    tokens = tokenizer(TEXT)["input_ids"]
    reference = top1(model_dir, tokens, torch.float32)
    figure = agreement(engine_top1(model_dir, tokens, torch.bfloat16), reference)
    theirs = agreement(top1(model_dir, tokens, torch.bfloat16), reference)
    record_property("bf16_top1_agreement", (figure, theirs))
    print(f"SmolLM2-135M: bf16 top-1 agreement with fp32 HF: engine {figure:.1%}, HF {theirs:.1%}")
    assert figure >= 0.975 and figure >= theirs - 2 / len(tokens)


def engine_greedy(model, prompt: list[int], new_tokens: int) -> tuple[list[int], int]:
    """(greedy tokens, preemptions) of one sequence through the Engine (its scheduling, chunked
    prefill and recomputes), with a block manager as a worker builds it."""
    runner = ModelRunner(model, "engine", "cpu", 64, BLOCK, CHUNK)
    blocks = BlockManager(64, BLOCK, CHUNK, cacheable_tokens=runner.rotary.cacheable_tokens)
    engine = Engine(runner, blocks, max_batch_tokens=CHUNK)
    seq = make_seq(prompt, new_tokens)
    engine.add(seq)
    run_to_end(engine)
    return seq.output_ids, engine.preemptions


@pytest.mark.parametrize("name", ["phi3-longrope", "llama-dynamic"])
def test_a_sequence_that_grows_past_the_trained_length(family_checkpoint, name):
    """Phi-3's longrope switches to its long factors past `original_max_position_embeddings`
    (64 here) and HF then computes the whole sequence again: so does the engine, once. Dynamic
    NTK keeps the keys it has, in HF and here."""
    model = load(family_checkpoint(name))
    limit = model.config.rope_parameters.get("original_max_position_embeddings")
    limit = limit or model.config.max_position_embeddings
    prompt = prompt_of(limit - 4, 5)
    ours, recomputes = engine_greedy(model, prompt, NEW)
    assert ours == hf_greedy(model, prompt, NEW)
    assert recomputes == (1 if name == "phi3-longrope" else 0)


def test_weights_released_as_they_are_packed_give_the_same_tokens(family_checkpoint):
    """A worker frees each linear weight once packed (and gives back its mapped pages, the tied
    embedding's too): the engine's output is unchanged."""
    path, prompt = family_checkpoint("llama3"), prompt_of(40, 6)
    expected = hf_greedy(load(path), prompt, NEW)
    model = load(path)
    runner = ModelRunner(model, "x", "cpu", 64, BLOCK, CHUNK, release_weights=True)
    assert model.model.layers[0].mlp.down_proj.weight.numel() == 0  # released
    assert greedy(runner, prompt, NEW) == expected


@pytest.mark.parametrize(
    "name, saved, computed",
    [
        ("gemma", torch.bfloat16, torch.float32),
        ("llama3", torch.bfloat16, torch.float32),
        ("gemma", torch.float32, torch.bfloat16),
    ],
)
def test_a_checkpoint_converted_as_a_worker_loads_it_is_hugging_face_s(
    tmp_path, model_dir, name, saved, computed
):
    """A checkpoint computed in another dtype than it was saved in: loaded in its own (mapped)
    and converted a parameter at a time, it equals HF's own load in that dtype bit for bit:
    weights, buffers (Gemma's embedding scale is built in the dtype) and logits."""
    from harness.families import build
    from shared import model_store
    from shared.engine.file_pages import convert
    from shared.worker.runtime import load_model

    path = build(name, tmp_path, model_dir, dtype=saved)
    config = model_store.load_config(path)
    assert config.dtype == saved
    ours, theirs = load_model(path, "cpu", computed, "native", config), load(path, computed)
    assert ours.dtype == saved  # converted by the model runner, as it packs
    convert(ours, computed)
    assert ours.dtype == computed
    for (a, x), (b, y) in zip(ours.state_dict().items(), theirs.state_dict().items()):
        assert a == b and x.dtype == y.dtype and torch.equal(x, y), a
    for (a, x), (b, y) in zip(ours.named_buffers(), theirs.named_buffers()):
        assert a == b and x.dtype == y.dtype and torch.equal(x, y), a
    ids = torch.tensor([prompt_of(30, 7)])
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, theirs(ids).logits)


@pytest.mark.parametrize("name", ["gemma", "qwen2", "llama2"])
def test_a_bfloat16_checkpoint_computed_in_float32_runs_as_hugging_face_s(
    tmp_path, model_dir, name
):
    """bf16 weights served in fp32, converted by the runner as it packs: a tied embedding table
    stays bf16 (read row by row, upcast, Gemma's scale after), an untied one is converted; the
    greedy output is HF's own float32 load's, token for token."""
    from harness.families import build
    from shared import model_store
    from shared.worker.runtime import load_model

    path = build(name, tmp_path, model_dir, dtype=torch.bfloat16)
    config = model_store.load_config(path)
    model = load_model(path, "cpu", torch.float32, "native", config)
    runner = ModelRunner(
        model, "x", "cpu", 64, BLOCK, CHUNK, release_weights=True, dtype=torch.float32
    )
    tied = config.tie_word_embeddings
    assert model.model.embed_tokens.weight.dtype == (torch.bfloat16 if tied else torch.float32)
    assert model.model.norm.weight.dtype == torch.float32
    assert runner.layout.dtype == "float32" and runner.kernel_report().dtype == "float32"
    prompt = prompt_of(LONG, 5)
    assert greedy(runner, prompt, NEW) == hf_greedy(load(path, torch.float32), prompt, NEW)


def test_a_float32_checkpoint_computed_in_bfloat16_is_the_bfloat16_load_s_twin(tmp_path, model_dir):
    """fp32 weights served in bf16, converted by the runner as it packs (a tied table kept in
    its fp32 file and rounded as its rows are read): the logits are those of a runner over HF's
    own bf16 load, bit for bit (Gemma: tied, scaled embeddings)."""
    from harness.families import build
    from shared import model_store
    from shared.worker.runtime import load_model

    path = build("gemma", tmp_path, model_dir, dtype=torch.float32)
    config = model_store.load_config(path)
    converted = ModelRunner(
        load_model(path, "cpu", torch.bfloat16, "native", config),
        "x",
        "cpu",
        64,
        BLOCK,
        CHUNK,
        release_weights=True,
        dtype=torch.bfloat16,
    )
    loaded = ModelRunner(load(path, torch.bfloat16), "x", "cpu", 64, BLOCK, CHUNK)
    prompt = prompt_of(LONG, 6)
    spans = [SeqSpan(list(range(-(-LONG // BLOCK))), prompt, 0, LONG)]
    assert torch.equal(converted.forward(spans), loaded.forward(spans))


def test_every_eos_id_of_the_generation_config_ends_a_sequence(family_checkpoint):
    """Llama 3 ends a turn with <|eot_id|> and a text with <|end_of_text|>: both ids of its
    generation_config.json stop generation, with the tokenizer's own."""
    from shared import model_store
    from shared.worker.runtime import eos_token_ids

    path = family_checkpoint("llama3")
    tokenizer = model_store.load_tokenizer(path)
    assert eos_token_ids(load(path).generation_config, tokenizer) == {0, 2, tokenizer.eos_token_id}
