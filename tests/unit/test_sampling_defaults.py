"""The model's generation config as the OpenAI API's defaults for omitted sampling fields."""

import json
from types import SimpleNamespace

import pytest

from services.gateway.openai_request import parse
from services.gateway.sampling_defaults import OPENAI, SamplingDefaults

BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def checkpoint(tmp_path, **generation) -> str:
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    return str(tmp_path)


def test_the_generation_config_s_sampling_fields_are_the_defaults(tmp_path):
    path = checkpoint(
        tmp_path, do_sample=True, temperature=0.7, top_p=0.8, top_k=20, eos_token_id=2
    )
    assert SamplingDefaults.of(path) == SamplingDefaults(0.7, 0.8, 20)


def test_a_field_the_file_leaves_out_or_cannot_mean_keeps_openai_s(tmp_path):
    assert SamplingDefaults.of(checkpoint(tmp_path, temperature=0.6)) == SamplingDefaults(0.6)
    odd = checkpoint(tmp_path, temperature="hot", top_p=0, top_k=-1)
    assert SamplingDefaults.of(odd) == OPENAI
    (tmp_path / "generation_config.json").write_text("{not json")
    assert SamplingDefaults.of(tmp_path) == OPENAI
    assert SamplingDefaults.of(tmp_path / "absent") == OPENAI


def test_omitted_fields_take_the_defaults_and_given_ones_win():
    defaults = SamplingDefaults(0.7, 0.8, 20)
    s = parse("chat", BODY, "m", defaults).request.sampling
    assert (s.temperature, s.top_p, s.top_k) == pytest.approx((0.7, 0.8, 20))
    given = parse("chat", BODY | {"temperature": 0, "top_p": 1, "top_k": -1}, "m", defaults)
    s = given.request.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0, 1, 0)  # greedy, as asked
    s = parse("completion", {"prompt": "x"}, "m").request.sampling
    assert (s.temperature, s.top_p, s.top_k) == (1, 1, 0)  # OpenAI's own


def test_the_generation_config_s_repetition_penalty_is_the_default_as_in_vllm(tmp_path):
    defaults = SamplingDefaults.of(checkpoint(tmp_path, repetition_penalty=1.05))
    assert defaults == SamplingDefaults(repetition_penalty=1.05)
    omitted = parse("chat", BODY, "m", defaults).request.sampling
    assert omitted.repetition_penalty == pytest.approx(1.05)
    given = parse("chat", BODY | {"repetition_penalty": 1}, "m", defaults).request.sampling
    assert not given.HasField("repetition_penalty")  # 1: off, as asked
    assert SamplingDefaults.of(checkpoint(tmp_path, repetition_penalty=0)) == OPENAI


def test_the_gateway_s_http_api_reads_them_from_the_model_directory(tmp_path):
    from services.gateway.__main__ import openai_api
    from services.gateway.settings import GatewaySettings

    served = SimpleNamespace(name_or_path=checkpoint(tmp_path, temperature=0.6, top_p=0.9))
    servicer = SimpleNamespace(tokenizer=served)
    api = openai_api(GatewaySettings(http_port=0), servicer, SimpleNamespace(serving=True))
    assert api.defaults == SamplingDefaults(0.6, 0.9)
