"""A request's tools: the OpenAI body's fields read into the GenerateRequest (a 400 naming the
field), the checks both APIs share (INVALID_ARGUMENT), the tool choice's plan and the JSON schema
`required` and a named function constrain the output to."""

import json

import jsonschema
import pytest

from services.gateway.constraints import Grammars
from services.gateway.openai_request import BadRequest, parse
from services.gateway.prompt_tokenizer import PromptTokenizer
from services.gateway.tool_request import ToolPlan, plan_of
from services.gateway.tool_schema import tool_constraint
from services.gateway.validation import InvalidRequest, Limits, validate
from shared.api import tandem_pb2 as pb
from shared.values.constraint import ConstraintKind

LIMITS = Limits(max_model_len=8192, default_max_tokens=16, max_tokens_limit=64, max_stop_strings=4)
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "The time"}},
]


def chat(**fields) -> dict:
    return {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": TOOLS} | fields


def test_tools_and_tool_choice_become_the_generate_requests():
    req = parse("chat", chat(tool_choice="required", parallel_tool_calls=False), "m").request
    assert [(t.name, t.description) for t in req.tools] == [
        ("get_weather", ""),
        ("now", "The time"),
    ]
    assert json.loads(req.tools[0].parameters) == WEATHER and req.tools[1].parameters == ""
    assert req.tool_choice.mode == pb.TOOL_CHOICE_REQUIRED and not req.parallel_tool_calls
    named = {"type": "function", "function": {"name": "now"}}
    req = parse("chat", chat(tool_choice=named), "m").request
    assert (req.tool_choice.mode, req.tool_choice.function) == (pb.TOOL_CHOICE_FUNCTION, "now")
    req = parse("chat", chat(), "m").request
    assert req.tool_choice.mode == pb.TOOL_CHOICE_AUTO and not req.HasField("parallel_tool_calls")


def test_tool_messages_and_an_assistants_calls_are_kept():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "18C"}]},
    ]
    req = parse("chat", chat(messages=messages), "m").request
    assistant, tool = req.messages[1], req.messages[2]
    assert (assistant.content, len(assistant.tool_calls)) == ("", 1)
    call = assistant.tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "get_weather", '{"city": "Paris"}')
    assert (tool.role, tool.content, tool.tool_call_id, tool.name) == ("tool", "18C", "call_1", "")


def _call(**function) -> dict:
    return {"role": "assistant", "tool_calls": [{"type": "function", "function": function}]}


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"tools": {"a": 1}}, "tools"),
        ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0]"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]},
            "tools[0]",
        ),
        ({"tool_choice": "always"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": {"type": "function"}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"messages": [{"role": "tool", "content": "18C"}]}, "messages[0].tool_call_id"),
        ({"messages": [_call(name="f")]}, "messages[0].tool_calls[0]"),
        ({"messages": [_call(name="f", arguments={})]}, "messages[0].tool_calls[0]"),
        (
            {"messages": [{"role": "assistant", "function_call": {"name": "f"}}]},
            "messages[0].function_call",
        ),
    ],
)
def test_the_openai_api_names_the_field_at_fault(fields, named):
    with pytest.raises(BadRequest) as err:
        parse("chat", chat(**fields), "m")
    assert err.value.param == named


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return PromptTokenizer(tokenizer)


@pytest.fixture(scope="module")
def grammars(tokenizer):
    return Grammars(tokenizer)


def grpc_request(*messages, tools=TOOLS, mode=pb.TOOL_CHOICE_AUTO, function="", **fields):
    """A GenerateRequest as a gRPC client builds it."""
    return pb.GenerateRequest(
        messages=list(messages) or [pb.ChatMessage(role="user", content="Weather in Paris?")],
        tools=[
            pb.Tool(
                name=t["function"]["name"],
                parameters=json.dumps(t["function"].get("parameters", ""))
                if "parameters" in t["function"]
                else "",
            )
            for t in tools
        ],
        tool_choice=pb.ToolChoice(mode=mode, function=function),
        **fields,
    )


def assistant_call(arguments: str, name: str = "get_weather") -> pb.ChatMessage:
    call = pb.ToolCall(id="call_1", name=name, arguments=arguments)
    return pb.ChatMessage(role="assistant", tool_calls=[call])


USER = pb.ChatMessage(role="user", content="hi")


