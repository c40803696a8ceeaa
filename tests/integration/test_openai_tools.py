"""Tool calls through the official `openai` client against real stacks (the default model,
SmolLM2, whose template has no tools: the Hermes default): tool_choice required gives calls whose
arguments validate against the tool's schema (50 of 50, disaggregated), a named function streams
its calls (colocated, n 3); auto, none, n > 1 and the tool messages are served; a streamed
answer's calls are the whole answer's, and gRPC's last response has them."""

import json

import jsonschema
import openai
import pytest

from shared.api import tandem_pb2 as pb
from tests.integration.helpers import collect
from tests.integration.test_openai_api import client, model_of

pytestmark = pytest.mark.slow
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather now in a city",
            "parameters": WEATHER,
        },
    }
]
ASK = [{"role": "user", "content": "What is the weather like in Paris?"}]
ROUND_TRIP = [
    *ASK,
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"},
]


def ask(stack, **fields):
    kw = dict(model=model_of(stack), messages=ASK, tools=TOOLS, max_tokens=64, temperature=0)
    return client(stack).chat.completions.create(**(kw | fields))


def test_required_gives_calls_whose_arguments_fit_the_schema_50_of_50(disagg):
    answer = ask(
        disagg,
        tool_choice="required",
        parallel_tool_calls=False,
        n=50,
        temperature=1.0,
        seed=7,
        max_tokens=96,
    )
    valid = 0
    for choice in answer.choices:
        for call in choice.message.tool_calls or []:
            assert call.function.name == "get_weather" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), WEATHER)
            valid += 1
    assert valid == 50
    assert all(choice.finish_reason == "tool_calls" for choice in answer.choices)


def test_a_named_function_streams_its_calls_colocated_each_of_n(colocated):
    chunks = ask(
        colocated,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        n=3,
        temperature=1.0,
        seed=11,
        stream=True,
    )
    calls: dict[int, list[str]] = {}
    finish = {}
    for chunk in chunks:
        (choice,) = chunk.choices
        for call in choice.delta.tool_calls or []:
            assert call.index == 0 and (call.id is None) == (choice.index in calls)
            entry = calls.setdefault(choice.index, [call.function.name, ""])
            entry[1] += call.function.arguments or ""
        finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert sorted(calls) == [0, 1, 2] and set(finish.values()) == {"tool_calls"}
    for name, arguments in calls.values():
        assert name == "get_weather"
        jsonschema.validate(json.loads(arguments), WEATHER)


def test_auto_is_served_and_streams_the_whole_answers_calls(disagg):
    whole = ask(disagg, tool_choice="auto").choices[0]
    assert whole.finish_reason in ("stop", "length", "tool_calls")
    chunks = list(ask(disagg, tool_choice="auto", stream=True))
    content = "".join(c.choices[0].delta.content or "" for c in chunks)
    calls: dict[int, list[str]] = {}
    for chunk in chunks:
        for call in chunk.choices[0].delta.tool_calls or []:
            entry = calls.setdefault(call.index, ["", ""])
            entry[0] += call.function.name or ""
            entry[1] += call.function.arguments or ""
    assert content == (whole.message.content or "")
    assert [(n, json.loads(a)) for n, a in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []
    ]
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason


def test_none_answers_in_text(disagg):
    choice = ask(disagg, tool_choice="none").choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_a_tool_answer_and_the_call_it_answers_are_taken_and_answered(disagg):
    answer = ask(disagg, messages=ROUND_TRIP, n=2, temperature=0.7, seed=3)
    assert [c.index for c in answer.choices] == [0, 1]
    for choice in answer.choices:
        assert choice.message.content or choice.message.tool_calls
    assert answer.usage.prompt_tokens > 100  # the tools and the Hermes instruction were rendered


def test_grpcs_last_response_has_the_calls_the_http_answer_has(disagg):
    whole = ask(disagg, messages=ROUND_TRIP).choices[0]
    request = pb.GenerateRequest(
        messages=[
            pb.ChatMessage(role="user", content=ASK[0]["content"]),
            pb.ChatMessage(
                role="assistant",
                tool_calls=[
                    pb.ToolCall(
                        id="call_1",
                        name="get_weather",
                        arguments='{"city": "Paris", "unit": "celsius"}',
                    )
                ],
            ),
            pb.ChatMessage(role="tool", content="18 degrees, sunny", tool_call_id="call_1"),
        ],
        tools=[
            pb.Tool(
                name="get_weather",
                description=TOOLS[0]["function"]["description"],
                parameters=json.dumps(WEATHER),
            )
        ],
        sampling=pb.SamplingParams(max_tokens=64, temperature=0),
    )
    chunks, _, text = collect(disagg.stub(), request)
    last = chunks[-1]
    assert [(c.name, json.loads(c.arguments)) for c in last.tool_calls] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls or []
    ]
    assert (last.content if last.HasField("content") else None) == whole.message.content
    assert bool(last.tool_calls) == (last.finish_reason == pb.FINISH_REASON_TOOL_CALLS) or (
        last.finish_reason == pb.FINISH_REASON_LENGTH
    )


def test_a_tool_choice_naming_no_tool_is_a_400_that_names_it(disagg):
    with pytest.raises(openai.BadRequestError) as err:
        ask(disagg, tool_choice={"type": "function", "function": {"name": "nope"}})
    assert err.value.status_code == 400 and "tool_choice" in err.value.message
