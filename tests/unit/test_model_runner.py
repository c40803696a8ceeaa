"""ModelRunner over the paged pool: matches HF generate, batch-invariant, chunk-deterministic."""

import pytest
import torch
from transformers import GenerationConfig

from shared.engine.model_runner import ModelRunner, SeqSpan
from shared.engine.projection import SMALL

BLOCK = 16
DEFAULT_THREADS = torch.get_num_threads()  # at import, before the tiny_model fixture changes it


def table(first_block: int, num_tokens: int) -> list[int]:
    """A simple allocation: consecutive blocks from `first_block`."""
    return list(range(first_block, first_block + -(-num_tokens // BLOCK)))


@pytest.fixture(scope="module")
def runner(tiny_model):
    return ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=512, block_size=BLOCK, chunk=32)


@pytest.fixture(scope="module")
def gemm_runner(tiny_model):
    """Without Tandem's kernels: the projections through oneDNN's GEMMs, rows padded."""
    return ModelRunner(
        tiny_model, "tiny", "cpu", pool_blocks=64, block_size=BLOCK, chunk=32, use_kernels=False
    )


def greedy(runner: ModelRunner, prompt: list[int], new_tokens: int, first_block: int) -> list[int]:
    tokens = list(prompt)
    blocks = table(first_block, len(prompt) + new_tokens)
    logits = runner.forward([SeqSpan(blocks, tokens, 0, len(tokens))])
    out = []
    for _ in range(new_tokens):
        out.append(int(logits[0].argmax()))
        tokens.append(out[-1])
        logits = runner.forward([SeqSpan(blocks, tokens, len(tokens) - 1, len(tokens))])
    return out


# -- (a) the same tokens as Hugging Face -------------------------------------------------------


@pytest.mark.parametrize("prompt_len", [1, 12, 45])
def test_greedy_generation_matches_hf_generate(tiny_model, runner, rand_tokens, prompt_len):
    prompt = rand_tokens(prompt_len)
    ours = greedy(runner, prompt, 20, first_block=0)
    config = GenerationConfig(max_new_tokens=20, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        hf = tiny_model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, prompt_len, dtype=torch.long),
            generation_config=config,
        )
    assert ours == hf[0, prompt_len:].tolist()
    assert len(set(ours)) > 3  # the check is not a trivial loop


def test_prefill_logits_close_to_hf(tiny_model, runner, rand_tokens):
    prompt = rand_tokens(70)
    ours = runner.forward([SeqSpan(table(0, 70), prompt, 0, 70)])[0]
    with torch.no_grad():
        theirs = tiny_model(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_forward_returns_one_row_of_logits_per_segment(runner, rand_tokens):
    a, b, c = rand_tokens(5), rand_tokens(40), rand_tokens(1)
    logits = runner.forward(
        [
            SeqSpan(table(0, 5), a, 0, 5),
            SeqSpan(table(10, 40), b, 0, 40),
            SeqSpan(table(20, 1), c, 0, 1),
        ]
    )
    assert logits.shape == (3, 128) and logits.dtype == torch.float32


# -- (b) batch invariance ------------------------------------------------------------------------


def test_padded_rows_pads_only_up_to_a_measured_invariant_count(gemm_runner, runner):
    """Which counts are invariant depends on the GEMM kernels this CPU gets (the report says
    which ran); that some are holds for fp32 on AVX2 and AVX-512 alike. The row kernel computes
    each row alone: nothing is padded."""
    assert all(runner.padded_rows(rows) == rows for rows in range(1, 40))
    runner = gemm_runner
    assert runner.row_counts, runner.kernel_report().line()
    assert all(1 <= count <= SMALL for count in runner.row_counts)
    for rows in range(1, 40):
        padded = runner.padded_rows(rows)
        assert padded >= rows and (padded in runner.row_counts or padded == rows > SMALL)
    assert all(runner.padded_rows(rows) == rows for rows in (SMALL + 1, 100, 1000))


def test_without_batch_invariance_nothing_is_padded(tiny_model):
    loose = ModelRunner(
        tiny_model, "tiny", "cpu", pool_blocks=16, block_size=BLOCK, chunk=32, batch_invariant=False
    )
    assert all(loose.padded_rows(rows) == rows for rows in range(1, 40))


@pytest.fixture(params=["one-thread", "default-threads"])
def threads(request, tiny_model):
    """The tiny_model fixture runs on one thread; production runs on torch's default count."""
    if request.param == "default-threads":
        saved = torch.get_num_threads()
        torch.set_num_threads(DEFAULT_THREADS)
        yield DEFAULT_THREADS
        torch.set_num_threads(saved)
    else:
        yield torch.get_num_threads()


@pytest.mark.parametrize("kind", ["row-kernel", "gemm"])
def test_padded_row_counts_are_row_invariant_in_every_projection(
    kind, threads, runner, gemm_runner
):
    """The premise of padded_rows: a padded GEMM gives each row the bits it has in a bigger batch
    (and the row kernel, unpadded, at any count)."""
    runner = gemm_runner if kind == "gemm" else runner
    g = torch.Generator().manual_seed(threads)
    projections = (
        runner.qkv[0],
        runner.o_proj[1],
        runner.gate_up[0],
        runner.down[1],
        runner.lm_head,
    )
    for rows in sorted({runner.padded_rows(r) for r in range(1, 80)}):
        for projection in projections:
            x = torch.randn(96, projection.in_features, generator=g)
            with torch.inference_mode():
                full = projection(x)
                for part, whole in zip(projection(x[:rows]), full):
                    assert torch.equal(part, whole[:rows]), (
                        rows,
                        projection.sizes,
                        runner.kernel_report().line(),
                    )


@pytest.fixture(scope="module")
def decoding(runner):
    """16 sequences of different lengths, prefilled, each with one sampled token still to decode."""
    g = torch.Generator().manual_seed(7)
    seqs = []
    for i in range(16):
        n = 3 + 11 * i
        tokens = torch.randint(3, 128, (n,), generator=g).tolist()
        blocks = table(100 + 16 * i, n + 1)
        tokens.append(int(runner.forward([SeqSpan(blocks, tokens, 0, n)])[0].argmax()))
        seqs.append(SeqSpan(blocks, tokens, n, n + 1))
    return seqs


@pytest.mark.parametrize("others", [1, 3, 7, 15])
def test_decode_logits_do_not_depend_on_the_batch(runner, decoding, threads, others):
    alone = runner.forward([decoding[0]])[0]
    first = runner.forward(decoding[: others + 1])
    assert torch.equal(first[0], alone), runner.kernel_report().line()
    last = runner.forward(decoding[1 : others + 1][::-1] + [decoding[0]])
    assert torch.equal(last[-1], alone)
    for i in range(1, others + 1):  # every member gets its solo logits too
        assert torch.equal(first[i], runner.forward([decoding[i]])[0]), i


def test_prefill_logits_do_not_depend_on_the_batch(runner, decoding, rand_tokens):
    prompt = rand_tokens(50)
    alone = runner.forward([SeqSpan(table(400, 50), prompt, 0, 50)])[0]
    mixed = runner.forward(decoding[:5] + [SeqSpan(table(420, 50), prompt, 0, 50)] + decoding[5:9])
    assert torch.equal(mixed[5], alone)
    assert torch.equal(
        runner.pool.export(runner.pool.slots(table(400, 50), 0, 50)),
        runner.pool.export(runner.pool.slots(table(420, 50), 0, 50)),
    )


def test_without_batch_invariance_the_runner_still_computes(tiny_model, rand_tokens):
    loose = ModelRunner(
        tiny_model, "tiny", "cpu", pool_blocks=16, block_size=BLOCK, chunk=32, batch_invariant=False
    )
    prompt = rand_tokens(20)
    strict = ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=16, block_size=BLOCK, chunk=32)
    a = loose.forward([SeqSpan(table(0, 20), prompt, 0, 20)])[0]
    b = strict.forward([SeqSpan(table(0, 20), prompt, 0, 20)])[0]
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


# -- (c) chunk determinism -----------------------------------------------------------------------


def test_chunked_prompt_gives_the_same_logits_as_one_segment(tiny_model, rand_tokens):
    runner = ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=64, block_size=BLOCK, chunk=128)
    prompt = rand_tokens(300)
    whole = runner.forward([SeqSpan(table(0, 300), prompt, 0, 300)])
    blocks = table(20, 300)
    runner.forward([SeqSpan(blocks, prompt, 0, 128)])
    runner.forward([SeqSpan(blocks, prompt, 128, 256)])
    pieces = runner.forward([SeqSpan(blocks, prompt, 256, 300)])
    assert torch.equal(whole, pieces)
    assert torch.equal(
        runner.pool.export(runner.pool.slots(table(0, 300), 0, 300)),
        runner.pool.export(runner.pool.slots(blocks, 0, 300)),
    )


