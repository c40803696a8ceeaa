"""Small random-weight checkpoints of every supported family, saved as real HF directories.

Each variant's config is shaped like the real model's (its head_dim, grouped-query ratio, rope
settings, biases, norms, fused weights, sliding window), scaled down to two or three layers and
a small hidden size. `build` writes it as a Hugging Face directory would be: safetensors
(sharded with an index where asked), SmolLM2's tokenizer files, a generation config. Every
parameter is drawn at random (norm weights near 1, biases non-zero), so each feature changes
the result and a runner that skips one is caught.
"""

import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

VOCAB = 49152  # SmolLM2's tokenizer
BASE = dict(vocab_size=VOCAB, num_hidden_layers=2, bos_token_id=1, eos_token_id=2)

VARIANTS: dict[str, dict] = {
    # Llama 2: multi-head (1:1), untied head, default rope.
    "llama2": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    # Llama 3.2: 4:1 GQA, head_dim 128, rope "llama3", tied embeddings, two EOS ids.
    "llama3": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=131072,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=32.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=8192,
        ),
        eos=[2, 0],
    ),
    # Llama with linear rope scaling and multi-query attention (8:1 with one kv head).
    "llama-linear-mqa": dict(
        model_type="llama",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=1,
        max_position_embeddings=4096,
        rope_scaling=dict(rope_type="linear", factor=4.0),
    ),
    # Llama with dynamic NTK scaling past a short trained length (long prompts go past it), 8:1.
    "llama-dynamic": dict(
        model_type="llama",
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=16,
        num_key_value_heads=2,
        max_position_embeddings=96,
        rope_scaling=dict(rope_type="dynamic", factor=4.0),
    ),
    # Mistral 7B v0.3 / Nemo: 4:1, an explicit head_dim, no window.
    "mistral": dict(
        model_type="mistral",
        hidden_size=160,
        intermediate_size=320,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=128,
        sliding_window=None,
        rope_theta=1000000.0,
        max_position_embeddings=32768,
    ),
    # Mistral 7B v0.1: a sliding window (scaled down so long prompts go past it).
    "mistral-window": dict(
        model_type="mistral",
        hidden_size=128,
        intermediate_size=256,
        num_attention_heads=8,
        num_key_value_heads=2,
        sliding_window=40,
        max_position_embeddings=32768,
    ),
    # Qwen2.5: q/k/v biases, 7:1, tied, large theta, yarn scaling; saved sharded.
    "qwen2": dict(
        model_type="qwen2",
        hidden_size=448,
        intermediate_size=512,
        num_attention_heads=7,
        num_key_value_heads=1,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
        rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=32768),
        shard="2MB",
    ),
    # Qwen3: q/k RMSNorm per head, head_dim 128 != hidden / heads, 2:1, tied.
    "qwen3": dict(
        model_type="qwen3",
        hidden_size=128,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128,
        max_position_embeddings=40960,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
    # Gemma: GeGLU (tanh GELU), (1 + w) RMSNorm, embeddings scaled by sqrt(hidden), MQA, head 256.
    "gemma": dict(
        model_type="gemma",
        hidden_size=128,
        intermediate_size=384,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        hidden_act="gelu_pytorch_tanh",
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    ),
    # Phi-3 mini 4k: fused qkv_proj and gate_up_proj, head_dim 96, 1:1, a sliding window.
    "phi3": dict(
        model_type="phi3",
        hidden_size=192,
        intermediate_size=384,
        num_attention_heads=2,
        num_key_value_heads=2,
        sliding_window=47,
        max_position_embeddings=4096,
        original_max_position_embeddings=4096,
    ),
    # Phi-3 mini 128k: longrope past a (scaled-down) original length.
    "phi3-longrope": dict(
        model_type="phi3",
        hidden_size=192,
        intermediate_size=384,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=512,
        original_max_position_embeddings=64,
        rope_scaling=dict(
            type="longrope",
            short_factor=[1.0 + i / 48 for i in range(48)],
            long_factor=[1.0 + i / 8 for i in range(48)],
        ),
    ),
}

