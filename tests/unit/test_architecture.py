"""Which checkpoints the engine takes: the supported families, and clear refusals of the rest."""

import pytest
import torch
from transformers import AutoConfig

from harness.families import VARIANTS, config_of
from shared.engine.architecture import FAMILIES, UnsupportedModel, check, layer_windows
from shared.engine.dtypes import compute_dtype, native_float16
from shared.engine.projection import onednn_bf16


def configured(name: str, **overrides):
    config = config_of(name, **overrides)
    config.architectures = [type_name(config.model_type)]
    return config


def type_name(model_type: str) -> str:
    return next(arch for arch, family in FAMILIES.items() if family == model_type)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_every_variant_is_taken(name):
    assert check(configured(name)) == config_of(name).model_type


def test_an_architecture_outside_the_list_is_refused_naming_the_supported_ones():
    config = AutoConfig.for_model("gpt2", n_layer=1)
    config.architectures = ["GPT2LMHeadModel"]
    with pytest.raises(UnsupportedModel) as refused:
        check(config)
    message = str(refused.value)
    assert "'GPT2LMHeadModel' is not supported" in message
    assert all(arch in message for arch in FAMILIES)


def test_a_config_without_architectures_is_refused():
    config = configured("llama2")
    config.architectures = None
    with pytest.raises(UnsupportedModel, match="none in config.json"):
        check(config)


@pytest.mark.parametrize(
    "option, value",
    [("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0), ("pretraining_tp", 2)],
)
def test_options_the_engine_does_not_implement_are_refused(option, value):
    config = configured("llama2")
    setattr(config, option, value)
    with pytest.raises(UnsupportedModel, match=option):
        check(config)


def test_an_unknown_rope_type_is_refused():
    config = configured("llama2")
    config.rope_parameters = {"rope_type": "mrope", "rope_theta": 10000.0}
    with pytest.raises(UnsupportedModel, match="rope type 'mrope' is not supported"):
        check(config)


def test_unknown_layer_types_are_refused():
    config = configured("qwen3")
    config.layer_types = ["full_attention", "chunked_attention"]
    with pytest.raises(UnsupportedModel, match="chunked_attention"):
        check(config)


def test_sliding_windows_per_layer_as_hugging_face_applies_them():
    assert layer_windows(configured("mistral-window")) == [40, 40]
    assert layer_windows(configured("mistral")) == [None, None]
    assert layer_windows(configured("phi3")) == [47, 47]
    # Qwen2 with use_sliding_window: only the layers from max_window_layers on
    qwen = configured("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=1)
    assert layer_windows(qwen) == [None, 64]


def test_a_stray_sliding_window_in_a_llama_or_gemma_config_is_ignored_as_hf_does():
    for name in ("llama2", "gemma"):
        assert layer_windows(configured(name, sliding_window=64)) == [None, None], name


@pytest.mark.parametrize("saved", ["float32", "bfloat16", "float16"])
def test_dtype_auto_is_the_checkpoints_where_this_cpu_computes_it(saved):
    config = configured("llama2", dtype=saved)
    native = {"float32": True, "bfloat16": onednn_bf16(), "float16": native_float16()}[saved]
    expected = getattr(torch, saved if native else "float32")
    assert compute_dtype("auto", config, "cpu") == expected
    assert compute_dtype("auto", config, "cuda") == getattr(torch, saved)
    assert compute_dtype("bfloat16", config, "cpu") == torch.bfloat16  # asked: as asked
    # where the row kernel computes the linear layers, bf16 is never slower than float32
    row = torch.bfloat16 if saved == "bfloat16" else expected
    assert compute_dtype("auto", config, "cpu", row_kernel=True) == row


def test_float16_is_refused_on_a_cpu_without_float16_arithmetic():
    if native_float16():
        pytest.skip("this CPU computes float16")
    with pytest.raises(UnsupportedModel, match="AVX512-FP16"):
        compute_dtype("float16", configured("llama2"), "cpu")
