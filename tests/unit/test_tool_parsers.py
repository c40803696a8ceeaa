"""Tool calls parsed out of a whole output give what vLLM's parsers of the same names give for the
same text: each case below is a text from vLLM's own parser tests (tests/entrypoints/openai/
tool_parsers/test_hermes_tool_parser.py, test_llama3_json_tool_parser.py, tests/tool_parsers/
test_mistral_tool_parser.py, pre-v11 tokenizer), with the tool_calls (name, arguments JSON text)
and content vLLM asserts, or, where its test asserts only part, what its parser returns."""

import json

import pytest

from services.gateway.tool_parsers import Call, Parsed, parse_output
from services.gateway.tool_request import ToolPlan

# vLLM's Hermes test: a long reasoning preamble (shortened here), then one call
HERMES_PREAMBLE = "好的，用户现在要研发一个5MW的燃气轮机，需要确定总体参数。\n</think>\n\n"
HERMES_QWQ = (
    HERMES_PREAMBLE + "<tool_call>"
    '\n{"name": "internet_search", "arguments": {"question": "'
    "5MW燃气轮机设计参数 空气流量 压气机压比 转速 燃烧室出口温度 压气机级数"
    ' 支点布局"}}\n</tool_call>\n\n '
)
QWQ_ARGUMENTS = '{"question": "5MW燃气轮机设计参数 空气流量 压气机压比 转速 燃烧室出口温度 压气机级数 支点布局"}'
FINAL_ANSWER = '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}\n</tool_call>'
TEMPERATURE = (
    '<tool_call>{"name": "get_current_temperature","arguments": {"location":"San Francisco, '
    'California, United States", "unit": "celsius"}}</tool_call>'
)

HERMES = [
    ("This is not a tool call.", Parsed("This is not a tool call.")),
    (FINAL_ANSWER, Parsed(None, [Call("final_answer", '{"trigger": true}')])),
    (  # until the end of the output, no closing tag
        '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}}',
        Parsed(None, [Call("final_answer", '{"trigger": true}')]),
    ),
    (  # invalid JSON: a brace missing
        '<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}',
        Parsed('<tool_call>\n{"name": "final_answer", "arguments": {"trigger": true}'),
    ),
    (HERMES_QWQ, Parsed(HERMES_PREAMBLE, [Call("internet_search", QWQ_ARGUMENTS)])),
    (
        TEMPERATURE,
        Parsed(
            None,
            [
                Call(
                    "get_current_temperature",
                    '{"location": "San Francisco, California, United States", "unit": "celsius"}',
                )
            ],
        ),
    ),
]

