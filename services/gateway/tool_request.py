"""A GenerateRequest's tools, checked, and what they ask of its output.

The tools (OpenAI's function tools), the tool choice and the tool messages (an assistant's
`tool_calls`, a `tool` message answering one) are checked here for both APIs; the OpenAI API has
checked their shapes first, naming the field at fault. `plan_of` says how the output becomes
tool calls (docs/api.md#tool-calls): with `auto`, parsed in the format of the model's chat
template; with `required` or a named function, read from the JSON the output is constrained to
(tool_schema.py); with `none`, not at all.
"""

import json
import re
from dataclasses import dataclass

from services.gateway.invalid import InvalidRequest
from shared.api import tandem_pb2 as pb

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128  # OpenAI's bound
MAX_CALLS = 128  # calls in one assistant message
MAX_CALL_ID = 256  # characters of a call's id
AUTO, NONE = pb.TOOL_CHOICE_AUTO, pb.TOOL_CHOICE_NONE
REQUIRED, FUNCTION = pb.TOOL_CHOICE_REQUIRED, pb.TOOL_CHOICE_FUNCTION


@dataclass(frozen=True)
class ToolPlan:
    """How a request's output becomes tool calls: `parser` names its format (tool_parsers.PARSERS):
    a chat template's own (hermes, llama3_json, mistral: the model decides), or the constrained
    JSON of `required` (an array of calls) or of a named `function` (its arguments alone)."""

    parser: str
    function: str = ""  # parser "function": the function named
    parallel: bool = True  # False: only the first call is kept


def plan_of(request: pb.GenerateRequest, template_parser: str) -> ToolPlan | None:
    """None when nothing is parsed: no tools, or tool_choice none."""
    mode = request.tool_choice.mode
    if not request.tools or mode == NONE:
        return None
    parallel = not request.HasField("parallel_tool_calls") or request.parallel_tool_calls
    if mode == REQUIRED:
        return ToolPlan("required", parallel=parallel)
    if mode == FUNCTION:
        return ToolPlan("function", function=request.tool_choice.function)
    return ToolPlan(template_parser, parallel=parallel)


def check_tools(request: pb.GenerateRequest) -> None:
    """InvalidRequest unless the request's tools, tool choice and tool messages can be served."""
    tools, choice = request.tools, request.tool_choice
    if tools and not request.messages:
        raise InvalidRequest("tools need messages (a chat); a raw prompt or token ids take none")
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"at most {MAX_TOOLS} tools")
    names = [tool.name for tool in tools]
    for name in names:
        _check_name(name, "tools")
    if len(set(names)) < len(names):
        raise InvalidRequest("tools: each function needs a name of its own")
    for tool in tools:
        parameters_of(tool)
    if choice.mode in (REQUIRED, FUNCTION) and not tools:
        raise InvalidRequest("tool_choice required or a function needs tools")
    if choice.mode == FUNCTION and choice.function not in names:
        raise InvalidRequest(f"tool_choice names {choice.function!r}, which is none of the tools")
    if choice.function and choice.mode != FUNCTION:
        raise InvalidRequest("tool_choice.function is for the mode TOOL_CHOICE_FUNCTION")
    for i, message in enumerate(request.messages):
        _check_message(message, f"messages[{i}]")


def parameters_of(tool: pb.Tool) -> dict | None:
    """The tool's parameters schema (None: it has none), or InvalidRequest."""
    if not tool.parameters:
        return None
    schema = _json(tool.parameters, f"tools: {tool.name}'s parameters")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"tools: {tool.name}'s parameters must be a JSON schema object")
    return schema


def arguments_of(call: pb.ToolCall, where: str) -> dict:
    """A call's arguments as the object they encode, or InvalidRequest."""
    arguments = _json(call.arguments or "{}", f"{where}.arguments")
    if not isinstance(arguments, dict):
        raise InvalidRequest(f"{where}.arguments must encode a JSON object")
    return arguments


def tool_chars(request: pb.GenerateRequest) -> int:
    """Characters the tools and the tool calls add to the prompt's text (checked against what the
    context can hold before rendering, as the messages' are)."""
    tools = sum(len(t.name) + len(t.description) + len(t.parameters) for t in request.tools)
    calls = sum(len(c.name) + len(c.arguments) for m in request.messages for c in m.tool_calls)
    return tools + calls


def _check_message(message: pb.ChatMessage, where: str) -> None:
    if message.tool_calls and message.role != "assistant":
        raise InvalidRequest(f"{where}: only an assistant's message has tool_calls")
    if (message.tool_call_id or message.name) and message.role != "tool":
        raise InvalidRequest(f"{where}: only a tool's message has tool_call_id and name")
    if message.role == "tool" and not 0 < len(message.tool_call_id) <= MAX_CALL_ID:
        raise InvalidRequest(f"{where}.tool_call_id must be 1-{MAX_CALL_ID} characters")
    if len(message.tool_calls) > MAX_CALLS:
        raise InvalidRequest(f"{where}: at most {MAX_CALLS} tool_calls")
    for j, call in enumerate(message.tool_calls):
        at = f"{where}.tool_calls[{j}]"
        _check_name(call.name, f"{at}.function.name")
        if len(call.id) > MAX_CALL_ID:
            raise InvalidRequest(f"{at}.id must be at most {MAX_CALL_ID} characters")
        arguments_of(call, f"{at}.function")


def _check_name(name: str, where: str) -> None:
    if not NAME.fullmatch(name):
        raise InvalidRequest(f"{where}: a function's name is 1-64 of A-Z a-z 0-9 _ -, got {name!r}")


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except RecursionError:
        raise InvalidRequest(f"{where} is nested too deeply") from None
    except ValueError as err:
        raise InvalidRequest(f"{where} is not JSON: {err}") from None
