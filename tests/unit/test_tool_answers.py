"""Tool calls in the answers: OpenAI's message.tool_calls and streamed delta.tool_calls with
finish_reason tool_calls, each of n choices on its own; and the gRPC API's last response of each
choice with the parsed calls and FINISH_REASON_TOOL_CALLS."""

import asyncio
import json

from services.gateway.openai_format import ChoiceLog, Formatter, TokenText
from services.gateway.openai_request import parse
from services.gateway.tool_request import ToolPlan
from services.gateway.tool_results import with_tool_calls
from shared.api import tandem_pb2 as pb

TOOLS = [{"type": "function", "function": {"name": "get_weather"}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OUTPUT = "Let me look.\n" + CALL


def response(text: str, index: int = 0, finish: int = 0) -> pb.GenerateResponse:
    return pb.GenerateResponse(text=text, index=index, token_ids=[1], finish_reason=finish)


def pieces(text: str, index: int = 0, finish=pb.FINISH_REASON_STOP) -> list[pb.GenerateResponse]:
    """The text as responses of 3 characters each, the last one finishing."""
    chunks = [text[i : i + 3] for i in range(0, len(text), 3)]
    return [response(c, index) for c in chunks[:-1]] + [response(chunks[-1], index, finish)]


HERMES = ToolPlan("hermes")


def formatter(tokenizer, plan=HERMES, **fields) -> Formatter:
    req = parse(
        "chat", {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS} | fields, "m"
    )
    return Formatter(req, "abc", TokenText(tokenizer), plan)


def test_a_whole_answer_has_its_calls_and_the_content_left(tokenizer):
    f = formatter(tokenizer)
    log = ChoiceLog()
    for r in pieces(OUTPUT):
        log.add(r)
    (choice,) = f.response({0: log}, [r])["choices"]
    message = choice["message"]
    assert message["content"] == "Let me look.\n" and choice["finish_reason"] == "tool_calls"
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_without_calls_a_whole_answer_is_text_and_stops(tokenizer):
    log = ChoiceLog()
    log.add(response("Sunny.", finish=pb.FINISH_REASON_STOP))
    (choice,) = formatter(tokenizer).response({0: log}, [response("", finish=1)])["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Sunny."}
    assert choice["finish_reason"] == "stop"


def test_a_stream_has_openais_tool_call_deltas(tokenizer):
    f = formatter(tokenizer, stream=True)
    chunks = [f.chunk(r)["choices"][0] for r in pieces(OUTPUT)]
    assert chunks[0]["delta"]["role"] == "assistant"
    assert "".join(c["delta"].get("content") or "" for c in chunks) == "Let me look.\n"
    calls = [call for c in chunks for call in c["delta"].get("tool_calls", [])]
    header, *fragments = calls
    assert (
        header["index"] == 0 and header["type"] == "function" and header["id"].startswith("call_")
    )
    assert header["function"]["name"] == "get_weather"
    assert all(set(f) == {"index", "function"} and f["index"] == 0 for f in fragments)
    arguments = header["function"]["arguments"] + "".join(
        f["function"]["arguments"] for f in fragments
    )
    assert json.loads(arguments) == {"city": "Paris"}
    assert [c["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]


def test_each_of_n_choices_streams_its_own_calls(tokenizer):
    f = formatter(tokenizer, stream=True, n=2)
    first, second = pieces(CALL, 0), pieces("No call.", 1)
    order = [r for pair in zip(first, second) for r in pair] + first[len(second) :]
    chunks = [f.chunk(r)["choices"][0] for r in order]
    by_index = {i: [c for c in chunks if c["index"] == i] for i in (0, 1)}
    assert [c["finish_reason"] for c in by_index[0]][-1] == "tool_calls"
    assert [c["finish_reason"] for c in by_index[1]][-1] == "stop"
    assert "".join(c["delta"].get("content") or "" for c in by_index[1]) == "No call."
    assert not any(c["delta"].get("tool_calls") for c in by_index[1])


def test_a_length_cut_answer_keeps_its_finish_reason(tokenizer):
    f = formatter(tokenizer, stream=True)
    chunks = [f.chunk(r)["choices"][0] for r in pieces(CALL[:40], finish=pb.FINISH_REASON_LENGTH)]
    assert chunks[-1]["finish_reason"] == "length"


def collected(responses, plan):
    async def run():
        async def source():
            for r in responses:
                yield r

        return [r async for r in with_tool_calls(source(), plan)]

    return asyncio.run(run())


def test_grpcs_last_response_of_each_choice_carries_its_calls():
    responses = pieces(OUTPUT, 0) + pieces("Sunny.", 1) + pieces(CALL, 2, pb.FINISH_REASON_LENGTH)
    out = collected(responses, ToolPlan("hermes"))
    assert "".join(r.text for r in out if r.index == 0) == OUTPUT  # the text as it was
    lasts = {r.index: r for r in out if r.finish_reason}
    (call,) = lasts[0].tool_calls
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris"}')
    assert call.id.startswith("call_") and lasts[0].content == "Let me look.\n"
    assert lasts[0].finish_reason == pb.FINISH_REASON_TOOL_CALLS
    assert not lasts[1].tool_calls and lasts[1].content == "Sunny."
    assert lasts[1].finish_reason == pb.FINISH_REASON_STOP
    assert len(lasts[2].tool_calls) == 1 and not lasts[2].HasField("content")
    assert lasts[2].finish_reason == pb.FINISH_REASON_LENGTH
    assert not any(r.tool_calls for r in out if not r.finish_reason)