LLAMA = [
    (
        'Here is the result: {"name": "getOpenIncidentsTool", "parameters": {}} Would you like '
        "to know more?",
        Parsed(None, [Call("getOpenIncidentsTool", "{}")]),
    ),
    (
        '{"name": "searchTool", "parameters": {"query": "test query", "limit": 10}}',
        Parsed(None, [Call("searchTool", '{"query": "test query", "limit": 10}')]),
    ),
    (
        "This is just some text without any tool calls",
        Parsed("This is just some text without any tool calls"),
    ),
    (
        '{"name": "invalidTool", "parameters": {invalid json}',
        Parsed('{"name": "invalidTool", "parameters": {invalid json}'),
    ),
    (
        '{"name": "searchTool", "arguments": {"query": "test"}}',
        Parsed(None, [Call("searchTool", '{"query": "test"}')]),
    ),
    (
        '{"name": "searchTool", "parameters": {"query": "test1"}}; '
        '{"name": "getOpenIncidentsTool", "parameters": {}}; '
        '{"name": "searchTool", "parameters": {"query": "test2"}}',
        Parsed(
            None,
            [
                Call("searchTool", '{"query": "test1"}'),
                Call("getOpenIncidentsTool", "{}"),
                Call("searchTool", '{"query": "test2"}'),
            ],
        ),
    ),
    (
        '{"name": "searchTool", "parameters": {"query": "test1"}} ; '
        '{"name": "getOpenIncidentsTool", "parameters": {}} ; '
        '{"name": "searchTool", "parameters": {"query": "test2"}}',
        Parsed(
            None,
            [
                Call("searchTool", '{"query": "test1"}'),
                Call("getOpenIncidentsTool", "{}"),
                Call("searchTool", '{"query": "test2"}'),
            ],
        ),
    ),
    (
        "Here are the results: "
        '{"name": "searchTool", "parameters": {"query": "test1"}}; '
        '{"name": "getOpenIncidentsTool", "parameters": {}}; '
        '{"name": "searchTool", "parameters": {"query": "test2"}} '
        "Would you like to know more?",
        Parsed(
            None,
            [
                Call("searchTool", '{"query": "test1"}'),
                Call("getOpenIncidentsTool", "{}"),
                Call("searchTool", '{"query": "test2"}'),
            ],
        ),
    ),
    (
        '{"name": "complexTool", "parameters": {"level1": {"level2": {"level3": {"level4": '
        '{"value": "deep"}}}}}}',
        Parsed(
            None,
            [
                Call(
                    "complexTool",
                    '{"level1": {"level2": {"level3": {"level4": {"value": "deep"}}}}}',
                )
            ],
        ),
    ),
    (
        '{"name": "simpleTool", "parameters": {"value": "test"}}; '
        '{"name": "complexTool", "parameters": '
        '{"config": {"database": {"connection": {"pool": {"size": 10}}}}}}',
        Parsed(
            None,
            [
                Call("simpleTool", '{"value": "test"}'),
                Call(
                    "complexTool",
                    '{"config": {"database": {"connection": {"pool": {"size": 10}}}}}',
                ),
            ],
        ),
    ),
    (
        '{"name": "searchTool", "parameters": {"query": "test {value} [complex]","nested": '
        '{"inner": "more {brackets}"}}}',
        Parsed(
            None,
            [
                Call(
                    "searchTool",
                    '{"query": "test {value} [complex]", "nested": {"inner": "more {brackets}"}}',
                )
            ],
        ),
    ),
    (
        '{"name": "parserTool", "parameters": {"text": "He said \\"Hello {world}\\""}}',
        Parsed(None, [Call("parserTool", '{"text": "He said \\"Hello {world}\\""}')]),
    ),
]

WEATHER = {"city": "San Francisco", "state": "CA", "unit": "celsius"}
MISTRAL = [
    ("This is a test", Parsed("This is a test")),
    (
        '[TOOL_CALLS][{"name": "add", "arguments":{"a": 3.5, "b": 4}}]',
        Parsed(None, [Call("add", json.dumps({"a": 3.5, "b": 4}))]),
    ),
    (
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "San Francisco", '
        '"state": "CA", "unit": "celsius"}}]',
        Parsed(None, [Call("get_current_weather", json.dumps(WEATHER))]),
    ),
    (  # the arguments before the name
        '[TOOL_CALLS] [{"arguments":{"city": "San Francisco", "state": "CA", "unit": "celsius"}, '
        '"name": "get_current_weather"}]',
        Parsed(None, [Call("get_current_weather", json.dumps(WEATHER))]),
    ),
    (  # and a "name" inside the arguments
        '[TOOL_CALLS] [{"arguments":{"name": "John Doe"}, "name": "get_age"}]',
        Parsed(None, [Call("get_age", json.dumps({"name": "John Doe"}))]),
    ),
    (
        '[TOOL_CALLS] [{"name": "add", "arguments": {"a": 3.5, "b": 4}}, {"name": '
        '"get_current_weather", "arguments":{"city": "San Francisco", "state": "CA", "unit": '
        '"celsius"}}]',
        Parsed(
            None,
            [
                Call("add", json.dumps({"a": 3.5, "b": 4})),
                Call("get_current_weather", json.dumps(WEATHER)),
            ],
        ),
    ),
    (
        'Hello[TOOL_CALLS] [{"name": "add", "arguments":{"a": 1, "b": 2}}]',
        Parsed("Hello", [Call("add", json.dumps({"a": 1, "b": 2}))]),
    ),
    (  # trailing data after the JSON
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments":{"city": "Dallas", "state": '
        '"TX", "unit": "fahrenheit"}}]\nextra trailing data',
        Parsed(
            None,
            [
                Call(
                    "get_current_weather",
                    json.dumps({"city": "Dallas", "state": "TX", "unit": "fahrenheit"}),
                )
            ],
        ),
    ),
    (  # the regex fallback past leading junk
        '[TOOL_CALLS]  junk [{"name": "add", "arguments":{"a": 1, "b": 2}}] trail',
        Parsed(None, [Call("add", json.dumps({"a": 1, "b": 2}))]),
    ),
    ("[TOOL_CALLS] not json at all", Parsed("not json at all")),
]

