"""Tool calls parsed out of a whole output, in each format's own way: what vLLM's parsers of the
same names give for the same text (tests/unit/test_tool_parsers.py feeds them vLLM's own test
texts).

- `hermes` (Hermes, Qwen): each `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the
  last one possibly unclosed; the content is the text before the first tag.
- `llama3_json` (Llama 3.1 and later): each JSON object in the text with a `name` and
  `parameters` (or `arguments`), after `<|python_tag|>` or not, several separated by `;`; the
  text around them is dropped.
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`; the content is the text
  before the marker. `[TOOL_CALLS]` is a special token, which the workers leave out of the text:
  an output that starts with `[` is read as if the marker came first.
- `required`, `function`: the JSON a constrained output is (tool_schema.py): an array of
  `{"name", "parameters"}`, or a named function's arguments.

A call that is not JSON, or not a call (no name, no arguments), leaves the whole output as
content, as vLLM does. Arguments are JSON text (json.dumps of what was parsed).
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from services.gateway.tool_request import ToolPlan

HERMES = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
MISTRAL_MARKER = "[TOOL_CALLS]"
MISTRAL_ARRAY = re.compile(r"\[{.*}\]", re.DOTALL)
PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()
_NOT_A_CALL = (ValueError, KeyError, TypeError, IndexError)


@dataclass(frozen=True)
class Call:
    name: str
    arguments: str  # JSON text


@dataclass(frozen=True)
class Parsed:
    content: str | None  # the text outside the calls; None: there is none
    calls: list[Call] = field(default_factory=list)


def text_only(output: str) -> Parsed:
    return Parsed(output)


def call_of(obj, keys: tuple[str, ...]) -> Call:
    """The call `obj` encodes (its arguments under the first of `keys` it has), or KeyError /
    TypeError."""
    name = obj["name"]
    if not isinstance(name, str):
        raise TypeError("a call's name is a string")
    arguments = obj[next((key for key in keys if key in obj), keys[-1])]
    return Call(name, json.dumps(arguments, ensure_ascii=False))


def hermes(output: str) -> Parsed:
    start = output.find("<tool_call>")
    if start < 0:
        return text_only(output)
    try:
        objects = [json.loads(closed or open_) for closed, open_ in HERMES.findall(output)]
        calls = [call_of(obj, ("arguments",)) for obj in objects]
    except _NOT_A_CALL:
        return text_only(output)
    return Parsed(output[:start] or None, calls)


def llama3_json(output: str) -> Parsed:
    """Every `{` outside an object already read starts one (a `{` right after one is skipped,
    as in vLLM's)."""
    if PYTHON_TAG not in output and "{" not in output:
        return text_only(output)
    end, calls = -1, []
    for brace in re.finditer(r"\{", output):
        if brace.start() <= end:
            continue
        try:
            obj, end = _DECODER.raw_decode(output, brace.start())
            calls.append(call_of(obj, ("arguments", "parameters")))
        except _NOT_A_CALL:
            return text_only(output)
    return Parsed(None, calls) if calls else text_only(output)


def mistral(output: str) -> Parsed:
    if MISTRAL_MARKER not in output:
        if not output.lstrip().startswith("["):
            return text_only(output)
        parsed = mistral(MISTRAL_MARKER + output.lstrip())
        return parsed if parsed.calls else text_only(output)
    calls_text = output.replace(MISTRAL_MARKER, "").strip()
    try:
        try:
            objects = json.loads(calls_text)
        except ValueError:
            objects = json.loads(MISTRAL_ARRAY.findall(calls_text)[0])
        calls = [call_of(obj, ("arguments",)) for obj in objects]
    except _NOT_A_CALL:
        return Parsed(calls_text)
    return Parsed(output.split(MISTRAL_MARKER)[0] or None, calls)


def required(output: str) -> Parsed:
    """`tool_choice: required`: the array of calls the output was constrained to."""
    try:
        objects = json.loads(output)
        calls = [call_of(obj, ("parameters",)) for obj in objects]
    except _NOT_A_CALL:
        return text_only(output)
    return Parsed(None, calls) if calls else text_only(output)


def function(output: str, name: str) -> Parsed:
    """A named function's arguments, the object the output was constrained to."""
    try:
        arguments = json.loads(output)
    except ValueError:
        return text_only(output)
    if not isinstance(arguments, dict):
        return text_only(output)
    return Parsed(None, [Call(name, json.dumps(arguments, ensure_ascii=False))])


PARSERS: dict[str, Callable[[str], Parsed]] = {
    "hermes": hermes,
    "llama3_json": llama3_json,
    "mistral": mistral,
    "required": required,
}


def parse_output(plan: ToolPlan, output: str) -> Parsed:
    """The calls in a choice's whole output, by the request's plan."""
    if plan.parser == "function":
        parsed = function(output, plan.function)
    else:
        parsed = PARSERS[plan.parser](output)
    return parsed if plan.parallel else Parsed(parsed.content, parsed.calls[:1])
