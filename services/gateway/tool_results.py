"""The gRPC API's tool calls: each choice's last response carries the calls parsed out of the
choice's whole text (its responses' text, joined: the same across a move to another worker, as
the stream a client reads is) and that text without them; finish_reason TOOL_CALLS when calls
were made and the model stopped by itself. The responses' `text` streams as the model wrote it.
(The HTTP API streams the calls instead, as OpenAI does: openai_format.py.)"""

from collections import defaultdict

from services.gateway.tool_parsers import Parsed, parse_output
from services.gateway.tool_request import ToolPlan
from services.gateway.tool_stream import call_id
from shared.api import tandem_pb2 as pb


async def with_tool_calls(responses, plan: ToolPlan):
    """`responses`, each choice's last one with its tool calls."""
    texts: dict[int, list[str]] = defaultdict(list)
    async for response in responses:
        texts[response.index].append(response.text)
        if response.finish_reason:
            attach(response, parse_output(plan, "".join(texts.pop(response.index))))
        yield response


def attach(response: pb.GenerateResponse, parsed: Parsed) -> None:
    response.tool_calls.extend(
        pb.ToolCall(id=call_id(), name=call.name, arguments=call.arguments) for call in parsed.calls
    )
    if parsed.content is not None:
        response.content = parsed.content
    if parsed.calls and response.finish_reason == pb.FINISH_REASON_STOP:
        response.finish_reason = pb.FINISH_REASON_TOOL_CALLS