VLLM_CASES = (
    [("hermes", *case) for case in HERMES]
    + [("llama3_json", *case) for case in LLAMA]
    + [("mistral", *case) for case in MISTRAL]
)


@pytest.mark.parametrize("parser, output, expected", VLLM_CASES)
def test_each_format_parses_as_vllms_parser_does(parser, output, expected):
    assert parse_output(ToolPlan(parser), output) == expected


def test_the_content_is_none_when_the_output_is_only_calls_and_text_otherwise():
    plan = ToolPlan("hermes")
    assert parse_output(plan, "Let me look.\n" + FINAL_ANSWER).content == "Let me look.\n"
    assert parse_output(plan, FINAL_ANSWER).content is None
    assert parse_output(plan, "").content == ""


def test_several_hermes_calls_and_the_text_between_them_dropped():
    output = FINAL_ANSWER + "\nand\n" + FINAL_ANSWER.replace("true", "false")
    parsed = parse_output(ToolPlan("hermes"), output)
    assert parsed.calls == [
        Call("final_answer", '{"trigger": true}'),
        Call("final_answer", '{"trigger": false}'),
    ]


@pytest.mark.parametrize(
    "parser, output",
    [
        ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        ("hermes", '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),  # not a string
        ("hermes", '<tool_call>{"name": "f"}</tool_call>'),  # no arguments
        ("llama3_json", '{"name": "f", "parameters": {}} and {"other": 1}'),
        ("mistral", ' [{"name": "f"}]'),
        ("required", '[{"name": "f", "arguments": {}}]'),
        ("required", "[]"),
        ("required", '{"name": "f", "parameters": {}}'),
    ],
)
def test_malformed_calls_leave_the_output_as_content(parser, output):
    parsed = parse_output(ToolPlan(parser), output)
    assert parsed.calls == [] and parsed.content == output


def test_mistrals_marker_left_out_by_the_detokenizer_is_not_needed_at_the_start():
    """[TOOL_CALLS] is a special token: the workers' text has none, so a leading array is read
    as the calls it would have marked; any other text stays content."""
    plan = ToolPlan("mistral")
    parsed = parse_output(plan, ' [{"name": "add", "arguments": {"a": 1}}]')
    assert parsed == Parsed(None, [Call("add", '{"a": 1}')])
    assert parse_output(plan, "[1, 2] are numbers") == Parsed("[1, 2] are numbers")


def test_the_constrained_outputs_of_required_and_of_a_named_function():
    required = parse_output(
        ToolPlan("required"),
        '[{"name": "f", "parameters": {"x": "é"}}, {"name": "g", "parameters": {}}]',
    )
    assert required == Parsed(None, [Call("f", '{"x": "é"}'), Call("g", "{}")])
    named = parse_output(ToolPlan("function", function="f"), ' {"x":1} ')
    assert named == Parsed(None, [Call("f", '{"x": 1}')])
    assert parse_output(ToolPlan("function", function="f"), '{"x": ').content == '{"x": '


def test_without_parallel_calls_only_the_first_is_kept():
    output = '[{"name": "f", "parameters": {}}, {"name": "g", "parameters": {}}]'
    assert parse_output(ToolPlan("required", parallel=False), output).calls == [Call("f", "{}")]
