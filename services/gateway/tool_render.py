"""A chat with tools as the chat template is given it.

A template that renders tools (ToolFormat.native) gets them as Hugging Face's templates expect
(vLLM passes them alike): `tools=[{"type": "function", "function": {name, description,
parameters}}]`, an assistant's calls as `tool_calls=[{"id", "type": "function", "function":
{"name", "arguments": <a dict>}}]`, a tool's answer as `{"role": "tool", "content",
"tool_call_id", "name"}`.

A template that does not (SmolLM2's) gets the documented default, the Hermes format as Qwen2.5's
template writes it, in plain messages: the tools and the instruction to call them within
<tool_call></tool_call> tags in the system turn (after the request's system message, or as one of
its own), an assistant's calls as <tool_call> text after its content, and each run of tool
answers as one user turn of <tool_response> blocks.
"""

import json
from collections.abc import Sequence

from services.gateway.tool_request import arguments_of, parameters_of
from shared.api import tandem_pb2 as pb

HERMES_TOOLS = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
HERMES_CALLS = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def template_tools(tools: Sequence[pb.Tool]) -> list[dict]:
    """The tools in the shape Hugging Face's chat templates take."""
    rendered = []
    for tool in tools:
        function = {"name": tool.name}
        if tool.description:
            function["description"] = tool.description
        parameters = parameters_of(tool)
        if parameters is not None:
            function["parameters"] = parameters
        rendered.append({"type": "function", "function": function})
    return rendered


def native_chat(messages: Sequence[pb.ChatMessage]) -> list[dict]:
    """The messages for a template that renders tool calls and tool messages itself."""
    chat = []
    for i, m in enumerate(messages):
        entry = {"role": m.role, "content": m.content}
        if m.tool_calls:  # only then: Llama 3.1's template tests `'tool_calls' in message`
            entry["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {
                        "name": call.name,
                        "arguments": arguments_of(call, f"messages[{i}].tool_calls[{j}]"),
                    },
                }
                for j, call in enumerate(m.tool_calls)
            ]
        if m.role == "tool":
            entry["tool_call_id"] = m.tool_call_id
            if m.name:
                entry["name"] = m.name
        chat.append(entry)
    return chat


def hermes_chat(messages: Sequence[pb.ChatMessage], tools: Sequence[pb.Tool]) -> list[dict]:
    """The messages in plain roles, the tools and tool messages written in the Hermes format."""
    chat: list[dict] = []
    for i, m in enumerate(messages):
        if m.role == "tool":
            answer = f"<tool_response>\n{m.content}\n</tool_response>"
            if i and messages[i - 1].role == "tool":  # a run of answers is one user turn
                chat[-1]["content"] += "\n" + answer
            else:
                chat.append({"role": "user", "content": answer})
        elif m.tool_calls:
            calls = [
                _hermes_call(call, f"messages[{i}].tool_calls[{j}]")
                for j, call in enumerate(m.tool_calls)
            ]
            text = "\n".join([m.content] * bool(m.content) + calls)
            chat.append({"role": m.role, "content": text})
        else:
            chat.append({"role": m.role, "content": m.content})
    if tools:
        _with_hermes_system(chat, tools)
    return chat


def hermes_system(tools: Sequence[pb.Tool]) -> str:
    """The system text that shows a model without tool support its tools."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in template_tools(tools))
    return HERMES_TOOLS + lines + HERMES_CALLS


def _with_hermes_system(chat: list[dict], tools: Sequence[pb.Tool]) -> None:
    system = hermes_system(tools)
    if chat and chat[0]["role"] == "system":
        chat[0] = {"role": "system", "content": chat[0]["content"] + "\n\n" + system}
    else:
        chat.insert(0, {"role": "system", "content": system})


def _hermes_call(call: pb.ToolCall, where: str) -> str:
    arguments = json.dumps(arguments_of(call, where), ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{call.name}", "arguments": {arguments}}}\n</tool_call>'


def chat_of(request: pb.GenerateRequest, native: bool) -> tuple[list[dict], list[dict] | None]:
    """The request's messages and tools as the chat template takes them (`native`: it renders
    tools itself); the tools None where there are none to give it."""
    if native:
        return native_chat(request.messages), template_tools(request.tools) or None
    return hermes_chat(request.messages, request.tools), None
