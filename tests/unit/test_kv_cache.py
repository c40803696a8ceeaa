"""pack/unpack: the KV cache that crosses the data plane decodes exactly like the original."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from shared.engine import kv_cache
from shared.engine.model_runner import ModelRunner

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 16
PROMPT = [1, 5, 9, 42, 7, 100, 3]


@pytest.fixture(scope="module")
def runner():
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
                         num_key_value_heads=KV_HEADS, vocab_size=128, max_position_embeddings=256)
    return ModelRunner(LlamaForCausalLM(config).eval(), model_name="tiny", device="cpu")


def test_layout(runner):
    layout = runner.layout
    assert (layout.model, layout.dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim) == \
        ("tiny", "float32", LAYERS, KV_HEADS, HEAD_DIM)
    assert kv_cache.bytes_per_token(layout) == 2 * LAYERS * KV_HEADS * HEAD_DIM * 4


def test_pack_shape_and_size(runner):
    cache, _ = runner.prefill(PROMPT)
    buffer = runner.pack(cache)
    assert buffer.shape == (LAYERS, 2, KV_HEADS, len(PROMPT), HEAD_DIM)
    assert buffer.is_contiguous()
    assert buffer.numel() * buffer.element_size() == kv_cache.bytes_per_token(runner.layout) * len(PROMPT)
    assert torch.equal(buffer[1, 0], cache.layers[1].keys[0])
    assert torch.equal(buffer[0, 1], cache.layers[0].values[0])


def test_unpacked_cache_decodes_like_the_original(runner):
    cache, logits = runner.prefill(PROMPT)
    first = int(logits.argmax())
    buffer = runner.empty_kv(len(PROMPT))
    buffer.copy_(runner.pack(cache))                 # what the receiver gets
    received = runner.unpack(buffer)
    assert received.get_seq_length() == len(PROMPT)
    # Decode two steps on each; the original cache is untouched by the unpacked one.
    a1 = runner.decode(received, first)
    b1 = runner.decode(cache, first)
    assert torch.equal(a1, b1)
    nxt = int(a1.argmax())
    assert torch.equal(runner.decode(received, nxt), runner.decode(cache, nxt))


def test_unpack_without_the_right_cache_gives_different_logits(runner):
    cache, logits = runner.prefill(PROMPT)
    buffer = runner.pack(cache)
    buffer[:, :, :, :, :] = 0                         # the check above can fail
    first = int(logits.argmax())
    assert not torch.equal(runner.decode(runner.unpack(buffer), first), runner.decode(cache, first))


def test_bytes_per_token_by_dtype():
    layout = kv_cache.layout_of(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                            num_hidden_layers=30), "m", torch.bfloat16)
    assert (layout.dtype, layout.head_dim) == ("bfloat16", 64)
    assert kv_cache.bytes_per_token(layout) == 2 * 30 * 3 * 64 * 2