def test_a_decode_step_after_chunks_matches_after_one_segment(tiny_model, rand_tokens):
    runner = ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=64, block_size=BLOCK, chunk=128)
    prompt = rand_tokens(129)
    a, b = table(0, 131), table(20, 131)
    tok = int(runner.forward([SeqSpan(a, prompt, 0, 129)])[0].argmax())
    runner.forward([SeqSpan(b, prompt, 0, 128)])
    assert int(runner.forward([SeqSpan(b, prompt, 128, 129, prompt=True)])[0].argmax()) == tok
    seq = prompt + [tok]
    assert torch.equal(
        runner.forward([SeqSpan(a, seq, 129, 130)]), runner.forward([SeqSpan(b, seq, 129, 130)])
    )


# -- (d) the KV in the pool --------------------------------------------------------------------


def test_identical_prompts_write_identical_kv(runner, rand_tokens):
    prompt = rand_tokens(77)
    first, second = table(300, 77), table(330, 77)
    runner.forward([SeqSpan(first, prompt, 0, 77)])
    runner.forward([SeqSpan(second, prompt, 0, 77)])
    kv_first = runner.pool.export(runner.pool.slots(first, 0, 77))
    kv_second = runner.pool.export(runner.pool.slots(second, 0, 77))
    assert kv_first.shape == (2, 2, 77, 2, 16)
    assert kv_first.any() and torch.equal(kv_first, kv_second)


