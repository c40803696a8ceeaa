"""An OpenAI chat body's tools as the GenerateRequest's: `tools` (type function), `tool_choice`
(none, auto, required, or {"type": "function", "function": {"name": ...}}), `parallel_tool_calls`,
and an assistant message's `tool_calls`; each shape checked here, a 400 naming the field. The
values (names, schemas, arguments) are checked on the request path both APIs share
(tool_request.py), so a gRPC client gets the same rules."""

import json
from typing import Any

from services.gateway.body_fields import BadRequest, flag
from services.gateway.tool_request import MAX_CALLS, MAX_TOOLS, NAME
from shared.api import tandem_pb2 as pb

CHOICES = {
    "auto": pb.TOOL_CHOICE_AUTO,
    "none": pb.TOOL_CHOICE_NONE,
    "required": pb.TOOL_CHOICE_REQUIRED,
}


def tools_into(request: pb.GenerateRequest, body: dict) -> None:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
            raise BadRequest(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
        request.tools.extend(_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    _choice_into(request, body.get("tool_choice"))
    if body.get("parallel_tool_calls") is not None:
        request.parallel_tool_calls = flag(body, "parallel_tool_calls")


def calls_into(message: pb.ChatMessage, calls: Any, where: str) -> None:
    """An assistant message's tool_calls: [{"id", "type": "function", "function": {"name",
    "arguments": <JSON text>}}]."""
    if not isinstance(calls, list) or len(calls) > MAX_CALLS:
        raise BadRequest(f"{where} must be a list of at most {MAX_CALLS} calls", where)
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function":
            raise BadRequest(f'{at} must be {{"type": "function", "function": {{...}}}}', at)
        name, arguments, call_id = function.get("name"), function.get("arguments"), call.get("id")
        if not isinstance(name, str) or not isinstance(arguments, str):
            raise BadRequest(f"{at}.function needs a name and arguments (JSON text)", at)
        if not isinstance(call_id, str | None):
            raise BadRequest(f"{at}.id must be a string", f"{at}.id")
        message.tool_calls.add(id=call_id or "", name=name, arguments=arguments)


def _tool(tool: Any, where: str) -> pb.Tool:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or tool.get("type") != "function":
        raise BadRequest(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
    name, description = function.get("name"), function.get("description")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise BadRequest(
            f"{where}.function.name must be 1-64 of A-Z a-z 0-9 _ -", f"{where}.function.name"
        )
    if not isinstance(description, str | None):
        raise BadRequest(f"{where}.function.description must be a string", where)
    parameters = function.get("parameters")
    if not isinstance(parameters, dict | None):
        raise BadRequest(f"{where}.function.parameters must be a JSON schema object", where)
    return pb.Tool(
        name=name,
        description=description or "",
        parameters=json.dumps(parameters, ensure_ascii=False) if parameters is not None else "",
    )


def _choice_into(request: pb.GenerateRequest, choice: Any) -> None:
    """none, auto (also when left out), required, or a function of the tools by name."""
    names = {tool.name for tool in request.tools}
    name = _named(choice)
    if name is not None:
        if name not in names:
            raise BadRequest(f"tool_choice names {name!r}, none of the tools", "tool_choice")
        request.tool_choice.mode, request.tool_choice.function = pb.TOOL_CHOICE_FUNCTION, name
        return
    mode = (
        CHOICES.get("auto" if choice is None else choice)
        if isinstance(choice, str | None)
        else None
    )
    if mode is None:
        raise BadRequest(
            'tool_choice must be none, auto, required or {"type": "function", "function": '
            '{"name": ...}}',
            "tool_choice",
        )
    if mode == pb.TOOL_CHOICE_REQUIRED and not names:
        raise BadRequest("tool_choice required needs tools", "tool_choice")
    request.tool_choice.mode = mode


def _named(choice: Any) -> str | None:
    """The function's name in {"type": "function", "function": {"name": ...}}; else None."""
    if not isinstance(choice, dict) or choice.get("type") != "function":
        return None
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    return name if isinstance(name, str) else None