# For the benchmarks: Qwen2.5-0.5B's shape (24 layers, hidden 896, 14:2 heads, tied; its own
# 151,936-row vocabulary), random weights. About 0.49B parameters.
LARGE: dict[str, dict] = {
    # Llama-3-8B's layer (GQA 4:1, head 128, SwiGLU 14336) on SmolLM2's vocabulary, for the GPU
    # check (bench/gpu_check.py builds it with a few layers: num_hidden_layers=N)
    "llama3-8b": dict(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=32768 + 512,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2",
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
}


# Shapes a test needs that no variant has, at a small width: Qwen2.5-0.5B's heads (14 query, 2
# KV; q/k/v biases, tied head) for tensor parallelism at degree 2
SHAPED: dict[str, dict] = {
    "qwen2.5-heads": dict(
        model_type="qwen2",
        hidden_size=224,
        intermediate_size=448,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-6,
    ),
}


def spec_of(name: str) -> dict:
    return VARIANTS.get(name) or SHAPED.get(name) or LARGE[name]


def config_of(name: str, **overrides):
    spec = {**BASE, **spec_of(name), **overrides}
    spec.pop("eos", None), spec.pop("shard", None)
    return AutoConfig.for_model(**spec)


def randomize(model, seed: int = 0) -> None:
    """Every parameter random: weights N(0, 0.08), norm weights near their neutral value,
    biases N(0, 0.05). (Such weights give near-ties at the top of the logits, which makes
    greedy parity a sharp test of the arithmetic.)"""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                neutral = 0.0 if model.config.model_type == "gemma" else 1.0
                param.copy_(neutral + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.05 * noise)
            elif "embed" in name and model.config.model_type == "gemma":
                # Gemma multiplies its embeddings by sqrt(hidden): without this the input token
                # would swamp the residual stream, and the tied head would echo it.
                param.copy_(0.08 * noise / model.config.hidden_size**0.5)
            else:
                param.copy_(0.08 * noise)


def build(
    name: str,
    root: Path,
    tokenizer_dir: Path,
    dtype: torch.dtype = torch.float32,
    shard: str = "",
    target: Path | None = None,
    overrides: dict | None = None,
) -> Path:
    """The variant's directory (`root`/`name` unless `target` is given), built once: weights
    saved in `dtype`, sharded at `shard` (e.g. "200MB"; default: the variant's own); `overrides`:
    config fields changed from the variant's (num_hidden_layers=4)."""
    target = target or root / name
    if (target / "config.json").exists():
        return target
    spec = spec_of(name)
    config = config_of(name, **(overrides or {}))
    config.architectures = [_architecture(config.model_type)]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model)
    tmp = target.parent / f".{target.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(dtype).save_pretrained(tmp, max_shard_size=shard or spec.get("shard", "50GB"))
    GenerationConfig(
        bos_token_id=1, eos_token_id=spec.get("eos", 2), do_sample=False
    ).save_pretrained(tmp)
    for file in tokenizer_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_")):
            shutil.copy(file, tmp / file.name)
    tmp.rename(target)
    return target


def _architecture(model_type: str) -> str:
    return {
        "llama": "LlamaForCausalLM",
        "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM",
        "qwen3": "Qwen3ForCausalLM",
        "gemma": "GemmaForCausalLM",
        "phi3": "Phi3ForCausalLM",
    }[model_type]


def main() -> None:
    """python -m harness.families NAME DIR [--dtype bfloat16] [--shard 200MB]"""
    import argparse

    from shared import model_store

    parser = argparse.ArgumentParser(description="build a random-weight checkpoint")
    parser.add_argument("name", choices=[*VARIANTS, *SHAPED, *LARGE])
    parser.add_argument("target", type=Path)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shard", default="")
    args = parser.parse_args()
    tokenizer = model_store.prepare("", "~/.cache/tandem/models")
    path = build(
        args.name,
        args.target.parent,
        tokenizer,
        getattr(torch, args.dtype),
        args.shard,
        args.target,
    )
    print(path)


if __name__ == "__main__":
    main()
