"""A chat request's messages as the GenerateRequest's: roles mapped to the chat template's,
text parts joined, an assistant's tool_calls and a tool's answer (tool_call_id, name) kept;
counted and measured before any is copied."""

import json
from typing import Any

from services.gateway.body_fields import BadRequest, fits
from services.gateway.openai_tools import calls_into
from services.gateway.validation import Limits
from shared.api import tandem_pb2 as pb
from shared.control import rules

CHAT_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
}


def messages_into(request: pb.GenerateRequest, messages: Any, limits: Limits | None) -> None:
    """The messages, counted and their text measured before any is copied (a 1 MiB body holds
    tens of thousands, or a million characters)."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages must be a non-empty list", "messages")
    if len(messages) > rules.MAX_MESSAGES:
        raise BadRequest(f"at most {rules.MAX_MESSAGES} messages", "messages")
    parts = sum(len(m["content"]) for m in messages if isinstance(m, dict) and _parts(m))
    if parts > rules.MAX_CONTENT_PARTS:
        raise BadRequest(f"at most {rules.MAX_CONTENT_PARTS} content parts in all", "messages")
    if limits is not None:
        fits(len(messages), sum(_chars(m) for m in messages), limits, "messages")
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRequest(f"{where} must be an object", where)
        role = CHAT_ROLES.get(m.get("role"))
        if role is None:
            raise BadRequest(
                f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {m.get('role')!r}",
                f"{where}.role",
            )
        if m.get("function_call"):  # the deprecated form of tool_calls
            raise BadRequest(
                f"{where}: use tool_calls, not function_call", f"{where}.function_call"
            )
        message = request.messages.add(role=role, content=_content(m.get("content"), where))
        if role == "assistant" and m.get("tool_calls") is not None:
            calls_into(message, m["tool_calls"], f"{where}.tool_calls")
        if role == "tool":
            _answer_into(message, m, where)


def _answer_into(message: pb.ChatMessage, m: dict, where: str) -> None:
    """A tool message's tool_call_id (the call it answers) and its optional name."""
    call_id, name = m.get("tool_call_id"), m.get("name")
    if not isinstance(call_id, str) or not call_id:
        raise BadRequest(
            f"{where}.tool_call_id must name the call answered", f"{where}.tool_call_id"
        )
    if not isinstance(name, str | None):
        raise BadRequest(f"{where}.name must be a string", f"{where}.name")
    message.tool_call_id, message.name = call_id, name or ""


def _parts(message: dict) -> bool:
    return isinstance(message.get("content"), list)


def _chars(message: Any) -> int:
    """The characters of a message's text and tool calls (what is neither is refused later, by
    name)."""
    content = message.get("content") if isinstance(message, dict) else None
    calls = message.get("tool_calls") if isinstance(message, dict) else None
    if isinstance(calls, list):
        return _chars({"content": content}) + sum(len(json.dumps(call)) for call in calls)
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(
            len(p["text"])
            for p in content
            if isinstance(p, dict) and isinstance(p.get("text"), str)
        )
    return 0


def _content(content: Any, where: str) -> str:
    """A message's text: a string, or a list of text parts (other parts are refused by name)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise BadRequest(f"{where}.content must be a string or a list of parts", where)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            raise BadRequest(
                f"{where}.content: only text parts are supported, got {kind or part!r}",
                f"{where}.content",
            )
        texts.append(part["text"])
    return "\n".join(texts)