def test_layer0_kv_is_the_projection_of_the_embeddings(tiny_model, runner, rand_tokens):
    """The pool holds the rotated keys and the values of HF's own layer-0 projections."""
    prompt = rand_tokens(9)
    blocks = table(360, 9)
    runner.forward([SeqSpan(blocks, prompt, 0, 9)])
    keys, values = runner.pool.read(0, runner.pool.rows(runner.pool.slots(blocks, 0, 9)))
    with torch.no_grad():
        out = tiny_model(torch.tensor([prompt]), use_cache=True)
    hf_keys = out.past_key_values.layers[0].keys[0].transpose(0, 1)  # [tokens, heads, dim]
    hf_values = out.past_key_values.layers[0].values[0].transpose(0, 1)
    torch.testing.assert_close(keys, hf_keys, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(values, hf_values, rtol=1e-5, atol=1e-6)


def test_kv_does_not_leak_into_other_blocks(tiny_model, rand_tokens):
    runner = ModelRunner(tiny_model, "tiny", "cpu", pool_blocks=8, block_size=BLOCK, chunk=32)
    runner.forward([SeqSpan([5, 2], rand_tokens(20), 0, 20)])
    touched = runner.pool.kv.abs().sum(dim=(1, 2, 4, 5)) != 0  # [blocks, offsets]
    assert touched[5].all() and touched[2, :4].all() and not touched[2, 4:].any()
    assert not touched[[0, 1, 3, 4, 6, 7]].any()


@pytest.mark.xfail(
    strict=True,
    reason="KNOWN LIMITATION (why decode-filled blocks are not prefix-cached): a token decoded alone (one query row, no mask) "
    "gets attention output bits that differ from the same token computed as a "
    "row of a prompt piece (n rows, causal mask); from layer 1 on its K/V "
    "differ by ~1e-7, so blocks filled by decode steps are not what a prefill "
    "of those tokens writes (prefix-cache reuse and preemption recompute)",
)
def test_decoded_tokens_write_the_kv_a_prefill_of_them_writes(runner, rand_tokens):
    prompt = rand_tokens(10)
    decoded, prefilled = table(440, 40), table(450, 40)
    tokens = list(prompt)
    logits = runner.forward([SeqSpan(decoded, tokens, 0, 10)])
    while len(tokens) < 40:
        tokens.append(int(logits[0].argmax()))
        logits = runner.forward([SeqSpan(decoded, tokens, len(tokens) - 1, len(tokens))])
    runner.forward([SeqSpan(prefilled, tokens, 0, 40)])
    kv_decoded = runner.pool.export(runner.pool.slots(decoded, 0, 40))
    kv_prefilled = runner.pool.export(runner.pool.slots(prefilled, 0, 40))
    assert torch.equal(kv_decoded[0], kv_prefilled[0])  # layer 0: projections only, equal already
    assert torch.equal(kv_decoded, kv_prefilled)


# -- reading the pool in place --------------------------------------------------------------------


def test_consecutive_and_scattered_blocks_give_the_same_bits(runner, rand_tokens):
    """Where a sequence's blocks lie in the pool changes nothing of what it computes."""
    prompt = rand_tokens(70)
    consecutive = [100, 101, 102, 103, 104]
    scattered = [200, 150, 230, 170, 210]
    outputs = []
    for blocks in (consecutive, scattered):
        tokens = list(prompt)
        logits = runner.forward([SeqSpan(blocks, tokens, 0, 70)])
        tokens.append(int(logits[0].argmax()))
        outputs.append((logits, runner.forward([SeqSpan(blocks, tokens, 70, 71)])))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
