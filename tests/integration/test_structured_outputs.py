"""Structured outputs through the official `openai` client: `parse()` with a nested Pydantic
model (bounded strings and lists) returns a valid object on the default model, disaggregated and
colocated, greedy and sampled; greedy output under a schema is the same on both paths; regex and
choice (vLLM's extensions, through extra_body), json_object; a hostile schema is a 400."""

import json

import openai
import pytest

from harness.structured import ASK, City

pytestmark = pytest.mark.slow


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0)


def model(stack) -> str:
    return client(stack).models.list().data[0].id


def parsed(stack, temperature: float, seed: int = 0):
    return client(stack).chat.completions.parse(
        model=model(stack),
        messages=[{"role": "user", "content": ASK}],
        response_format=City,
        temperature=temperature,
        seed=seed,
        max_tokens=256,
    )


def test_parse_gives_a_valid_object_on_both_paths_greedy_and_sampled(disagg, colocated):
    greedy = {}
    for name, stack in (("disaggregated", disagg), ("colocated", colocated)):
        for temperature, seed in ((0.0, 0), (0.8, 1), (0.8, 2)):
            answer = parsed(stack, temperature, seed)
            message = answer.choices[0].message
            assert isinstance(message.parsed, City), message.content  # parse() validated it
            assert answer.choices[0].finish_reason == "stop"
            if temperature == 0:
                greedy[name] = message.content
    assert greedy["disaggregated"] == greedy["colocated"]


def test_regex_choice_and_json_object(disagg):
    chat = client(disagg).chat.completions
    regex = chat.create(
        model=model(disagg),
        messages=[{"role": "user", "content": "Give a date."}],
        extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}},
        max_tokens=20,
        temperature=0.7,
    )
    text = regex.choices[0].message.content
    assert len(text) == 10 and text[:2] == "20" and text[4] == text[7] == "-", text
    choice = chat.create(
        model=model(disagg),
        messages=[{"role": "user", "content": "Is water wet?"}],
        extra_body={"guided_choice": ["yes", "no"]},
        max_tokens=5,
        n=3,
        temperature=1.0,
    )
    assert {c.message.content for c in choice.choices} <= {"yes", "no"}
    anything = chat.create(
        model=model(disagg),
        messages=[{"role": "user", "content": 'Answer in JSON: {"capital of France": ...}'}],
        response_format={"type": "json_object"},
        max_tokens=128,
        temperature=0,
    )
    assert anything.choices[0].finish_reason == "stop", anything.choices[0].message.content
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


def nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


@pytest.mark.parametrize(
    "response_format",
    [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": nested(200)},
        },
    ],
    ids=["invalid", "hostile"],
)
def test_a_schema_that_cannot_be_used_is_a_400(disagg, response_format):
    with pytest.raises(openai.BadRequestError) as err:
        client(disagg).chat.completions.create(
            model=model(disagg),
            messages=[{"role": "user", "content": "hi"}],
            response_format=response_format,
            max_tokens=4,
        )
    assert "json_schema" in err.value.message