@pytest.mark.parametrize(
    "request_",
    [
        grpc_request(mode=pb.TOOL_CHOICE_FUNCTION, function="nope"),
        grpc_request(mode=pb.TOOL_CHOICE_NONE, function="now"),
        grpc_request(tools=[], mode=pb.TOOL_CHOICE_REQUIRED),
        grpc_request(tools=[TOOLS[0], TOOLS[0]]),  # two of one name
        grpc_request(tools=[{"type": "function", "function": {"name": "x" * 65}}]),
        grpc_request(tools=[TOOLS[1]] * 129),
        pb.GenerateRequest(prompt="hi", tools=[pb.Tool(name="f")]),  # tools need a chat
        pb.GenerateRequest(messages=[USER], tools=[pb.Tool(name="f", parameters="{")]),
        pb.GenerateRequest(messages=[USER], tools=[pb.Tool(name="f", parameters="[1]")]),
        pb.GenerateRequest(messages=[USER], tools=[pb.Tool(name="f", parameters="[" * 10**5)]),
        grpc_request(USER, pb.ChatMessage(role="tool", content="18C")),  # no tool_call_id
        grpc_request(USER, assistant_call("not json")),
        grpc_request(USER, assistant_call("[1, 2]")),
        grpc_request(USER, assistant_call("{}", name="bad name")),
        grpc_request(pb.ChatMessage(role="user", content="hi", tool_call_id="x")),
        grpc_request(USER, pb.ChatMessage(role="user", tool_calls=[pb.ToolCall(name="f")])),
        grpc_request(  # one constraint per request
            mode=pb.TOOL_CHOICE_REQUIRED,
            sampling=pb.SamplingParams(structured_output=pb.StructuredOutput(json_object=True)),
        ),
    ],
    ids=lambda r: str(r).replace("\n", " ")[:70],
)
def test_the_request_path_refuses_what_cannot_be_served(prompts, grammars, request_):
    with pytest.raises(InvalidRequest):
        validate(request_, prompts, LIMITS, grammars)


def test_auto_and_none_constrain_nothing_required_and_a_function_do(prompts, grammars):
    for mode in (pb.TOOL_CHOICE_AUTO, pb.TOOL_CHOICE_NONE):
        assert validate(grpc_request(mode=mode), prompts, LIMITS).sampling.constraint is None
    assert validate(grpc_request(mode=pb.TOOL_CHOICE_NONE), prompts, LIMITS).tools is None
    assert validate(grpc_request(), prompts, LIMITS).tools == ToolPlan("hermes")
    valid = validate(grpc_request(mode=pb.TOOL_CHOICE_REQUIRED), prompts, LIMITS, grammars)
    assert valid.sampling.constraint.kind == ConstraintKind.JSON_SCHEMA
    assert valid.tools == ToolPlan("required")
    named = grpc_request(mode=pb.TOOL_CHOICE_FUNCTION, function="get_weather")
    valid = validate(named, prompts, LIMITS, grammars)
    assert json.loads(valid.sampling.constraint.spec) == WEATHER
    assert valid.tools == ToolPlan("function", function="get_weather")


def test_plans_by_tool_choice():
    assert plan_of(grpc_request(tools=[]), "hermes") is None
    assert plan_of(grpc_request(), "mistral") == ToolPlan("mistral")
    one = grpc_request(parallel_tool_calls=False)
    assert plan_of(one, "llama3_json") == ToolPlan("llama3_json", parallel=False)


def schema_of(request: pb.GenerateRequest) -> dict:
    return json.loads(tool_constraint(request).spec)


def test_requireds_schema_takes_calls_of_the_tools_with_their_own_parameters():
    schema = schema_of(grpc_request(mode=pb.TOOL_CHOICE_REQUIRED))
    good = [
        {"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}},
        {"name": "now", "parameters": {}},
    ]
    jsonschema.validate(good, schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"unit": "celsius"}}],  # city is required
        [{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}],
        [{"name": "other", "parameters": {}}],
        [{"name": "now"}],
        [{"name": "now", "parameters": {}, "more": 1}],  # a call has nothing else
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = schema_of(grpc_request(mode=pb.TOOL_CHOICE_REQUIRED, parallel_tool_calls=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(good, one)


def test_a_named_functions_schema_is_its_parameters_and_defs_move_to_the_root():
    assert schema_of(grpc_request(mode=pb.TOOL_CHOICE_FUNCTION, function="now")) == {
        "type": "object",
        "properties": {},
    }
    place = {
        "type": "object",
        "properties": {"at": {"$ref": "#/$defs/place"}},
        "required": ["at"],
        "$defs": {"place": {"type": "string", "minLength": 2}},
    }
    tools = [{"type": "function", "function": {"name": "go", "parameters": place}}]
    schema = schema_of(grpc_request(tools=tools, mode=pb.TOOL_CHOICE_REQUIRED))
    assert "$defs" in schema and "$defs" not in schema["items"]["anyOf"][0]["properties"]
    jsonschema.validate([{"name": "go", "parameters": {"at": "Paris"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "go", "parameters": {"at": "P"}}], schema)
